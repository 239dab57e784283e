"""A model name that is neither a local path nor an id align ships fails at once on one line: offline without a
hub lookup, online after one request (no client retries), with the nearest shipped id, the list of them, and what
loads offline. A run folder given as a model names its checkpoint."""

import huggingface_hub
import pytest
from huggingface_hub.errors import RepositoryNotFoundError

from align.errors import AlignConfigError
from align.hub import check_model_source, load_tokenizer, names


def test_an_unknown_id_offline_fails_without_a_lookup_naming_the_nearest_shipped_id(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("no lookup offline"))
    monkeypatch.setattr(names, "_offline", lambda: True)
    with pytest.raises(AlignConfigError) as info:
        check_model_source("smollm2-135m")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model: 'smollm2-135m' is not a local path or an id align ships")
    assert "HF_HUB_OFFLINE is set" in message and "did you mean 'smollm2-135m-instruct'?" in message
    assert "align's own ids: smollm2-135m-instruct, tiny, tiny-sort, tiny-sort-grpo, tiny-sort-rm" in message
    with pytest.raises(AlignConfigError, match="tokenizer: 'smollm2-135m' is not a local path"):
        load_tokenizer("smollm2-135m")


def test_a_cached_hub_id_offline_is_left_to_the_loader(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(names, "_offline", lambda: True)
    (tmp_path / "models--org--cached-model").mkdir()
    assert check_model_source("org/cached-model") == "org/cached-model"


@pytest.mark.parametrize(
    "error, reason",
    [
        (
            lambda: RepositoryNotFoundError.__new__(RepositoryNotFoundError),
            "the Hugging Face hub has no model of that id",
        ),
        (
            lambda: OSError("Name or service not known"),
            "the Hugging Face hub could not be reached (OSError: Name or service not known)",
        ),
    ],
    ids=["no-such-model", "no-network"],
)
def test_an_unknown_id_online_fails_after_one_request(monkeypatch, tmp_path, error, reason):
    calls = []

    def model_info(self, repo_id, timeout=None, **kwargs):
        calls.append(repo_id)
        raise error()

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(names, "_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(AlignConfigError) as info:
        check_model_source("HuggingFaceTB/SmolLM2-135M-Instruc")
    assert calls == ["HuggingFaceTB/SmolLM2-135M-Instruc"]
    assert reason in str(info.value) and "align's own ids:" in str(info.value) and "\n" not in str(info.value)


def test_a_run_folder_given_as_the_model_names_its_checkpoint(tmp_path):
    run = tmp_path / "runs" / "version_2"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    for given in (run, tmp_path / "runs"):
        with pytest.raises(AlignConfigError) as info:
            check_model_source(str(given))
        assert str(info.value).startswith(
            f"model: '{given}' is an align run folder, not a model folder; its "
            f"checkpoint is {run / 'checkpoints' / 'last.ckpt'}: align generate"
        )
    with pytest.raises(AlignConfigError, match="is a directory without config.json"):
        check_model_source(str(tmp_path / "runs" / "version_2" / "checkpoints"))
