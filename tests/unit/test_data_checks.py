"""Bad data is refused before launch, one line naming the file and the fix (exit status 2).

Most cases call the checks the entry point runs (``trainer3d.preflight.data_checks.check_data`` on the
composed, validated config); two go through the entry point's ``run``
(trainer3d/train.py) in this process, its launch replaced by a failure: nothing may launch.
"""

import json

import numpy as np
import pytest

from trainer3d.data import BYTE_LEVEL, TokenizerInfo, write_token_file
from trainer3d.data.loader import build_readers
from trainer3d.data.tokens import TokenFileError
from trainer3d.preflight.data_checks import check_data
from trainer3d.data.sources import eval_windows
from trainer3d.data.tokens import header_path
from trainer3d.config.validate import ConfigError, validate
from tests.unit.test_validate import make

# seq_len 32, global batch 4 (micro 2 x dp 2): a window is 33 tokens, a batch 4 windows
SMALL = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4"]
OTHER_TOKENIZER = TokenizerInfo(name="other.json", sha256="0" * 64, path="/nowhere/other.json")


def checked(tmp_path, overrides):
    cfg = validate(make([*SMALL, f"data.cache_dir={tmp_path / 'cache'}", *overrides]))
    return check_data(cfg)


def token_file(tmp_path, name, n_tokens, vocab=257, tokenizer=BYTE_LEVEL, ids=None):
    ids = np.arange(n_tokens) % min(vocab, 256) if ids is None else ids
    return write_token_file(tmp_path / name, ids, vocab, tokenizer, eos_id=0)


def empty_file(tmp_path):
    path = token_file(tmp_path, "e.bin", 0)
    return path


def old_header(tmp_path):
    path = token_file(tmp_path, "o.bin", 1000)
    header_path(path).write_text(json.dumps({"dtype": "uint16", "vocab_size": 257, "n_tokens": 1000}))
    return path


def truncated(tmp_path):
    path = token_file(tmp_path, "t.bin", 1000)
    with open(path, "r+b") as f:
        f.truncate(1000)
    return path


# (make the file(s) -> overrides, a fragment the one-line problem must contain)
CASES = {
    "missing": (lambda d: ["data=tokens", f"data.path={d / 'nope.bin'}"], "nope.bin (or its header nope.json) not found"),
    "old header": (lambda d: ["data=tokens", f"data.path={old_header(d)}"], "o.json: header lacks max_id"),
    "size": (lambda d: ["data=tokens", f"data.path={truncated(d)}"], "t.bin is 1000 bytes, its header says 1000 uint16"),
    "empty": (lambda d: ["data=tokens", f"data.path={empty_file(d)}"], "e.bin holds no tokens"),
    "shorter than a window": (lambda d: ["data=tokens", f"data.path={token_file(d, 's.bin', 30)}"],
                              "s.bin: 30 training tokens, shorter than one window of train.seq_len+1 = 33"),
    "fewer windows than a batch": (lambda d: ["data=tokens", f"data.path={token_file(d, 'f.bin', 100)}"],
                                   "3 windows of train.seq_len+1 = 33 tokens, fewer than train.global_batch_size=4"),
    "vocab above the model's": (lambda d: ["data=tokens", f"data.path={token_file(d, 'v.bin', 1000, vocab=300)}"],
                                "v.bin: tokenizer vocabulary 300 > model.vocab_size=257; set model.vocab_size=300"),
    "blend of tokenizers": (lambda d: ["data=tokens", f"data.blend=[{{path:{token_file(d, 'a.bin', 1000)},weight:2}},"
                                       f"{{path:{token_file(d, 'b.bin', 1000, tokenizer=OTHER_TOKENIZER)},weight:1}}]"],
                            "were made with different tokenizers"),
    "validation of another tokenizer": (lambda d: ["data=tokens", f"data.path={token_file(d, 'a.bin', 1000)}",
                                                   f"data.val_path={token_file(d, 'b.bin', 2000, tokenizer=OTHER_TOKENIZER)}"],
                                        "were made with different tokenizers"),
    "empty validation split": (lambda d: ["data=tokens", f"data.path={token_file(d, 'a.bin', 5000)}",
                                          "data.val_fraction=0.0001"],
                               "data.val_fraction=0.0001: the validation split holds no window of"),
}


def _blend_with_a_short_tail(d):
    """a.bin's tail (200 tokens, 6 windows) fills a batch of 4; b.bin's (20 tokens) holds no window."""
    return ["data=tokens", f"data.blend=[{{path:{token_file(d, 'a.bin', 10000)},weight:1}},"
            f"{{path:{token_file(d, 'b.bin', 1000)},weight:1}}]", "data.val_fraction=0.02", "train.eval_steps=1"]


CASES["a blend's validation tail shorter than a window"] = (
    _blend_with_a_short_tail, "b.bin: its validation tail (the last data.val_fraction=0.02 of it) is 20 tokens, "
    "shorter than one window of train.seq_len+1 = 33; set data.val_fraction=0.033 (the smallest that gives it one)")


def test_the_ranks_refuse_a_short_tail_with_the_checks_own_line(tmp_path):
    """The loader builds the validation reader from the same plan (even with train.eval_every=0):
    without the check, every rank died there on SampleOrder's 'every source needs at least one window'."""
    cfg = validate(make([*SMALL, f"data.cache_dir={tmp_path / 'cache'}", *_blend_with_a_short_tail(tmp_path),
                         "train.eval_every=0", "train.eval_steps=10"]))
    (line,) = check_data(cfg)
    with pytest.raises(TokenFileError) as err:
        build_readers(cfg, dp=2, dp_rank=0)
    assert str(err.value) == line


def test_a_split_without_a_window_is_refused_naming_the_fraction_that_gives_one(tmp_path):
    # 5,000 tokens; a split of n tokens holds (n - 1) // 32 windows of 33 (each starts where the last
    # one's inputs end): one window needs n >= 33; 0.007 x 5,000 = 35 is the first thousandth there
    # (0.006: 30 tokens, a tail without a window; 0.0001: 0 tokens, no tail at all)
    path = token_file(tmp_path, "a.bin", 5000)
    data = ["data=tokens", f"data.path={path}"]
    assert checked(tmp_path, [*data, "data.val_fraction=0.0001"]) == [
        "data.val_fraction=0.0001: the validation split holds no window of train.seq_len+1 = 33 tokens; "
        "set data.val_fraction=0.007 (the smallest that holds one), or set train.eval_every=0"]
    (line,) = checked(tmp_path, [*data, "data.val_fraction=0.006"])
    assert "is 30 tokens, shorter than one window" in line and "set data.val_fraction=0.007 (the smallest" in line
    # one window, or three (0.02: 100 tokens), fewer than one global batch of 4: evaluated as they are
    assert checked(tmp_path, [*data, "data.val_fraction=0.007"]) == []
    assert checked(tmp_path, [*data, "data.val_fraction=0.02"]) == []


def test_a_small_corpus_evaluates_on_its_first_try(tmp_path):
    # issue 45's user: 300,000 tokens with data.val_fraction=0.01 and every other knob at its default
    # (seq_len 128, global batch 32): 3,000 held-out tokens, 2,999 // 128 = 23 windows, once refused as
    # "fewer than one global batch"; now all 23 are evaluated
    path = token_file(tmp_path, "small.bin", 300_000)
    cfg = validate(make(["data=tokens", f"data.path={path}", "data.val_fraction=0.01",
                         f"data.cache_dir={tmp_path / 'cache'}"]))
    assert (cfg.train.seq_len, cfg.train.global_batch_size) == (128, 32)
    assert check_data(cfg) == []
    assert eval_windows(cfg, 23) == 23


def test_an_evaluation_reads_every_window_up_to_eval_steps_batches(tmp_path):
    # 0.2 x 5,000 = 1,000 tokens = 999 // 32 = 31 windows: all of them (7 whole global batches of 4 and 3
    # windows), fewer than train.eval_steps=10 batches of 4 = 40; of 400 windows, those 40
    path = token_file(tmp_path, "a.bin", 5000)
    overrides = ["data=tokens", f"data.path={path}", "data.val_fraction=0.2", "train.eval_steps=10"]
    assert checked(tmp_path, overrides) == []
    cfg = validate(make([*SMALL, *overrides]))
    assert eval_windows(cfg, 31) == 31 and eval_windows(cfg, 400) == 40
    cfg.train.eval_steps = None
    assert eval_windows(cfg, 400) == 400


@pytest.mark.parametrize("case", CASES)
def test_bad_data_is_refused_before_launch(tmp_path, case):
    overrides, fragment = CASES[case]
    problems = checked(tmp_path, overrides(tmp_path))
    assert len(problems) == 1 and fragment in problems[0], problems


def test_corrupted_data_is_refused_before_launch(tmp_path):
    path = token_file(tmp_path, "c.bin", 1000)
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    problems = checked(tmp_path, ["data=tokens", f"data.path={path}"])
    assert problems == [f"{path}: sha256 of the data does not match its header: the file is corrupted or was "
                        "changed after it was written; rebuild it with: python tools/prepare_data.py --out "
                        "<file.bin> <texts...>"]


def test_good_data_passes(tmp_path):
    a, b = token_file(tmp_path, "a.bin", 3000), token_file(tmp_path, "b.bin", 2000)
    assert checked(tmp_path, ["data=tokens", f"data.blend=[{{path:{a},weight:0.7}},{{path:{b},weight:0.3}}]",
                              "data.val_fraction=0.1", "train.eval_steps=2"]) == []


# The data knobs among themselves (trainer3d/config/validate.py, no files involved)
BAD_KNOBS = [
    (["data=tokens", "data.path=a.bin", "data.blend=[{path:b.bin,weight:1}]"], "data.path and data.blend are both set"),
    (["data.blend=[{path:b.bin,weight:1}]"], "data.blend needs data=tokens"),
    (["data=tokens", "data.blend=[{path:a.bin,weight:0}]"], "data.blend[0].weight=0.0 must be > 0"),
    (["data.val_fraction=1.0"], "data.val_fraction=1.0 must be in [0, 1)"),
    (["data.val_path=v.bin"], "data.val_fraction and data.val_path are both set"),
    (["train.eval_every=-1"], "train.eval_every=-1 must be >= 0"),
    (["train.eval_steps=0"], "train.eval_steps=0 must be >= 1, or null"),
]


@pytest.mark.parametrize("overrides,fragment", BAD_KNOBS, ids=[" ".join(o) for o, _ in BAD_KNOBS])
def test_data_knobs_are_checked(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    assert any(fragment in p for p in err.value.problems), err.value.problems


def run_entry_point(tmp_path, monkeypatch, capsys, *overrides):
    """The entry point's exit status and stderr for ``overrides`` (its launch fails the test)."""
    from trainer3d import train

    monkeypatch.setattr(train, "launch", lambda cfg, record=None: pytest.fail("launched"))
    code = train.run(make([f"data.cache_dir={tmp_path / 'cache'}", *SMALL, *overrides]))
    return code, capsys.readouterr().err


def test_ids_beyond_the_model_vocabulary_stop_the_entry_point_with_tensor_parallelism(tmp_path, monkeypatch, capsys):
    """With tp=2 such ids would embed as zeros and train silently: refused, nothing launched."""
    path = token_file(tmp_path, "big.bin", 2000, vocab=300, ids=np.arange(2000) % 300)
    code, err = run_entry_point(tmp_path, monkeypatch, capsys, "parallel=single", "parallel.tp=2", "data=tokens",
                                f"data.path={path}")
    assert code == 2, err
    assert err.strip() == (f"trainer3d: data error: {path}: tokenizer vocabulary 300 > "
                           "model.vocab_size=257; set model.vocab_size=300 (or more)")


def test_a_blend_on_the_command_line_is_checked_by_the_entry_point(tmp_path, monkeypatch, capsys):
    a, b = token_file(tmp_path, "a.bin", 3000), token_file(tmp_path, "b.bin", 3000, tokenizer=OTHER_TOKENIZER)
    blend = f"data.blend=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]"
    code, err = run_entry_point(tmp_path, monkeypatch, capsys, "parallel=dp2", "data=tokens", blend)
    assert code == 2, err
    assert "were made with different tokenizers" in err and len(err.strip().splitlines()) == 1
