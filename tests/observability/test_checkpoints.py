"""Knowing when a checkpoint file is on disk: the strategy's write is wrapped for one run, the callback hears of every
file after its write (also one that raised), and the strategy gets its own method back."""

import pytest

from align.observability.checkpoints import WrittenCheckpoints


class Strategy:
    def __init__(self):
        self.files = []

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        if checkpoint.get("fail"):
            raise OSError("No space left on device")
        self.files.append(filepath)


def test_each_write_is_heard_of_once_it_is_done_and_the_strategy_gets_its_method_back():
    strategy, heard = Strategy(), []
    written = WrittenCheckpoints(lambda path: heard.append((path, list(strategy.files))))
    written.install(strategy)
    written.install(strategy)  # once per run
    strategy.save_checkpoint({}, "a.ckpt")
    with pytest.raises(OSError):
        strategy.save_checkpoint({"fail": True}, "b.ckpt")
    assert heard == [("a.ckpt", ["a.ckpt"]), ("b.ckpt", ["a.ckpt"])]  # after the write, whatever it did
    written.remove()
    assert "save_checkpoint" not in vars(strategy)
    strategy.save_checkpoint({}, "c.ckpt")
    assert len(heard) == 2


def test_another_wrapper_of_the_strategy_is_left_alone():
    strategy, heard = Strategy(), []
    own = strategy.save_checkpoint
    strategy.save_checkpoint = own  # someone else's per-instance write
    written = WrittenCheckpoints(heard.append)
    written.install(strategy)
    strategy.save_checkpoint({}, "a.ckpt")
    written.remove()
    assert heard == [] and vars(strategy)["save_checkpoint"] is own
