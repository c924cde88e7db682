"""Class: secrets by value. A credential inside any config string is redacted from every
record of the config (.hydra/, the checkpoint marker, wandb: all through ``scrub``), by the
published shapes of common tokens and by assignments to secret-looking names; what is not a
credential (paths, references, token ids and counts) is kept."""

import dataclasses
import json
import subprocess
import sys

from tests.conftest import ROOT
from trainer3d.config.schema import Config
from trainer3d.config.secrets import scrub

SECRETS = {
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789": "export HF_TOKEN={}",
    "0123456789abcdef0123456789abcdef01234567": "wandb login {}",
    "fedcba9876543210fedcba9876543210fedcba98": "export WANDB_API_KEY={}",
    "sk-proj-Zyxwvutsrqponmlkjihgfedcba987654": "export OPENAI_API_KEY='{}'",
    "ghp_0123456789abcdefghijABCDEFGHIJ012345": "git clone https://{}@github.com/o/r",
    "github_pat_11AAAAAAA0aaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbbbbbbbbbb": "GH={}",
    "AKIAIOSFODNN7EXAMPLE": "aws configure set aws_access_key_id {}",
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY": "export AWS_SECRET_ACCESS_KEY={}",
    "xoxb-1234567890-0987654321-AbCdEfGhIj": "SLACK={}",
    "hunter2-is-my-password": "mysql --password {}",
    "s3cr3t-v4lue": "export DB_PASSWORD=\"{}\"",
    "plain-token-value": "export TOKEN={}",
    "k3y-material": "--api-key={}",
    "pa55word": "pip install --index-url https://alice:{}@pypi.example.com/simple x",
}
KEPT = ["export HF_TOKEN=$HF_TOKEN", "export OMP_NUM_THREADS=4",
        "/hf/hub/models--x/snapshots/aaaabbbbccccddddeeeeffff0000111122223333/config.json",
        "model.bos_token_id=1", "train.max_tokens=5"]


def test_credentials_in_config_strings_are_redacted_by_value():
    cfg = Config(run_dir="/tmp/run")
    lines = [form.format(secret) for secret, form in SECRETS.items()]
    cfg.launcher = dataclasses.replace(cfg.launcher, setup=lines[:10] + KEPT, sbatch_extra=lines[10:12])
    cfg.logger = dataclasses.replace(cfg.logger, tags=lines[12:])
    found = []
    record = json.dumps(scrub(dataclasses.asdict(cfg), found))
    leaked = [secret for secret in SECRETS if secret in record]
    assert leaked == [], leaked
    assert all(kept in record for kept in KEPT), record
    places = {f.split(":")[0] for f in found}
    assert {f"launcher.setup[{i}]" for i in range(10)} | {"launcher.sbatch_extra[0]", "logger.tags[0]"} <= places


def test_the_run_records_no_token_and_says_so(tmp_path):
    token = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    proc = subprocess.run([sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={tmp_path}", "parallel=single",
                           "dry_run=true", f'launcher.setup=["export HF_TOKEN={token}"]'],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    records = sorted((tmp_path / ".hydra").iterdir())
    assert [p.name for p in records] == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert not any(token in p.read_text() for p in records)
    assert "export HF_TOKEN=<redacted>" in (tmp_path / ".hydra" / "config.yaml").read_text()
    said = [line for line in proc.stderr.splitlines() if "redacted" in line]
    assert len(said) == 1 and "launcher.setup[0]: Hugging Face token" in said[0] and token not in proc.stderr, said
