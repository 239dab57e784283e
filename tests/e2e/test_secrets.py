"""Secrets given to the run (OTLP headers, tokens) never reach the run directory: not config.yaml, not
hparams.yaml, not the metrics, not the checkpoints."""

import json

from align.cli.recipes import run_recipe
from align.cli.secrets import REDACTED, redact_secrets
from align.data.sft import SFTDataModule
from align.modules.sft import SFTModule

SECRET = "Bearer s3cr3t-value-0123"


def test_otlp_headers_and_tokens_are_redacted_from_everything_the_run_writes(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "sort: b a", "completion": "a b"}) + "\n")
    root = tmp_path / "run"
    logger = {
        "class_path": "align.observability.OTLPLogger",
        "init_args": {
            "endpoint": "http://127.0.0.1:9",
            "protocol": "http/protobuf",
            "timeout": 0.2,
            "export_interval": 3600,
            "headers": {"authorization": SECRET},
        },
    }
    run_recipe(
        "sft",
        SFTModule,
        SFTDataModule,
        args=[
            "--data.init_args.train_files",
            str(data),
            "--data.init_args.val_files",
            "null",
            "--trainer.default_root_dir",
            str(root),
            "--trainer.max_steps",
            "1",
            "--eval_before_after",
            "false",
            "--trainer.logger",
            json.dumps([logger]),
        ],
    )
    written = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and any(p.suffix == ".ckpt" for p in written)
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path
    config = next(p for p in written if p.name == "config.yaml").read_text()
    assert REDACTED in config and "127.0.0.1:9" in config  # only the secret is hidden


def test_redaction_keeps_ordinary_token_settings():
    config = {
        "model": {"pad_token": "</s>", "max_new_tokens": 8, "hf_token": "hf_abc", "api_key": "k"},
        "logger": [{"init_args": {"headers": {"x-api-key": "k", "authorization": "b"}}}],
    }
    out = redact_secrets(config)
    assert out["model"] == {"pad_token": "</s>", "max_new_tokens": 8, "hf_token": REDACTED, "api_key": REDACTED}
    assert out["logger"][0]["init_args"]["headers"] == {"x-api-key": REDACTED, "authorization": REDACTED}
    assert config["model"]["hf_token"] == "hf_abc"  # a copy: the run itself still gets the real value
