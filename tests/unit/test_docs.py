"""The documentation does not rot: in README.md, docs/*.md, tests/README.md and tools/README.md
every relative link and anchor resolves, every repository path quoted in backticks exists, and
every ``python -m trainer3d.*`` or ``tools/*.py`` command shown names a module or script that
answers ``--help``. README.md stays a short page that maps every docs/ page and shows CI's test
command as CI runs it."""

import contextlib
import functools
import importlib.util
import io
import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
         ROOT / "tools" / "README.md"]
README_LIMIT = 10 * 1024
"""A page a newcomer reads in five minutes; the rest lives in docs/."""

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# A path inside the repository: it starts at one of its top-level entries.
REPO_PATH = re.compile(r"(?<![\w./~-])((?:trainer3d|conf|tests|tools|slurm|docs|\.ci)/[\w./*-]*"
                       r"|(?:pyproject\.toml|README\.md)\b)")
MODULE_COMMAND = re.compile(r"\bpython3? -m (trainer3d(?:\.\w+)*)")
SCRIPT_COMMAND = re.compile(r"\bpython3? (tools/[\w/]+\.py)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


@functools.lru_cache(maxsize=None)
def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", _text(page))


def _code(page: Path) -> str:
    """What the page shows as code: fenced blocks and inline spans."""
    blocks = [m.group(0) for m in FENCE.finditer(_text(page))]
    return "\n".join(blocks + [m.group(2) for m in SPAN.finditer(_prose(page))])


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped but for
    hyphens and underscores, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset:
    seen, out = {}, set()
    for line in _prose(page).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def _links(page: Path):
    for match in LINK.finditer(_prose(page)):
        target = match.group(1)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
            yield target


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_and_anchors_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{_rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_quoted_repository_paths_exist(page):
    missing = set()
    for path in REPO_PATH.findall(_code(page)):
        path = path.rstrip(".,:;)")
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found:
            missing.add(path)
    assert not missing, f"{_rel(page)} quotes paths the repository does not have: {sorted(missing)}"


def _commands():
    """Every ``python -m trainer3d...`` and ``python tools/....py`` the pages show, once each."""
    found = set()
    for page in PAGES:
        found.update(f"-m {module}" for module in MODULE_COMMAND.findall(_code(page)))
        found.update(SCRIPT_COMMAND.findall(_code(page)))
    return sorted(found)


@pytest.mark.parametrize("command", _commands(), ids=lambda c: f"python {c}")
def test_commands_answer_help(command, monkeypatch):
    # In this process, as `python <command> --help` runs it (torch and the engine imported
    # once for all of them): run as __main__, a script's own directory first on sys.path.
    module = command[3:] if command.startswith("-m ") else None
    if module:
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
    else:
        assert (ROOT / command).is_file(), f"python {command}: no such script"
        monkeypatch.syspath_prepend(str((ROOT / command).parent))
    monkeypatch.setattr(sys, "argv", [module or str(ROOT / command), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / command), run_name="__main__")
    assert exit_.value.code in (0, None), f"python {command} --help exited with {exit_.value.code}"
    assert "usage:" in out.getvalue() or "powered by Hydra" in out.getvalue()


def test_readme_is_short_and_maps_every_docs_page():
    readme = ROOT / "README.md"
    assert len(_text(readme).encode()) <= README_LIMIT, "move detail from README.md into a docs/ page"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in _links(readme)}
    unmapped = [_rel(p) for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert unmapped == [], f"README.md's map of the docs lacks {unmapped}"


def test_readme_shows_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if ".venv/bin/python -m pytest" in line)
    assert f"\n{command}\n" in _text(ROOT / "README.md")
