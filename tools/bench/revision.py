"""The source tree of another git revision, for the benches that measure this tree against it
(``--against REV``: tools/bench/hotpath.py, host_overhead.py, deepspeed_pair.py). Standard
library only: a bench's child imports trainer3d from the extracted tree, so nothing here may
import it first."""

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def extract_revision(rev: str, into: Path, paths=("trainer3d", "conf")) -> Path:
    """``paths`` as they are at git revision ``rev`` (``git archive``), under ``into``; returns ``into``."""
    archive = into / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev, *paths], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into
