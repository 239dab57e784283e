"""``align.strategies``: the public path of the strategies that configs name (``align.strategies.FSDP2Strategy``), an
alias of :mod:`align.trainer.strategies`; importing it registers the short names (``--trainer.strategy zero3``)."""

from align.trainer.strategies import *  # noqa: F401,F403
from align.trainer.strategies import __all__  # noqa: F401
