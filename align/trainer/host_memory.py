"""Host memory: keep the blocks a training step frees for the next step, instead of handing them back to the kernel.

glibc's ``malloc`` serves every block above its mmap threshold (which grows to at most 32 MB) with a fresh
mapping, and unmaps it when the block is freed. The next block of that size starts as untouched pages, and the
kernel faults in and zeroes each 4 KB page as it is first written. A training step allocates such blocks again
and again: the gradient of an embedding table (113 MB for SmolLM2-135M's 49,152 x 576, once per backward pass of
every model that trains), a chunked output head's weight gradient, every parameter's gradient after the optimizer
released them. On a SmolLM2 PPO step the page faults of those blocks took about 2.5 s of a 13 s update.

:func:`keep_freed_host_memory` turns glibc's mmap path off for the process (``M_MMAP_MAX`` 0) and raises its trim
threshold (``M_TRIM_THRESHOLD``, to 2 GB), so large blocks come from the heap and freed ones stay there for the
next allocation. The peak resident memory is unchanged: the blocks were live at the same time before. Memory the
process no longer needs is returned only when more than 2 GB of the heap's top is free, so the resident size
after a peak stays near that peak.

It does nothing where it does not apply or where the user has chosen: off glibc (macOS, musl), when
``ALIGN_KEEP_FREED_MEMORY=0``, when the environment already sets glibc's malloc options (``MALLOC_MMAP_MAX_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``glibc.malloc`` tunables in
``GLIBC_TUNABLES``), or when another allocator is preloaded (``LD_PRELOAD``, such as jemalloc or tcmalloc).
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt(3) parameters.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: keep up to 2 GB free at the heap's top
SWITCH = "ALIGN_KEEP_FREED_MEMORY"
USER_MALLOC_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_state: str | None = None


def _reason_to_leave(environ) -> str | None:
    """Why the allocator is left as it is, or None to set it."""
    if environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{SWITCH}={environ[SWITCH]}"
    chosen = [name for name in USER_MALLOC_SETTINGS if name in environ]
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"the environment sets {', '.join(chosen)}"
    if environ.get("LD_PRELOAD", "").strip():
        return f"LD_PRELOAD={environ['LD_PRELOAD']}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc ({platform.system()} {'/'.join(platform.libc_ver()) or 'unknown libc'})"
    return None


def keep_freed_host_memory(environ=None) -> str:
    """Set glibc's malloc to keep freed blocks for reuse (module docstring), once per process.

    Returns ``"kept"`` when set by this or an earlier call, or ``"left: <why>"`` when the allocator was left as
    it is."""
    global _state
    if _state is not None:
        return _state
    reason = _reason_to_leave(os.environ if environ is None else environ)
    if reason is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        except (OSError, AttributeError) as err:
            ok, reason = False, f"mallopt unavailable ({err})"
        if not ok and reason is None:
            reason = "mallopt refused the settings"
    _state = "kept" if reason is None else f"left: {reason}"
    return _state
