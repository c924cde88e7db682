"""The wandb sink, for real, offline: what it writes can be read back from the run's files."""

import dataclasses
import time


from trainer3d.config.schema import Config
from trainer3d.observe.loggers import WandbLogger, scrub, wandb_mode
from trainer3d.config.validate import layout_of
from tests.support.wandb_records import read_run, run_files


def test_mode_resolution():
    assert wandb_mode("auto", {}) == "offline"
    assert wandb_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode("disabled", {"WANDB_API_KEY": "k"}) == "disabled"


def test_scrub_removes_credentials():
    assert scrub({"a": 1, "api_key": "s", "nested": {"Token": "t", "b": [1, {"password": 3}]}}) == \
        {"a": 1, "api_key": "<redacted>", "nested": {"Token": "<redacted>", "b": [1, {"password": "<redacted>"}]}}


def test_scrub_keeps_token_ids_and_tokenizers():
    kept = {"bos_token_id": 1, "eos_token_ids": [2, 3], "tokenizer": "t.json"}
    assert scrub({"model": kept, "hfToken": "s"}) == {"model": kept, "hfToken": "<redacted>"}


def test_offline_run_holds_config_and_steps_and_resumes_by_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sk-never-written-anywhere-0123456789")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = Config(run_dir=str(tmp_path))
    cfg.logger = dataclasses.replace(cfg.logger, name="wandb", mode="offline", group="sweep-7", tags=["t1"])
    for attempt in range(2):  # a requeued job opens the same run dir again
        logger = WandbLogger(cfg)
        logger.log([{"step": s, "loss": 5.0 - s, "lr": 1e-3} for s in range(attempt * 3, attempt * 3 + 3)])
        logger.close()
        # wandb names an offline run's directory by the second it started: a requeued job starts
        # seconds later, never within the same second (which would reuse, and overwrite, the dir).
        time.sleep(1.1)
    files = run_files(tmp_path)
    ids = {f.stem for f in files}  # run-<id>: a resumed offline run writes a new dir, same id
    assert len(ids) == 1, f"one wandb run per training run, got {ids}"
    runs = [read_run(f) for f in files]
    assert runs[0]["run"].run_group == "sweep-7" and list(runs[0]["run"].tags) == ["t1"]
    config = runs[0]["config"]
    assert config["parallel"]["dp"] == cfg.parallel.dp and config["layout"] == layout_of(cfg)
    steps = [h for r in runs for h in r["history"]]
    assert [h["_step"] for h in steps] == list(range(6))
    assert [h["loss"] for h in steps] == [5.0 - s for s in range(6)]
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"sk-never-written-anywhere" not in path.read_bytes(), f"API key written to {path}"
