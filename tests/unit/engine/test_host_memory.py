"""runtime.tune_malloc: glibc's thresholds keep a step's freed buffers instead of faulting them in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from astrai.engine.host_memory import USER_SETTINGS, _reason_to_leave, tune_malloc
from tests.conftest import child_env

# Two patterns of a training step's buffers, with the minor page faults each costs:
# - growing: one buffer each of 1..20 MiB, written and freed. glibc's default mmap threshold only rises
#   to the largest mmapped block freed so far, so each new size is mmapped and faulted in whole
#   (deterministically); under the tuned 32 MiB threshold they come from the heap and reuse it.
# - cycles: 24 x 1 MiB written and freed, 20 times over. Tuned, the heap top is never trimmed, so the
#   same pages serve every round. (glibc's defaults trim it on some runs and not on others, so only
#   the tuned side has a bound here.)
PATTERNS = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from astrai.engine.host_memory import tune_malloc
    assert tune_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
for mib in range(1, 21):
    block = torch.ones(mib << 18)  # every page written
    del block
growing = faults() - before
def cycle():
    blocks = [torch.ones(1 << 18) for _ in range(24)]
    del blocks
cycle(); cycle()
before = faults()
for _ in range(20):
    cycle()
print(growing, faults() - before)
"""
PAGES_PER_MIB = 256


def minor_faults(mode: str) -> tuple[int, int]:
    env = child_env()
    for name in (*USER_SETTINGS, "LD_PRELOAD"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", PATTERNS, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    growing, cycles = result.stdout.split()[-2:]
    return int(growing), int(cycles)


@pytest.mark.skipif(_reason_to_leave({}) is not None, reason="glibc only (this machine's C library is another)")
def test_tuned_thresholds_keep_freed_buffers_instead_of_faulting_them_in_again():
    (default_growing, _), (tuned_growing, tuned_cycles) = minor_faults("default"), minor_faults("tuned")
    written = sum(range(1, 21)) * PAGES_PER_MIB  # 210 MiB of pages written in the growing pattern
    assert default_growing > 0.8 * written, default_growing  # every block mmapped, faulted in whole
    # Heap: its growth faults, 5,120 pages to hold 20 MiB plus the holes small allocations leave between
    # freed blocks (21-48 MiB seen here): far below mmapping every block.
    assert tuned_growing < 0.6 * written, tuned_growing
    assert tuned_cycles < 0.05 * 20 * 24 * PAGES_PER_MIB, tuned_cycles  # the same pages every round


@pytest.mark.parametrize(
    "environ, reason",
    [
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES is set"),
    ],
)
def test_a_user_allocator_or_setting_is_left_alone(environ, reason, caplog):
    if _reason_to_leave({}) is not None:
        pytest.skip("glibc only")
    with caplog.at_level("INFO", logger="astrai.engine"):
        assert tune_malloc(environ) is False
    assert f"host malloc left as it is: {reason}" in caplog.text


def test_auto_tunes_only_models_under_100m_parameters():
    import torch

    from astrai.config.schema import RuntimeConfig
    from astrai.engine.host_memory import AUTO_TUNE_BELOW_PARAMETERS, module_parameters, tunes_malloc

    assert RuntimeConfig().tune_malloc == "auto"
    assert tunes_malloc("auto", 8_400_000) and not tunes_malloc("auto", 494_032_768)
    assert not tunes_malloc("auto", AUTO_TUNE_BELOW_PARAMETERS) and tunes_malloc("auto", AUTO_TUNE_BELOW_PARAMETERS - 1)
    assert tunes_malloc(True, 10**10) and not tunes_malloc(False, 1)  # true/false: always/never
    assert module_parameters(torch.nn.Linear(3, 4)) == 3 * 4 + 4


# After glibc has raised its mmap threshold (a 20 MiB block freed), a 16 MiB block comes from the heap and
# stays resident once freed; `release_malloc` (tune_malloc: auto, large models) maps it, so freeing returns it.
RELEASE = """
import sys, torch
def rss_kib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
block = torch.ones(20 << 18); del block  # glibc: mmap threshold -> 20 MiB
if sys.argv[1] == "released":
    from astrai.engine.host_memory import release_malloc
    assert release_malloc()
before = rss_kib()
block = torch.ones(16 << 18)  # 16 MiB, every page written
del block
print(rss_kib() - before)
"""


@pytest.mark.skipif(_reason_to_leave({}) is not None, reason="glibc only (this machine's C library is another)")
def test_release_returns_freed_blocks_that_glibc_would_keep():
    env = child_env()
    for name in (*USER_SETTINGS, "LD_PRELOAD"):
        env.pop(name, None)
    kept = {}
    for mode in ("default", "released"):
        result = subprocess.run([sys.executable, "-c", RELEASE, mode], capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        kept[mode] = int(result.stdout.split()[-1])
    assert kept["default"] > 12 * 1024, kept  # glibc's raised threshold: the freed 16 MiB stays in the heap
    assert kept["released"] < 2 * 1024, kept  # mapped, and unmapped when freed
