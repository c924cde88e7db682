"""Class: markers validated like any untrusted file. A correctly re-sealed marker with malformed
file entries, a step outside its checkpoint, malformed fields or JSON nested past the parser's
recursion is a damaged checkpoint: ``auto`` skips it naming why, an explicit path is refused in
one line, nothing raises."""

import json

import pytest

from tests.integration.test_checkpoint_safety import _cfg, _save
from trainer3d import train
from trainer3d.checkpoint import digest, store
from trainer3d.checkpoint.choose import choose


def _files(info, entry):
    name = next(n for n in info["files"] if n != ".metadata")
    return {**info["files"], name: entry}


def _hex(info):
    return next(e for n, e in info["files"].items() if n != ".metadata")


EDITS = {
    "entry not an object": lambda i: {**i, "files": _files(i, "deadbeef")},
    "byte count a string": lambda i: {**i, "files": _files(i, {**_hex(i), "bytes": str(_hex(i)["bytes"])})},
    "byte count negative": lambda i: {**i, "files": _files(i, {**_hex(i), "bytes": -1})},
    "byte count a bool": lambda i: {**i, "files": _files(i, {**_hex(i), "bytes": True})},
    "digest a list": lambda i: {**i, "files": _files(i, {**_hex(i), "xxh3_128": [1, 2]})},
    "digest not hex": lambda i: {**i, "files": _files(i, {**_hex(i), "xxh3_128": "../../etc/passwd"})},
    "entry without digest": lambda i: {**i, "files": _files(i, {"bytes": 10})},
    "step of another checkpoint": lambda i: {**i, "step": 7},
    "step negative": lambda i: {**i, "step": -20},
    "step a bool": lambda i: {**i, "step": True},
    "step huge": lambda i: {**i, "step": 10 ** 30},
    "layout a string": lambda i: {**i, "layout": "tp=2"},
    "model a list": lambda i: {**i, "config": {"model": [1, 2]}},
}


def _reseal(path, edit):
    info = json.loads((path / store.MARKER).read_text())
    info.pop(digest.SEAL)
    (path / store.MARKER).write_text(json.dumps(digest.seal(edit(info))))


def _deep(path, _edit):
    depth = 100_000
    (path / store.MARKER).write_text('{"step": 20, "files": {}, "config": {"model": ' + "[" * depth + "]" * depth + "}}")


CASES = [*((name, _reseal, edit) for name, edit in EDITS.items()), ("nested past recursion", _deep, None)]


@pytest.mark.parametrize("name,damage,edit", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_marker_is_a_damaged_checkpoint(tmp_path, capsys, name, damage, edit):
    good, bad = _save(tmp_path, 10), _save(tmp_path, 20)
    damage(bad, edit)
    ok, why = store.is_complete(bad)
    assert not ok and store.MARKER in why, why
    cfg = _cfg(resume="auto")
    cfg.checkpoint.dir = str(tmp_path)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        choice = choose(cfg, tmp_path)
    assert choice.path == good and choice.skipped == [(bad, why)]
    assert train.run(_cfg(resume=str(bad))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"train.resume={bad} is not a usable checkpoint" in err[0] and why in err[0], err
