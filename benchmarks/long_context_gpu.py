"""scripts/gpu_check.sh's long-context phase (issue 39 item 6): the Qwen2.5-0.5B shape (configs/scale_0p5b.yaml),
sft packed into one row of `train.micro_batch_tokens` per step, gradient checkpointing, sp=1 (one device), bf16, at
the longest length `python -m astrai plan --max-seq-len` says fits the GPU's free memory; 2 steps of
`astrai/train.py` in a worker process that then prints `torch.cuda.max_memory_allocated`, against the plan. A run
that fails (out of memory) is reported and retried at half the length while --budget-s lasts.

    python benchmarks/long_context_gpu.py            # on a GPU (scripts/gpu_check.sh runs it)
    python benchmarks/long_context_gpu.py --cpu      # the same lines on the CPU: a tiny shape, a pretend device

The rows are long multi-turn chats built from the shipped arithmetic chats (--chat-tokens each), so that a packed
row of hundreds of thousands of tokens holds hundreds of documents. CPU comparison (benchmarks/long_context.py is
the CPU benchmark): the peak RSS less the planner's runtime baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    child_env,
    launch,
    machine,
    machine_line,
    markdown_table,
    write_results,
)
from benchmarks.gpu_check import CONFIG, TINY_MODEL  # noqa: E402  (the GPU check's shapes: one definition)

# --cpu: gpu_check.py's shape of configs/scale_0p5b.yaml shrunk to what two cores train in seconds, planned against
# a pretend device of --cpu-memory-mib (the GPU keeps the 0.5B shape and its own memory).
GPU_CONFIG, CPU_SHAPE = CONFIG, TINY_MODEL
OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


def long_chats(path: Path, chat_tokens: int, rows: int) -> None:
    """Multi-turn chats of about `chat_tokens` characters (= tokens under the char tokenizer), each the shipped
    arithmetic questions and answers one after another: long documents, so that a packed row of hundreds of
    thousands of tokens holds hundreds of them, not tens of thousands."""
    chats = [json.loads(line)["messages"] for line in (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines()]
    turns_per_chat = max(1, chat_tokens // 28)  # ~28 tokens a question and its answer, the template included
    lines = []
    for row in range(rows):
        first = row * turns_per_chat
        messages = [turn for index in range(turns_per_chat) for turn in chats[(first + index) % len(chats)]]
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))


def gpu_job(args, work: Path, length: int, attention: str) -> tuple[Path, list[str]]:
    """configs/scale_0p5b.yaml as `--set` overrides: sft packed into rows of `length` tokens, sp=1 (one device),
    gradient checkpointing, bf16 (the tiny shape with --cpu), 2 steps, one rank."""
    init = {"max_position_embeddings": max(args.chat_tokens, 64), **(CPU_SHAPE if args.cpu else {})}
    settings = {
        "output_dir": str(work / f"run_{length}"),
        "model.dtype": "bf16",  # also with --cpu: the lines a GPU runs
        "model.attn_implementation": attention,
        "model.gradient_checkpointing": True,
        "tokenizer.build": {"kind": "char"},
        "data.path": str(work / "chats.jsonl"),
        "data.max_seq_len": args.chat_tokens,
        "data.packing": True,
        "parallel.sequence_parallel_size": 1,
        "deepspeed.config": "ds_configs/zero2.json",  # one rank: AstrAI runs it as ZeRO-0
        "deepspeed.optimizer": "torch",  # no extension to build on a fresh machine
        "train.micro_batch_tokens": length,
        "train.max_steps": args.steps,
        "train.log_every_steps": 1,
        "train.logits_chunk_size": args.logits_chunk,
        "checkpoint.every_steps": 10**6,  # only the final publish
        **{f"model.init.{key}": value for key, value in init.items()},
    }
    return GPU_CONFIG, [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def device_plan(args, work: Path, length: int, attention: str, memory_gib: float) -> dict:
    """The planner's rows for the phase's job at `length`, and the longest length it says fits `memory_gib`."""
    from astrai.launch.job_checks import load_and_check
    from astrai.launch.memory_plan import longest_sequence, make_plan

    config, sets = gpu_job(args, work, length, attention)
    os.environ["WORLD_SIZE"] = "1"
    plan = make_plan(load_and_check(str(config), sets), str(config), 1, memory_gib)
    rows = {row.component: row.gpu for row in plan.rows}
    return {
        "gpu_total": plan.gpu_total,
        "activations": rows.get("activations", 0),
        "logits": rows.get("logits + log-softmax", 0),
        "longest": longest_sequence(plan).tokens,
        "parameters": plan.policy_parameters,
    }


def gpu_worker(argv: list[str]) -> int:
    """One rank of astrai/train.py in this process, then its peak memory: `RESULT {json}`."""
    import resource

    import torch

    from astrai.train import main as train_main

    code = 1
    try:
        code = train_main(argv)
    finally:
        result = {"exit": code, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if torch.cuda.is_available():
            result["max_allocated"] = torch.cuda.max_memory_allocated()
            result["max_reserved"] = torch.cuda.max_memory_reserved()
        print("RESULT " + json.dumps(result), flush=True)
    return code


def free_device_memory_gib() -> float:
    """What one process can have of GPU 0, asked in a child so that this process holds no CUDA context."""
    code = "import torch; print(torch.cuda.mem_get_info()[0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return int(done.stdout.split()[-1]) / 2**30


def gpu_phase(args) -> int:
    """The longest packed sft row the planner says fits the device with sp=1, trained for 2 steps; its measured
    peak (torch.cuda.max_memory_allocated; on the CPU the peak RSS less the planner's runtime baseline) against the
    plan. A run that fails (out of memory) is reported and retried at half the length while the budget lasts."""
    from astrai.launch.memory_plan import RUNTIME_BASELINE_BYTES

    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    args.chat_tokens = args.chat_tokens or (128 if args.cpu else 2048)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("long_context --gpu-check: no CUDA device (--cpu for the CPU sequence)")
        return 2
    deadline = time.perf_counter() + args.budget_s
    info = machine()
    print(machine_line(info), flush=True)
    attention = "sdpa"
    if not args.cpu:
        try:
            import flash_attn  # noqa: F401

            attention = "flash_attention_2"  # its varlen path: no [T, T] mask for the packed row
        except ImportError:
            pass
    memory_gib = args.cpu_memory_mib / 1024 if args.cpu else free_device_memory_gib()
    work = Path(tempfile.mkdtemp(prefix="long_context_gpu_"))
    rows = []
    try:
        long_chats(work / "chats.jsonl", args.chat_tokens, 4)  # for the job's checks; the run's rows below
        longest_planned = device_plan(args, work, args.chat_tokens, attention, memory_gib)["longest"]
        long_chats(work / "chats.jsonl", args.chat_tokens, 2 * args.steps * longest_planned // args.chat_tokens + 4)
        length = longest_planned
        print(f"[long_context] planner: {length:,} tokens fit {memory_gib:.2f} GiB with sp=1 ({attention})", flush=True)
        while length >= args.chat_tokens and time.perf_counter() + args.min_try_s < deadline:
            plan = device_plan(args, work, length, attention, memory_gib)
            config, sets = gpu_job(args, work, length, attention)
            command = [sys.executable, str(Path(__file__).resolve()), "--gpu-worker", "--config", str(config)]
            command += [part for item in sets for part in ("--set", item)]
            result = launch(command, env=child_env(), timeout=max(deadline - time.perf_counter(), 1))
            (work / f"run_{length}.log").write_text(result.text())
            lines = [text for _, text in result.lines if text.startswith("RESULT ")]
            measured = json.loads(lines[-1][len("RESULT ") :]) if lines else {}
            peak = measured.get("max_allocated")
            if peak is None and measured.get("peak_rss"):
                peak = measured["peak_rss"] - RUNTIME_BASELINE_BYTES  # the CPU: what the planner counts
            metrics = work / f"run_{length}" / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            row = {
                "length": length,
                "attention": attention,
                "exit": result.returncode,
                "planned_gib": plan["gpu_total"] / 2**30,
                "planned_activations_gib": (plan["activations"] + plan["logits"]) / 2**30,
                "measured_gib": peak / 2**30 if peak else None,
                "reserved_gib": measured["max_reserved"] / 2**30 if measured.get("max_reserved") else None,
                "wall_s": round(result.wall_s, 1),
                "oom": any(OOM.search(text) for _, text in result.lines),
                "steps": len(records),
            }
            if row["measured_gib"]:
                row["measured_over_plan"] = row["measured_gib"] / row["planned_gib"]
            if records:
                row["tokens_per_s"] = records[-1]["tokens_per_s"]
            if attention == "sdpa":
                row["mask_gib"] = length * length / 2**30  # the [T, T] bool mask transformers builds (not planned)
            if result.returncode:
                row["tail"] = "\n".join(text for _, text in result.lines[-12:])
            rows.append(row)
            shutil.rmtree(work / f"run_{length}", ignore_errors=True)  # its checkpoint (6.6 GB at 0.5B)
            print(f"[long_context] {gpu_summary(row)}", flush=True)
            if result.returncode == 0:
                break
            length = next_length(args, work, length, attention, memory_gib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shape = "tiny (--cpu)" if args.cpu else "Qwen2.5-0.5B (configs/scale_0p5b.yaml)"
    payload = {
        "machine": info,
        "shape": shape,
        "memory_gib": memory_gib,
        "planned_longest": longest_planned,
        "attention": attention,
        "rows": rows,
    }
    table = markdown_table(
        ["length", "attention", "plan (GiB)", "measured peak (GiB)", "measured / plan", "tokens/s", "result"],
        [
            [
                f"{row['length']:,}",
                row["attention"],
                f"{row['planned_gib']:.2f}",
                f"{row['measured_gib']:.2f}" if row["measured_gib"] else "-",
                f"{row['measured_over_plan']:.2f}x" if row.get("measured_over_plan") else "-",
                f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "-",
                gpu_summary(row),
            ]
            for row in rows
        ],
    )
    markdown = (
        f"Long context, sp=1, {shape}, sft packed, gradient checkpointing: the planner's longest length for "
        f"{memory_gib:.2f} GiB is {longest_planned:,} tokens.\n\n{table}\n\n{machine_line(info)}"
    )
    write_results(args.name, payload, markdown, Path(args.results_dir))
    return 0 if rows and rows[-1]["exit"] == 0 else 1


def next_length(args, work: Path, length: int, attention: str, memory_gib: float) -> int:
    """The retry after a failed run: half the length (whole chats); under sdpa, halved again while the plan plus the
    [T, T] mask transformers builds for a packed row (T^2 bytes, not in the plan) would not fit."""
    while True:
        length = length // 2 // args.chat_tokens * args.chat_tokens
        if attention != "sdpa" or length < args.chat_tokens:
            return length
        if device_plan(args, work, length, attention, memory_gib)["gpu_total"] + length**2 <= memory_gib * 2**30:
            return length


def gpu_summary(row: dict) -> str:
    if row["exit"] == 0:
        text = f"{row['length']:,} tokens trained {row['steps']} steps"
    else:
        text = f"{row['length']:,} tokens: exit {row['exit']}" + (" (out of memory)" if row["oom"] else "")
    if row.get("measured_over_plan"):
        text += f", peak {row['measured_gib']:.2f} GiB = {row['measured_over_plan']:.2f}x the plan"
    if row.get("mask_gib"):
        text += f"; sdpa's [T, T] mask {row['mask_gib']:.2f} GiB"
    return text + f", {row['wall_s']:.0f} s"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--gpu-worker"]:
        return gpu_worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--name", default="long_context_gpu")
    parser.add_argument("--cpu", action="store_true", help="on the CPU at a tiny shape")
    parser.add_argument("--budget-s", type=float, default=300, help="the whole phase's wall clock")
    parser.add_argument("--min-try-s", type=float, default=90, help="no run starts with less left")
    parser.add_argument("--chat-tokens", type=int, default=None, help="one long chat (2048; --cpu 128)")
    parser.add_argument("--cpu-memory-mib", type=float, default=32, help="--cpu: the planned device's memory")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--logits-chunk", type=int, default=1024)
    return gpu_phase(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
