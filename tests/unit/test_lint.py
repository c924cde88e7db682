"""The code base stays clean as it grows: ruff's error and bug rules (pyproject.toml
[tool.ruff]) pass everywhere, and comments say what is and why, not how the code came to be."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SOURCES = ["trainer3d", "tools", "tests"]
# Phrases that narrate a change instead of describing the code (STYLE: comments say what is).
HISTORY = re.compile(r"\b(before this change|after this change|previously|formerly|used to be|the old code)\b", re.I)


def test_ruff_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *SOURCES], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_comments_describe_the_code_not_its_history():
    hits = []
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if path == Path(__file__):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if HISTORY.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)
