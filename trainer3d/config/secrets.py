"""Credentials kept out of every record of a run's config: ``.hydra/``, checkpoint markers, wandb.

A config carries credentials in two ways: under a key that names one (``api_key``,
``hfToken``), and as a value inside an ordinary string — a ``launcher.setup`` line
``export HF_TOKEN=hf_...``, an ``sbatch_extra`` flag, a URL with a password. ``scrub``
replaces both: values under secret-looking keys, and substrings that match the published
shapes of common tokens (``TOKEN_PATTERNS``) or a shell/flag assignment to a secret-looking
name (``HF_TOKEN=...``, ``--password=...``), each with ``<redacted>``. What it replaced is
listed by place and kind (never by value), so the run can say so in one line.

Only the records are scrubbed: the config the run executes keeps its values (a setup line
must still export the token it names). A reference (``$HF_TOKEN``, ``${oc.env:HF_TOKEN}``)
is not a secret and is kept: it is the way to pass one.
"""

import re
from typing import List, Optional, Tuple

REDACTED = "<redacted>"
SECRET_MARKERS = ("key", "token", "secret", "password")

_EDGE = r"(?<![A-Za-z0-9])"
TOKEN_PATTERNS: Tuple[Tuple[str, "re.Pattern[str]"], ...] = tuple((kind, re.compile(rx)) for kind, rx in (
    ("private key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"),
    ("Hugging Face token", _EDGE + r"hf_[A-Za-z0-9]{20,}"),
    ("GitHub token", _EDGE + r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    ("API key (sk-)", _EDGE + r"sk-[A-Za-z0-9_\-]{20,}"),
    ("AWS access key id", _EDGE + r"(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])"),
    ("Slack token", _EDGE + r"xox[abposr]-[A-Za-z0-9\-]{10,}"),
    ("bearer token", r"(?i)(?<=bearer )[A-Za-z0-9._~+/\-]{8,}=*"),
    # wandb's API keys are 40 hex digits; a path component of that shape (a Hugging Face
    # snapshot, a git commit in a directory name) is a name, not a key, and is kept.
    ("40-hex key (wandb)", r"(?<![\w/.\-])[0-9a-fA-F]{40}(?![\w/.\-])"),
    ("password in a URL", r"(?<=://)[^/\s:@]+:[^/\s@]+(?=@)"),
))
_VALUE = r"(?P<quote>[\"']?)(?P<value>[^\s\"',;\]\[]+)"
ASSIGNMENTS = (re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)\s*[=:]\s*" + _VALUE),  # HF_TOKEN=..., key: ...
               re.compile(r"(?<!\S)--?(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)\s+" + _VALUE))  # --password ...
_SECRET_NAME = re.compile(r"(?i)(?:token|key|secret|password|passwd|pwd|credentials?)$")


def looks_secret(key: str) -> bool:
    """``api_key``, ``Token``, ``hfToken``: yes; ``bos_token_id``, ``eos_token_ids``,
    ``tokenizer``, ``max_tokens``, ``exclude_keys``: no (a vocabulary's token ids, its tokenizer,
    counts and lists of names are not credentials)."""
    key = key.lower()
    if re.search(r"(_ids?|keys|tokens)$", key) or "tokenizer" in key:  # ids, counts and lists of names
        return False
    return any(m in key for m in SECRET_MARKERS)


def _is_reference(value: str) -> bool:
    return value.startswith("$") or value == REDACTED or value.startswith("<redacted")


def redact_text(text: str) -> Tuple[str, List[str]]:
    """``text`` with credentials replaced, and the kinds replaced (in order, repeats kept)."""
    kinds: List[str] = []
    for kind, pattern in TOKEN_PATTERNS:
        text, n = pattern.subn(REDACTED, text)
        kinds += [kind] * n

    def assignment(m: "re.Match[str]") -> str:
        name = m.group("name").rsplit(".", 1)[-1]
        if not _SECRET_NAME.search(name) or not looks_secret(name) or _is_reference(m.group("value")):
            return m.group(0)
        kinds.append(f"value of {name}")
        return m.group(0)[:m.start("value") - m.start(0)] + REDACTED

    for pattern in ASSIGNMENTS:
        text = pattern.sub(assignment, text)
    return text, kinds


def scrub(value, found: Optional[List[str]] = None, where: str = ""):
    """The config as plain data, with anything that looks like a credential removed; each
    replacement is appended to ``found`` as ``<place>: <kind>``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            place = f"{where}.{k}" if where else str(k)
            if isinstance(k, str) and looks_secret(k) and v not in (None, "", REDACTED):
                out[k] = REDACTED
                if found is not None:
                    found.append(f"{place}: value under a secret-looking key")
            else:
                out[k] = scrub(v, found, place)
        return out
    if isinstance(value, (list, tuple)):
        return [scrub(v, found, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        text, kinds = redact_text(value)
        if found is not None:
            found += [f"{where or 'value'}: {kind}" for kind in dict.fromkeys(kinds)]
        return text
    return value


def redaction_line(found: List[str], records: str) -> Optional[str]:
    """One line saying what was redacted from ``records`` (None if nothing was)."""
    if not found:
        return None
    found = list(dict.fromkeys(found))
    return (f"trainer3d: redacted {len(found)} value(s) that look like credentials from {records} (the run "
            "itself uses the values given): " + "; ".join(found))
