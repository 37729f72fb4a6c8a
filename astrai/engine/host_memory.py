"""The host allocator of a training rank: glibc malloc thresholds that keep each step's buffers.

A training step allocates and frees the same large tensors every time (activations, logits, their
gradients: 1-32 MiB each for the benchmark's 8.4M Llama). glibc's defaults give them back to the
kernel between steps: its mmap threshold adapts to the largest block freed so far, and the heap top is
trimmed whenever more than twice that lies free. The next step faults the same memory in again, page by
page, zeroed. Measured on the CPU with `deepspeed astrai/train.py` (1 rank, 24 steps): ~19,400 minor
page faults a step, about 4x the plain DeepSpeed loop's, whose heap happens to settle better; with the
thresholds below, ~3,800, and 1.11x the tokens/s on 1 rank, 1.09x on 2 (the plain loops, given the
same thresholds, 0.98x and 1.06x; docs/benchmarks.md). A long-running trainer's heap cycles through the
same working set every step, so keeping it costs no memory the step does not use anyway.

Not applied where it cannot matter or the user chose: non-glibc C libraries, an allocator preloaded
instead of malloc (jemalloc, tcmalloc, mimalloc), or MALLOC_*_ / GLIBC_TUNABLES already set.
`runtime.tune_malloc: false` turns it off; `auto` (the default) applies it to models under 100M parameters.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("astrai.engine")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest accepted value on 64-bit: blocks up to it come from the heap
TRIM_THRESHOLD_BYTES = 2**30  # free memory kept at the heap top before it is returned to the kernel
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
# The same thresholds as glibc reads them from the environment at start, for a process AstrAI does not run
# (benchmarks/trainer_overhead.py gives them to the plain loops it compares against).
MALLOC_ENVIRONMENT = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
}
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# `runtime.tune_malloc: auto` keeps each step's buffers below this many policy parameters (the gain was
# measured at 8.4M: 1.1x tokens/s) and above it returns freed blocks to the kernel (`release_malloc`): at
# 494M (Qwen2.5-0.5B's shape, grpo, ZeRO-3 on 2 ranks) the kept heap, and glibc's own dynamic thresholds
# alike, peaked at 11.6-11.9 GiB per rank (OOM-killed on 24 GiB); with blocks over 128 KiB mapped, 9.2 GiB.
AUTO_TUNE_BELOW_PARAMETERS = 100_000_000
RELEASE_THRESHOLD_BYTES = 128 * 1024  # glibc's initial mmap and trim thresholds, held there


def tunes_malloc(setting: bool | str, parameters: int) -> bool:
    """Whether `runtime.tune_malloc` (true, false or "auto") keeps the step's buffers for a job whose policy
    has `parameters` (`auto` above the bound releases them instead: `release_malloc`)."""
    if setting == "auto":
        return parameters < AUTO_TUNE_BELOW_PARAMETERS
    return bool(setting)


def release_malloc(environ: dict[str, str] | None = None, log: bool = True) -> bool:
    """Hold glibc's mmap and trim thresholds at 128 KiB: every block over it is mapped, and unmapped when freed.
    glibc would otherwise raise its mmap threshold to the largest block freed so far (up to 32 MiB), so a large
    model's per-layer tensors come from the heap, and memory freed there is rarely given back."""
    message = "host malloc: blocks over 128 KiB returned to the kernel when freed (runtime.tune_malloc)"
    return _set_thresholds(RELEASE_THRESHOLD_BYTES, RELEASE_THRESHOLD_BYTES, message, environ, log)


def module_parameters(module) -> int:
    """A module's parameter count, ZeRO-3 partitioned parameters at their full size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def tune_malloc(environ: dict[str, str] | None = None) -> bool:
    """Set glibc's mmap and trim thresholds for this process (see the module docstring). Returns whether
    it did; logs what it chose and why."""
    message = (
        f"host malloc: blocks up to {MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, up to "
        f"{TRIM_THRESHOLD_BYTES >> 20} MiB kept free at its top (runtime.tune_malloc)"
    )
    return _set_thresholds(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, message, environ, log=True)


def _set_thresholds(mmap_bytes: int, trim_bytes: int, message: str, environ, log: bool) -> bool:
    """glibc's mmap and trim thresholds for this process, unless another allocator or the user's own settings
    are in place; logs `message`, or why it left them, when `log`."""
    environ = os.environ if environ is None else environ
    reason = _reason_to_leave(environ)
    if reason is None:
        libc = ctypes.CDLL(None)  # this process's own C library
        if libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim_bytes) == 1:
            if log:
                logger.info("%s", message)
            return True
        reason = "mallopt refused the values"
    if log:
        logger.info("host malloc left as it is: %s", reason)
    return False


def _reason_to_leave(environ) -> str | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    preloaded = [name for name in OTHER_ALLOCATORS if name in environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"{preloaded[0]} is preloaded"
    chosen = [name for name in USER_SETTINGS if environ.get(name)]
    if chosen:
        return f"{chosen[0]} is set"
    return None
