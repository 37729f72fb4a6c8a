"""runtime.tune_malloc: glibc's thresholds keep a step's freed buffers instead of faulting them in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from astrai.engine.host_memory import _reason_to_leave, tune_malloc
from tests.conftest import child_env

# A step's pattern: many 1 MiB buffers allocated, touched and freed, again and again. With glibc's
# defaults the freed heap top is trimmed back to the kernel after each round and faulted in again.
CYCLES = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from astrai.engine.host_memory import tune_malloc
    assert tune_malloc()
def cycle():
    blocks = [torch.ones(1 << 18) for _ in range(24)]  # 24 x 1 MiB, every page written
    del blocks
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def minor_faults(mode: str) -> int:
    env = child_env()
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(_reason_to_leave({}) is not None, reason="glibc only (this machine's C library is another)")
def test_tuned_thresholds_keep_freed_buffers_instead_of_faulting_them_in_again():
    default, tuned = minor_faults("default"), minor_faults("tuned")
    assert default > 2000, default  # glibc's defaults: the freed memory goes back to the kernel every round
    assert tuned * 5 < default, (tuned, default)


@pytest.mark.parametrize("environ, reason", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES is set"),
])
def test_a_user_allocator_or_setting_is_left_alone(environ, reason, caplog):
    if _reason_to_leave({}) is not None:
        pytest.skip("glibc only")
    with caplog.at_level("INFO", logger="astrai.engine"):
        assert tune_malloc(environ) is False
    assert f"host malloc left as it is: {reason}" in caplog.text
