"""Smoke tests of benchmarks/: each starts on a tiny size and writes its result files.

Benchmarks are not tests (CI does not run them for their numbers); these only check that each one
still runs against the current trainer and writes JSON + Markdown. The launching ones are `slow`.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, child_env, run_bounded

BENCHMARKS = REPO / "benchmarks"


def run_benchmark(script: str, tmp_path, *args: str, timeout: int = 300) -> dict:
    name = script.removesuffix(".py")
    command = [sys.executable, str(BENCHMARKS / script), "--results-dir", str(tmp_path), "--name", name, *args]
    completed = run_bounded(command, timeout, cwd=REPO, env=child_env())  # the benchmark launches ranks of its own
    assert completed.returncode == 0, f"{script} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    assert (tmp_path / f"{name}.md").read_text().strip()
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_statistics_and_tables():
    from benchmarks.common import fmt_summary, markdown_table, model_init, parameter_count, summarize

    summary = summarize([1.0, 3.0, 2.0])
    assert summary["median"] == 2.0 and summary["spread"] == 1.0 and fmt_summary(summary) == "2.00 [1.00–3.00]"
    assert summarize([])["median"] is None
    assert markdown_table(["a", "b"], [[1, "x"]]).splitlines()[2] == "| 1 | x |"
    assert parameter_count(model_init("small", 256)) == 8_390_912  # the 8.4M reference Llama


def test_expected_zero_fractions():
    from benchmarks.memory_scaling import expected_bytes

    assert sum(expected_bytes(0, 100, 2).values()) == 1200
    assert sum(expected_bytes(2, 100, 2).values()) == 1000  # 4P + 12P/N
    assert sum(expected_bytes(3, 100, 2).values()) == 800  # 16P/N


def test_launch_times_progress_fragments_on_arrival():
    from benchmarks.common import launch

    code = (
        "import sys, time\nfor i in range(3):\n"
        "    sys.stderr.write('\\rbar %d' % i); sys.stderr.flush(); time.sleep(0.3)\n"
        "sys.stderr.write('\\n')\nprint('done')"
    )
    result = launch([sys.executable, "-c", code], env=child_env())
    times = {text: t for t, text in result.lines}
    assert result.returncode == 0 and set(times) >= {"bar 0", "bar 1", "bar 2"}
    assert times["bar 1"] - times["bar 0"] < 0.6  # stamped when written, not when the next "\r" came
    assert 0 in result.peak_rss_mib


@pytest.mark.slow
def test_trainer_overhead_smoke(tmp_path):
    result = run_benchmark(
        "trainer_overhead.py",
        tmp_path,
        "--size",
        "tiny",
        "--seq-len",
        "32",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--variants",
        "torch_w1,astrai_w1",
        "--peak-seconds",
        "0.1",
    )
    assert {run["variant"] for run in result["runs"]} == {"torch_w1", "astrai_w1"}
    assert all(run["returncode"] == 0 and run["tokens_per_s"] > 0 for run in result["runs"])
    assert result["ratios"][0]["baseline"] == "torch_w1"


@pytest.mark.slow
def test_checkpoint_cost_smoke(tmp_path):
    result = run_benchmark(
        "checkpoint_cost.py",
        tmp_path,
        "--sizes",
        "tiny",
        "--stages",
        "2",
        "--repeats",
        "1",
        "--hash-mib",
        "4",
        "--ranks",
        "1",
    )
    case = result["cases"][0]
    assert case["publish/plain"]["median"] > 0 and result["hashing_gbps"]["sha256"] > 0
    assert case["publish/publish_reread"]["median"] > 0 and case["publish_reread_hash_phase_s"]["median"] > 0
    assert (
        case["publish_async/plain"]["median"] > 0
        and case["publish_async_durable/plain"]["median"] >= case["publish_async/plain"]["median"]
    )


@pytest.mark.slow
def test_memory_scaling_smoke(tmp_path):
    result = run_benchmark("memory_scaling.py", tmp_path, "--size", "tiny", "--stages", "3", "--ranks", "1")
    ranks = result["stages"]["3"]["ranks"]
    expected = sum(result["stages"]["3"]["expected"].values())
    assert len(ranks) == 1 and all(
        r["parameters"] + r["master"] + r["optimizer"] == pytest.approx(expected, rel=0.05) for r in ranks
    )


@pytest.mark.slow
def test_rollout_speed_smoke(tmp_path):
    result = run_benchmark(
        "rollout_speed.py",
        tmp_path,
        "--size",
        "tiny",
        "--new-tokens",
        "4",
        "--prompts",
        "2",
        "--repeats",
        "1",
        "--skip-zero3",
    )
    assert "skipped" in result or result["summary"]["generate"]["median"] > 0


@pytest.mark.slow
def test_step_overhead_smoke(tmp_path):
    result = run_benchmark(
        "step_overhead.py",
        tmp_path,
        "--size",
        "tiny",
        "--seq-len",
        "32",
        "--rounds",
        "2",
        "--block",
        "2",
        "--warmup",
        "1",
        "--ranks",
        "1",
    )
    assert {row["baseline"] for row in result["ratios"]} == {"deepspeed", "torch"}
    assert result["zero_stage"] == 0  # AstrAI runs a one-rank ZeRO-2 job as ZeRO-0, and the baseline matches it
    assert all(result["tokens_per_s"][name]["median"] > 0 for name in ("astrai", "astrai+log", "deepspeed", "torch"))


@pytest.mark.slow
def test_logits_memory_smoke(tmp_path):
    payload = run_benchmark(
        "logits_memory.py", tmp_path, "--chunks", "0,32", "--vocab", "512", "--seq-len", "32", "--rounds", "1"
    )
    runs = payload["runs"]
    assert set(runs) == {"0", "32"} and all(run["peak_above_start_mib"] >= 0 for run in runs["32"])
    assert runs["32"][0]["losses"] == pytest.approx(runs["0"][0]["losses"], rel=1e-5)  # the same numbers


@pytest.mark.slow
def test_scale_0p5b_smoke_at_the_tiny_shape(tmp_path):
    payload = run_benchmark(
        "scale_0p5b.py",
        tmp_path,
        *("--shape", "tiny", "--steps", "1", "--phases", "publish,export_hf,online_ppo"),
        timeout=900,
    )
    phases = {row["phase"]: row for row in payload["rows"]}
    # publish and export read sft_zero3's checkpoint
    assert list(phases) == ["sft_zero3", "publish", "export_hf", "online_ppo"]
    assert all(row["exit"] == 0 for row in phases.values())
    assert len(phases["sft_zero3"]["peak_rss_mib"]) == 2 and phases["publish"]["plain_copy_fsync_s"] > 0
    assert phases["online_ppo"]["shape"] == "tiny" and len(phases["online_ppo"]["peak_rss_mib"]) == 2


@pytest.mark.slow
def test_packing_smoke(tmp_path):
    arguments = ["--rows", "40", "--steps", "3", "--warmup", "1", "--hidden", "32", "--layers", "1"]
    result = run_benchmark("packing.py", tmp_path, *arguments, "--tokens", "2048", "--micro-batch", "2")
    assert [run["variant"] for run in result["runs"]] == ["padded", "packed"]
    assert all(run["real_tokens_per_s"] > 0 and run["steps"] == 2 for run in result["runs"])
    assert result["packed_over_padded"] > 0


@pytest.mark.slow
def test_lora_vs_full_smoke(tmp_path):
    result = run_benchmark(
        "lora_vs_full.py", tmp_path, "--size", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1"
    )
    assert {run["variant"] for run in result["runs"]} == {"full", "lora"}
    assert result["summary"]["lora"]["trainable"] < result["summary"]["full"]["trainable"]
    assert result["summary"]["lora"]["optimizer_bytes"] < result["summary"]["full"]["optimizer_bytes"]
    assert set(result["met"]) == {"checkpoint", "peak_rss", "tokens_per_s"}


@pytest.mark.slow
def test_rm_share_prefix_smoke(tmp_path):
    arguments = ["--data", "long", "--rounds", "1", "--steps", "3", "--warmup", "1", "--pairs", "16"]
    sizes = ["--prompt-chars", "40", "--completion-chars", "8", "--long-micro-batch", "4", "--threads", "1"]
    result = run_benchmark("rm_share_prefix.py", tmp_path, *arguments, *sizes)
    case = result["cases"]["long"]
    assert [run["steps_timed"] for run in case["runs"]["plain"] + case["runs"]["shared"]] == [2, 2]
    assert case["plain_step_s"] > 0 and case["shared_step_s"] > 0 and case["speedup"] > 0


@pytest.mark.slow
def test_long_context_smoke(tmp_path):
    # One 2-rank launch: sp=2 at 256 tokens (the search's ceiling), the planner against its peak RSS.
    search = ["--size", "tiny", "--variants", "sp2", "--start", "256", "--resolution", "256", "--ceiling", "256"]
    result = run_benchmark("long_context.py", tmp_path, *search, "--timing-rounds", "0")
    (found,) = result["searches"]
    assert found["variant"] == "sp2" and found["longest"] == 256 and found["ceiling"]
    (run,) = result["runs"]
    assert run["status"] == "ok" and run["sp"] == 2 and run["peak_rss_mib"] > 0 and run["tokens_per_s"] > 0
    (planned,) = result["planner"]
    assert planned["planned_total_mib"] > 0 and 0.5 < planned["total_ratio"] < 2
