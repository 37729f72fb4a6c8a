"""Trainer overhead: tokens/s of `deepspeed astrai/train.py` (sft) against a plain DeepSpeed loop and a
plain PyTorch AdamW loop over the same model, data, batch and config, launched alternately.

    python benchmarks/trainer_overhead.py                 # the documented run (~15 min on 2 cores)
    python benchmarks/trainer_overhead.py --trl           # also TRL's SFTTrainer (own venv, see --help)
    python benchmarks/trainer_overhead.py --size tiny --steps 3 --warmup 1 --repeats 1 --variants astrai_w1

Variants (one launch each, in rotating order, `--repeats` rounds):
    torch_w1 / torch_w2      plain PyTorch AdamW loop, one process, all cores, batch = micro x ranks
    ds_z0_w1, ds_z2_w1       plain DeepSpeed loop, 1 rank, ZeRO-0 / ZeRO-2 (default threads)
    ds_z0_noreduce_w1        ZeRO-0, 1 rank, with engine.enable_backward_allreduce = False (no 1-rank all-reduce)
    astrai_w1                AstrAI, 1 rank (ZeRO-2 job; AstrAI runs it as ZeRO-0 on one rank)
    astrai_z2kept_w1         AstrAI, 1 rank, `deepspeed.single_rank_stage0: false` (real ZeRO-2)
    ds_z2_w2                 plain DeepSpeed loop, 2 ranks, ZeRO-2, torch.set_num_threads(1) per rank
    ds_z2_unpinned_w2        the same without set_num_threads (each rank uses every core)
    astrai_w2                AstrAI, 2 ranks, ZeRO-2 (threads pinned by AstrAI: cores / local ranks)
    astrai_unpinned_w2       AstrAI, 2 ranks, OMP_NUM_THREADS=<cores> (every rank uses every core)
    trl_w1                   TRL SFTTrainer, 1 process, fp32, no gradient checkpointing (with --trl)
  Host allocator (runtime.tune_malloc, astrai/engine/host_memory.py; AstrAI's default is tuned):
    astrai_untuned_w1/_w2    AstrAI with `runtime.tune_malloc: false` (glibc's default thresholds)
    ds_z0_noreduce_tuned_w1, ds_z2_tuned_w2, torch_tuned_w1
                             the plain loops with the same thresholds (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_)

Throughput of a run is the median tokens/s of its steady-state steps (after `--warmup` steps): AstrAI's
own metrics.jsonl `tokens_per_s`, the plain loops' per-step timing of the same quantity. Each
ratio is taken per round against the baseline of the same round, then the median and range are
reported. Peak RSS per rank is the kernel's high-water mark (VmHWM), polled while the ranks run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from astrai.engine.host_memory import MALLOC_ENVIRONMENT  # noqa: E402
from benchmarks.common import (  # noqa: E402
    REPO,
    RESULTS,
    busy_fraction,
    child_env,
    command_line,
    deepspeed_command,
    fmt,
    fmt_summary,
    launch,
    machine,
    machine_line,
    markdown_table,
    matmul_peak_gflops,
    mfu,
    model_init,
    parameter_count,
    prepare_sft_data,
    summarize,
    write_results,
)

ALL_VARIANTS = [
    "torch_w1",
    "ds_z0_w1",
    "ds_z0_noreduce_w1",
    "ds_z2_w1",
    "astrai_w1",
    "astrai_z2kept_w1",
    "torch_w2",
    "ds_z2_w2",
    "ds_z2_unpinned_w2",
    "astrai_w2",
    "astrai_unpinned_w2",
    "astrai_untuned_w1",
    "ds_z0_noreduce_tuned_w1",
    "torch_tuned_w1",
    "astrai_untuned_w2",
    "ds_z2_tuned_w2",
]
TRL_VENV = REPO / "benchmarks" / ".venv-trl"

# Ratios reported: (variant, baseline, what it shows).
RATIOS = [
    ("astrai_w1", "torch_w1", "AstrAI 1 rank vs plain PyTorch (target >= 0.95)"),
    ("astrai_w1", "ds_z2_w1", "AstrAI 1 rank vs plain DeepSpeed ZeRO-2 loop"),
    ("astrai_w1", "ds_z0_w1", "AstrAI 1 rank vs plain DeepSpeed ZeRO-0 loop (same engine work)"),
    ("astrai_z2kept_w1", "torch_w1", "AstrAI kept at ZeRO-2, 1 rank, vs plain PyTorch"),
    ("ds_z2_w1", "torch_w1", "plain DeepSpeed ZeRO-2, 1 rank, vs plain PyTorch"),
    ("ds_z0_w1", "torch_w1", "plain DeepSpeed ZeRO-0, 1 rank, vs plain PyTorch"),
    ("ds_z0_noreduce_w1", "torch_w1", "plain DeepSpeed ZeRO-0 without the 1-rank gradient all-reduce vs plain PyTorch"),
    ("ds_z0_noreduce_w1", "ds_z0_w1", "ZeRO-0, 1 rank: skipping the 1-rank gradient all-reduce vs not"),
    ("astrai_w1", "astrai_z2kept_w1", "improvement (b): ZeRO-0 on one rank vs ZeRO-2 kept"),
    ("astrai_w2", "ds_z2_w2", "AstrAI 2 ranks vs plain DeepSpeed ZeRO-2 loop (target >= 0.97)"),
    ("astrai_w2", "torch_w2", "AstrAI 2 ranks vs plain PyTorch, one process"),
    ("ds_z2_w2", "torch_w2", "plain DeepSpeed ZeRO-2, 2 ranks x 1 thread, vs plain PyTorch"),
    ("astrai_w2", "astrai_unpinned_w2", "improvement (a): threads pinned vs every rank on every core"),
    ("ds_z2_w2", "ds_z2_unpinned_w2", "plain DeepSpeed: set_num_threads(1) vs default threads"),
    ("astrai_w1", "trl_w1", "AstrAI 1 rank vs TRL SFTTrainer (target >= 1.25)"),
    ("astrai_w1", "astrai_untuned_w1", "host malloc tuned vs glibc's defaults, AstrAI 1 rank"),
    ("astrai_w2", "astrai_untuned_w2", "host malloc tuned vs glibc's defaults, AstrAI 2 ranks"),
    (
        "astrai_untuned_w1",
        "ds_z0_noreduce_w1",
        "AstrAI untuned, 1 rank, vs the plain ZeRO-0 loop (no 1-rank all-reduce)",
    ),
    ("astrai_untuned_w2", "ds_z2_w2", "AstrAI untuned, 2 ranks, vs the plain ZeRO-2 loop"),
    ("ds_z0_noreduce_tuned_w1", "ds_z0_noreduce_w1", "the same malloc thresholds in the plain ZeRO-0 loop, 1 rank"),
    ("ds_z2_tuned_w2", "ds_z2_w2", "the same malloc thresholds in the plain ZeRO-2 loop, 2 ranks"),
    ("astrai_w1", "torch_tuned_w1", "AstrAI 1 rank vs plain PyTorch with the same malloc thresholds"),
    ("astrai_w1", "ds_z0_noreduce_tuned_w1", "AstrAI 1 rank vs the plain ZeRO-0 loop, both with the malloc thresholds"),
    ("astrai_w2", "ds_z2_tuned_w2", "AstrAI 2 ranks vs the plain ZeRO-2 loop, both with the malloc thresholds"),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="model size from benchmarks/common.py MODELS")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per launch")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the throughput")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS), help="comma-separated subset")
    parser.add_argument(
        "--trl",
        action="store_true",
        help=f"add TRL SFTTrainer (installs torch==2.13.0 trl into {TRL_VENV.relative_to(REPO)})",
    )
    parser.add_argument("--peak-seconds", type=float, default=1.5, help="time spent on each matmul-peak measurement")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--name", default="trainer_overhead")
    return parser.parse_args(argv)


def astrai_job(work: Path, data: dict[str, Path], args, init: dict, name: str) -> Path:
    """The AstrAI job of the benchmark: sft, fixed data, ZeRO-2 template, constant LR, no decay."""
    import yaml

    job = {
        "output_dir": str(work / "runs" / name),
        "model": {"init": init},
        "tokenizer": {"path": str(data["tokenizer"])},
        "data": {"path": str(data["data"]), "max_seq_len": args.seq_len, "shuffle": False},
        "train": {
            "train_type": "sft",
            "max_steps": args.steps,
            "micro_batch_size": args.micro_batch,
            "grad_accum_steps": 1,
            "lr": 1e-3,
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "seed": 42,
        },
        "deepspeed": {"config": str(REPO / "ds_configs" / "zero2.json")},
        "checkpoint": {"resume": "never", "keep_last": 1},
        "runtime": {"progress_bar": True},
    }
    path = work / "jobs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def variant_world(variant: str) -> int:
    return 2 if variant.endswith("_w2") else 1


def run_variant(variant: str, round_index: int, work: Path, data: dict[str, Path], args, init: dict) -> dict:
    """One launch of one variant; returns its measurements (throughput, times, peak RSS)."""
    world = variant_world(variant)
    cores = len(os.sched_getaffinity(0))
    name = f"{variant}_r{round_index}"
    out = work / "out" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    plain = [sys.executable, str(REPO / "benchmarks" / "plain_loop.py")]
    common = [
        "--model",
        json.dumps(init),
        "--tokens",
        str(data["tokens"]),
        "--steps",
        str(args.steps),
        "--out",
        str(out),
    ]
    env = (
        child_env(**MALLOC_ENVIRONMENT) if "_tuned" in variant else child_env()
    )  # AstrAI's thresholds, from the environment
    kind = "plain"
    if variant.startswith("torch_"):
        command = plain + ["--mode", "torch", "--micro-batch", str(args.micro_batch * world)] + common
    elif variant.startswith("ds_"):
        stage = 0 if "_z0" in variant else 2
        threads = ["--threads", "1"] if world > 1 and "unpinned" not in variant else []
        if "noreduce" in variant:
            threads.append("--no-single-rank-allreduce")
        command = deepspeed_command(
            world,
            REPO / "benchmarks" / "plain_loop.py",
            "--mode",
            "deepspeed",
            "--stage",
            str(stage),
            "--micro-batch",
            str(args.micro_batch),
            *threads,
            *common,
        )
    elif variant.startswith("astrai"):
        kind = "astrai"
        job = astrai_job(work, data, args, init, name)
        sets = ["--set", "deepspeed.single_rank_stage0=false"] if "z2kept" in variant else []
        if "untuned" in variant:
            sets += ["--set", "runtime.tune_malloc=false"]
        if "unpinned" in variant:
            env = child_env(OMP_NUM_THREADS=str(cores))
        command = deepspeed_command(world, REPO / "astrai" / "train.py", "--config", str(job), *sets)
    elif variant.startswith("trl_"):
        kind = "trl"
        command = [
            str(TRL_VENV / "bin" / "python"),
            str(REPO / "benchmarks" / "trl_sft.py"),
            "--micro-batch",
            str(args.micro_batch),
        ] + common
    else:
        raise ValueError(f"unknown variant {variant}")
    busy_before = busy_fraction()
    result = launch(command, env=env, log=work / "logs" / f"{name}.log")
    record = {
        "variant": variant,
        "round": round_index,
        "world_size": world,
        "returncode": result.returncode,
        "wall_s": result.wall_s,
        "peak_rss_mib": result.peak_rss_mib,
        "cpu_busy_before": busy_before,
    }
    if result.returncode != 0:
        record["error"] = "\n".join(text for _, text in result.lines[-15:])
        print(f"  {name}: FAILED (exit {result.returncode}); see {work / 'logs' / (name + '.log')}")
        return record
    if kind == "astrai":
        metrics_path = work / "runs" / name / "metrics.jsonl"
        steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        per_step = [s["tokens_per_s"] for s in steps]
        # The progress bar appears (0/N) when the loop starts; metrics.jsonl's elapsed_s counts from there.
        loop_start = result.first(rf"train:\s+0%.*\b0/{args.steps}\b")
        first = loop_start + steps[0]["elapsed_s"] if loop_start is not None and steps else None
        last = loop_start + steps[-1]["elapsed_s"] if loop_start is not None and steps else None
        published = result.last(r"published .* in ([0-9.]+) s")
        publish_s = None
        for _, text in result.lines:
            if "published" in text and " in " in text:
                try:
                    publish_s = float(text.rsplit(" in ", 1)[1].split()[0])
                except (IndexError, ValueError):
                    pass
        threads_line = next((text for _, text in result.lines if "intra-op threads per rank" in text), None)
        stage_line = next((text for _, text in result.lines if "ZeRO-" in text and "parameters" in text), None)
        record.update(
            first_step_s=first,
            last_step_s=last,
            publish_s=publish_s,
            published_at_s=published,
            threads_log=threads_line,
            build_log=stage_line,
        )
    else:
        report = json.loads(out.read_text())
        per_step = [s["tokens_per_s"] for s in report["steps"]]
        first = result.first(r"BENCH step 1$")
        last = result.first(rf"BENCH step {args.steps}$")
        record.update(
            first_step_s=first, last_step_s=last, threads=report.get("threads"), setup_s=report.get("setup_s")
        )
        if kind == "plain":
            steady_steps = report["steps"][args.warmup :]
            record.update(
                optimizer_step_s=summarize([s["optimizer_step_s"] for s in steady_steps])["median"],
                forward_backward_s=summarize([s["forward_s"] + s["backward_s"] for s in steady_steps])["median"],
            )
        else:
            record["trl_version"] = report.get("trl")
    steady = per_step[args.warmup :]
    record.update(
        tokens_per_s=summarize(steady)["median"],
        tokens_per_s_steps=per_step,
        exit_after_last_step_s=(result.wall_s - record["last_step_s"])
        if record.get("last_step_s") is not None
        else None,
    )
    print(
        f"  {name}: {fmt(record['tokens_per_s'], 0)} tokens/s, first step at {fmt(record.get('first_step_s'), 1)} s, "
        f"exit {fmt(result.wall_s, 1)} s, peak RSS {', '.join(f'{v:.0f}' for v in result.peak_rss_mib.values())} MiB"
    )
    return record


def ensure_trl_venv() -> str | None:
    """TRL in its own venv (never in the project's): returns None when ready, else why it is skipped."""
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return None
    print(f"installing TRL into {TRL_VENV} (torch==2.13.0 trl) ...")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True, capture_output=True)
        completed = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "trl", "psutil"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except (subprocess.SubprocessError, OSError) as error:
        return f"could not create the TRL venv: {error}"
    if completed.returncode != 0:
        return f"pip install torch==2.13.0 trl failed: {completed.stderr.strip().splitlines()[-1:]}"
    return None


def ratio_rows(records: list[dict], rounds: int) -> list[dict]:
    """Per-round ratios variant/baseline (tokens/s), summarised over rounds."""
    by_key = {(r["variant"], r["round"]): r for r in records if r.get("tokens_per_s")}
    rows = []
    for variant, baseline, label in RATIOS:
        values = [
            by_key[(variant, k)]["tokens_per_s"] / by_key[(baseline, k)]["tokens_per_s"]
            for k in range(rounds)
            if (variant, k) in by_key and (baseline, k) in by_key
        ]
        if values:
            rows.append({"variant": variant, "baseline": baseline, "label": label, **summarize(values)})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.trl and "trl_w1" not in variants:
        variants.append("trl_w1")
    trl_note = None
    if "trl_w1" in variants:
        trl_note = ensure_trl_venv()
        if trl_note:
            print(f"skipping TRL: {trl_note}")
            variants.remove("trl_w1")
    results_dir = Path(args.results_dir)
    work = results_dir / f"{args.name}_work"
    shutil.rmtree(work, ignore_errors=True)
    init = model_init(args.size, args.seq_len)
    rows_needed = max(64, args.steps * args.micro_batch * 2 + args.micro_batch)
    data = prepare_sft_data(work / "data", rows_needed, args.seq_len)
    info = machine()
    peak_before = {
        "1": matmul_peak_gflops(1, seconds=args.peak_seconds),
        "all": matmul_peak_gflops(info["cores"], seconds=args.peak_seconds),
    }
    print(machine_line(info))
    records = []
    started = time.perf_counter()
    for round_index in range(args.repeats):
        # Rotate the order each round so no variant always runs first (cold caches) or last.
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        print(f"round {round_index + 1}/{args.repeats}")
        for variant in order:
            records.append(run_variant(variant, round_index, work, data, args, init))
    peak_after = {
        "1": matmul_peak_gflops(1, seconds=args.peak_seconds),
        "all": matmul_peak_gflops(info["cores"], seconds=args.peak_seconds),
    }
    peak = {key: max(peak_before[key], peak_after[key]) for key in peak_before}
    parameters = parameter_count(init)
    summary = {}
    for variant in variants:
        runs = [r for r in records if r["variant"] == variant and r.get("tokens_per_s")]
        ranks = sorted({rank for r in runs for rank in r["peak_rss_mib"]})
        summary[variant] = {
            "tokens_per_s": summarize([r["tokens_per_s"] for r in runs]),
            "first_step_s": summarize([r.get("first_step_s") for r in runs]),
            "exit_after_last_step_s": summarize([r.get("exit_after_last_step_s") for r in runs]),
            "publish_s": summarize([r.get("publish_s") for r in runs]),
            "wall_s": summarize([r["wall_s"] for r in runs]),
            "peak_rss_mib": {rank: summarize([r["peak_rss_mib"].get(rank) for r in runs]) for rank in ranks},
            "optimizer_step_s": summarize([r.get("optimizer_step_s") for r in runs]),
            "failures": sum(1 for r in records if r["variant"] == variant and r["returncode"] != 0),
        }
        median = summary[variant]["tokens_per_s"]["median"]
        summary[variant]["mfu"] = mfu(parameters, median, peak["all"]) if median else None
    ratios = ratio_rows(records, args.repeats)
    payload = {
        "benchmark": "trainer_overhead",
        "command": command_line(),
        "machine": info,
        "settings": vars(args) | {"variants": variants},
        "model": init,
        "parameters": parameters,
        "matmul_peak_gflops": {"before": peak_before, "after": peak_after, "used": peak},
        "summary": summary,
        "ratios": ratios,
        "runs": records,
        "trl_note": trl_note,
        "total_s": time.perf_counter() - started,
    }
    write_results(args.name, payload, render_markdown(payload), results_dir)
    return 0 if all(r["returncode"] == 0 for r in records) else 1


def render_markdown(payload: dict) -> str:
    settings, summary = payload["settings"], payload["summary"]
    peak = payload["matmul_peak_gflops"]["used"]
    lines = [
        f"### Trainer overhead ({payload['parameters'] / 1e6:.1f}M-parameter Llama, seq {settings['seq_len']}, "
        f"micro-batch {settings['micro_batch']}, {settings['steps']} steps of which {settings['warmup']} warm-up, "
        f"{settings['repeats']} rounds)",
        "",
        machine_line(payload["machine"]),
        f"fp32 matmul peak (1024², best of the run): {peak['1']:.0f} GFLOP/s on 1 thread, {peak['all']:.0f} GFLOP/s "
        "on all cores.",
        "",
        "Ratios of tokens/s, taken per round against the baseline of the same round: median [min–max].",
        "",
        markdown_table(
            ["comparison", "ratio", "rounds"], [[r["label"], fmt_summary(r), r["n"]] for r in payload["ratios"]]
        ),
        "",
        "Per variant (absolute figures on the machine above): median [min–max] over rounds.",
        "",
    ]
    rows = []
    for variant, s in summary.items():
        rss = "; ".join(f"r{rank}: {fmt(v['median'], 0)}" for rank, v in s["peak_rss_mib"].items())
        rows.append(
            [
                variant,
                fmt_summary(s["tokens_per_s"], 0),
                fmt(s["mfu"] and 100 * s["mfu"], 1),
                fmt_summary(s["first_step_s"], 1),
                fmt_summary(s["exit_after_last_step_s"], 1),
                fmt_summary(s["publish_s"], 2),
                fmt(s["optimizer_step_s"]["median"], 3),
                rss,
                s["failures"],
            ]
        )
    lines.append(
        markdown_table(
            [
                "variant",
                "tokens/s",
                "MFU %",
                "launch → end of step 1 (s)",
                "end of last step → exit (s)",
                "of which final publish (s)",
                "optimizer step (s)",
                "peak RSS per rank (MiB)",
                "failed",
            ],
            rows,
        )
    )
    if payload.get("trl_note"):
        lines += ["", f"TRL skipped: {payload['trl_note']}"]
    lines += [
        "",
        f"MFU = 6 × {payload['parameters'] / 1e6:.2f}M parameters × tokens/s / all-core matmul peak.",
        f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
