"""Credentials kept out of a run's saved config (align.cli.secrets): which setting names are secret, what their values
become (a mapping keeps its keys), what passes untouched, and the config writer redacting before it saves. (A run's
whole folder checked for a secret: tests/e2e/test_secrets.py.)"""

import pytest
from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback

from align.cli.secrets import REDACTED, SECRET_KEY, RedactingSaveConfigCallback, redact_secrets


@pytest.mark.parametrize(
    "key",
    ["headers", "token", "HF_TOKEN", "access_token", "bearer_token", "secret", "client_secret", "password", "passwd",
     "api_key", "openai_api_key", "apikey", "authorization", "credential", "credentials"],
)  # fmt: skip
def test_secret_setting_names(key):
    assert SECRET_KEY.search(key)


@pytest.mark.parametrize("key", ["pad_token", "max_new_tokens", "tokenizer", "token_budget", "secrets_dir", "key"])
def test_ordinary_setting_names(key):
    assert not SECRET_KEY.search(key)


def test_values_under_secret_names_are_redacted_in_a_copy_of_any_shape():
    config = Namespace(
        model=Namespace(api_key="k", pad_token="</s>", password=None, token=7, secret=True),
        trainer={"logger": [{"headers": {"x-api-key": "k", "authorization": "b"}}, ("token", "t")]},
        tokens=("a", "b"),
    )
    out = redact_secrets(config)
    assert isinstance(out, Namespace) and out is not config
    assert out.model == Namespace(api_key=REDACTED, pad_token="</s>", password=None, token=7, secret=True)
    assert out.trainer["logger"][0] == {"headers": {"x-api-key": REDACTED, "authorization": REDACTED}}
    assert out.trainer["logger"][1] == ("token", "t")  # a list's items have no setting name
    assert out.tokens == ("a", "b") and type(out.trainer["logger"]) is list
    assert config.model.api_key == "k"  # the run keeps the real value
    assert redact_secrets({"api_key": ["a", "b"]}) == {"api_key": REDACTED}


def test_the_config_writer_redacts_before_it_saves_once(monkeypatch):
    saved = []
    monkeypatch.setattr(SaveConfigCallback, "setup", lambda self, *args: saved.append(self.config))
    callback = RedactingSaveConfigCallback.__new__(RedactingSaveConfigCallback)
    callback.config, callback.already_saved = Namespace(token="t", seed=1), False
    callback.setup(None, None, "fit")
    assert saved == [Namespace(token=REDACTED, seed=1)]
    callback.config, callback.already_saved = Namespace(token="t"), True  # saved already: left as it is
    callback.setup(None, None, "fit")
    assert saved[-1] == Namespace(token="t")
