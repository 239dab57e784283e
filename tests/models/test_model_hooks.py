"""The private torch names ``align.models`` relies on, each checked on a tiny case."""

from __future__ import annotations

from torch import nn

from align.models.policy import PolicyModel


def test_every_dropout_class_shares_the_private_base(private_api):
    used_by = "align.models.policy.PolicyModel.disable_dropout"
    base = private_api.require(nn.modules.dropout, "_DropoutNd", used_by=used_by)
    assert all(isinstance(m, base) for m in (nn.Dropout(), nn.Dropout1d(), nn.Dropout2d(), nn.AlphaDropout()))
    policy = PolicyModel("tiny", seed=0)
    policy.add_module("extra_dropout", nn.Dropout(0.5))
    policy.disable_dropout()
    assert policy.extra_dropout.p == 0.0
