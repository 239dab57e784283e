"""The host allocator's settings (``align.trainer.host_memory``): when they are left alone, and that a training run's
process serves large blocks from glibc's heap, where freed ones stay, instead of mapping fresh pages for each."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from align.trainer.host_memory import _reason_to_leave

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize(
    "environ, reason",
    [
        ({"ALIGN_KEEP_FREED_MEMORY": "0"}, "ALIGN_KEEP_FREED_MEMORY=0"),
        ({"ALIGN_KEEP_FREED_MEMORY": "off"}, "ALIGN_KEEP_FREED_MEMORY=off"),
        ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, "the environment sets MALLOC_TRIM_THRESHOLD_"),
        (
            {"MALLOC_MMAP_MAX_": "0", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
            "the environment sets MALLOC_MMAP_MAX_, GLIBC_TUNABLES",
        ),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}, "the environment sets GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD=/usr/lib/libjemalloc.so.2"),
    ],
)
def test_the_allocator_is_left_alone_where_the_user_chose(environ, reason):
    assert _reason_to_leave(environ) == reason


def test_other_settings_do_not_stop_it():
    environ = {
        "ALIGN_KEEP_FREED_MEMORY": "1",
        "GLIBC_TUNABLES": "glibc.pthread.rseq=0",
        "LD_PRELOAD": " ",
        "OMP_NUM_THREADS": "2",
    }
    reason = _reason_to_leave(environ)
    assert reason is None if GLIBC else reason.startswith("not glibc")


# A tiny DQN fit in a fresh process, then a 64 MB tensor allocated, freed and allocated again. (Which address a
# freed block is reused at depends on the heap's other blocks, so the test does not pin it.) glibc's
# mallinfo2 counts the blocks it has mapped on their own (hblks): a block above the mmap threshold is one of them.
CHILD = textwrap.dedent("""
    import ctypes, json, sys, torch
    from align.trainer import host_memory

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2

    def mapped_blocks_and_address():
        x = torch.ones(16 * 2**20)  # 64 MB
        return libc.mallinfo2().hblks, x.data_ptr()

    before = [mapped_blocks_and_address() for _ in range(2)]
    if sys.argv[1] == "fit":
        from align.gym.make import EnvSpec
        from align.gym import DQNGymModule, ReplayUpdates
        import lightning as L
        module = DQNGymModule(env=EnvSpec(id="CartPole-v1"), total_steps=64, learning_starts=16,
                              steps_per_iteration=8, updates=ReplayUpdates(gradient_steps=1, minibatch_size=8))
        L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module)
    after = [mapped_blocks_and_address() for _ in range(2)]
    print(json.dumps({"state": host_memory._state, "before": before, "after": after}))
""")


def _child(mode: str, **env: str) -> dict:
    import os

    environ = {k: v for k, v in os.environ.items() if k != "ALIGN_KEEP_FREED_MEMORY"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env={**environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_fit_keeps_large_freed_blocks_for_reuse():
    res = _child("fit")
    assert res["state"] == "kept"
    (mapped_a, _), (mapped_b, _) = res["before"]
    assert mapped_a >= 1 and mapped_b >= 1  # glibc's default: the 64 MB block is a mapping of its own
    (mapped_c, _), (mapped_d, _) = res["after"]
    assert mapped_c == mapped_a - 1 and mapped_d == mapped_b - 1  # after the fit: from the heap, freed into it


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_switch_turns_it_off_for_a_fit():
    res = _child("fit", ALIGN_KEEP_FREED_MEMORY="0")
    assert res["state"] == "left: ALIGN_KEEP_FREED_MEMORY=0"
    assert [mapped for mapped, _ in res["after"]] == [mapped for mapped, _ in res["before"]]
