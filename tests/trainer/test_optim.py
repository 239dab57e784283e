"""The language-model learning-rate schedule: warmup, then cosine, linear or constant decay; bad settings fail on one
line naming the setting."""

import pytest
import torch

from align.errors import AlignConfigError
from align.trainer.optim import WarmupLR


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_warmup_then_linear_decay_to_the_floor():
    schedule = WarmupLR(optimizer(), warmup_steps=1, total_steps=3, decay="linear", min_lr_ratio=0.5)
    assert [schedule._factor(step) for step in range(4)] == [0.5, 1.0, 0.75, 0.5]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(decay="step"), r"^model\.scheduler\.decay: expected 'cosine', 'linear' or 'constant', got 'step'$"),
        (dict(warmup_steps=-1), r"^model\.scheduler\.warmup_steps: expected an integer >= 0, got -1$"),
        (
            dict(total_steps=0),
            r"^model\.scheduler\.total_steps: expected an integer >= 1 or null \(the trainer's\), "
            r"got 0$",
        ),
        (dict(min_lr_ratio=1.5), r"^model\.scheduler\.min_lr_ratio: expected a value in \[0, 1\], got 1\.5$"),
    ],
)
def test_bad_settings_fail_on_one_line_naming_the_setting(settings, message):
    with pytest.raises(AlignConfigError, match=message):
        WarmupLR(optimizer(), **settings)
