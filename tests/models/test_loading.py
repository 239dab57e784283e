"""Loading options shared by the policy and the critic: the LoRA settings are checked when built."""

import pytest

from align.errors import AlignConfigError
from align.models.loading import LoraSettings


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(r=0), r"^model\.policy\.lora\.r: expected an integer >= 1, got 0$"),
        (dict(r=2.5), r"^model\.policy\.lora\.r: expected an integer >= 1, got 2\.5$"),
        (dict(alpha=0), r"^model\.policy\.lora\.alpha: expected > 0, got 0$"),
        (dict(dropout=1.0), r"^model\.policy\.lora\.dropout: expected a value in \[0, 1\), got 1\.0$"),
        (
            dict(target_modules=[]),
            r"^model\.policy\.lora\.target_modules: expected 'all-linear' or a non-empty list of "
            r"module names, got \[\]$",
        ),
        (dict(bias="some"), r"^model\.policy\.lora\.bias: expected 'none', 'all' or 'lora_only', got 'some'$"),
        (
            dict(modules_to_save="lm_head"),
            r"^model\.policy\.lora\.modules_to_save: expected a list of module names or "
            r"null, got 'lm_head'$",
        ),
    ],
)
def test_bad_lora_settings_fail_on_one_line_naming_the_setting(settings, message):
    with pytest.raises(AlignConfigError, match=message):
        LoraSettings(**settings)


def test_good_lora_settings_pass_to_peft():
    config = LoraSettings(r=4, alpha=8, dropout=0.1, target_modules=["q_proj"], modules_to_save=["lm_head"]).to_peft()
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
