"""Long context: how long a sequence trains under a fixed memory cap per rank with Ulysses sequence parallelism
(`parallel.sequence_parallel_size: 2`) against without it (sp=1, the same 2 ranks data-parallel), the tokens/s of
the two at a length both fit, and `python -m astrai plan` against the measured peak RSS (issue 39, items 5 and 6).

Every run is the real trainer (`deepspeed --num_gpus 2 astrai/train.py`): `sft` with `data.packing` (one packed
row of `train.micro_batch_tokens` = the length per micro-batch, the shipped arithmetic chats repeated), a Llama
built from `model.init` (fp32, sdpa, gradient checkpointing, `train.logits_chunk_size`), ZeRO-2. Under sp=2 the
row is cut in two along its length, one half per rank; under sp=1 each rank trains a row of its own.

1. Longest length under the cap: per variant (sp1, sp2, sp2_tiled: sp=2 with `parallel.tiled_mlp`), the length
   doubles from --start until a 2-step run's peak RSS on some rank passes --cap-mib (the run is stopped there), then
   bisects to --resolution tokens. The peak is the kernel's high-water mark (VmHWM) of each rank process read when
   the last step ends (the final checkpoint's publish comes after and is not counted). The figure is sp=2's
   longest over sp=1's, measured in the same run.
2. tokens/s (the trainer's own `tokens_per_s`, steps after the first) of sp=2 against sp=1 at --timing-length,
   alternated over --timing-rounds rounds.
3. The planner (astrai/launch/memory_plan.py, in this process, for the very job each run trained) against every
   finished run: its host total per rank (runtime baseline included) over the measured peak RSS, and its growth
   of the activations + logits rows between two lengths over the measured growth of the peak RSS; and its
   `--max-seq-len` answer for the cap against the longest measured.

    python benchmarks/long_context.py --variants sp1,sp2,sp2_tiled --timing-rounds 0   # the search: ~80 min
    python benchmarks/long_context.py --variants "" --name long_context_timing       # tokens/s alone: ~8 min

scripts/gpu_check.sh's long-context phase (one GPU, the 0.5B shape) is benchmarks/long_context_gpu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    _cmdline,
    _peak_rss_mib,
    _rank_of,
    add_launch_arguments,
    busy_fraction,
    child_env,
    command_line,
    deepspeed_command,
    fresh_workspace,
    machine_line,
    markdown_table,
    summarize,
    write_results,
)

MIB = 2**20
# The benchmark's model: Llama-shaped, 27M parameters (the char vocabulary of the arithmetic data is tiny), 8 heads
# so that sp=2 splits them; `tiny` is the smoke test's.
MODELS = {
    "27m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
}
VARIANTS = {"sp1": (1, False), "sp2": (2, False), "sp2_tiled": (2, True)}
# The ranks' host allocator. `released`: glibc maps every block over 128 KiB and unmaps it when freed (what
# `runtime.tune_malloc: auto` does above 100M parameters, astrai/engine/host_memory.py), so the peak RSS is the
# live tensors' peak, what the planner counts and what a GPU's caching allocator would hold. `kept`: the trainer's
# default for this model size (auto below 100M: blocks up to 32 MiB from the heap, 1 GiB kept free at its top).
ALLOCATORS = {
    "released": {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
    "kept": {},
}


# ---------------------------------------------------------------------------------------------
# Jobs


def job_dict(work: Path, name: str, args, length: int, sp: int, tiled: bool, steps: int) -> dict:
    """The sft job of one run: `length` tokens per packed micro-batch, sp ranks per sequence."""
    init = {"model_type": "llama", **MODELS[args.size]}
    init.update(num_key_value_heads=init["num_attention_heads"], max_position_embeddings=128, tie_word_embeddings=True)
    return {
        "output_dir": str(work / name),
        "model": {"init": init, "dtype": "fp32", "attn_implementation": "sdpa", "gradient_checkpointing": True},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": str(work / "sft.jsonl"), "max_seq_len": 128, "packing": True},
        "parallel": {"sequence_parallel_size": sp, "tiled_mlp": tiled},
        "train": {
            "train_type": "sft",
            "max_steps": steps,
            "micro_batch_tokens": length,
            "grad_accum_steps": 1,
            "lr": 1e-3,
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "seed": 7,
            "logits_chunk_size": args.logits_chunk,
        },
        "deepspeed": {"zero_stage": 2},
        "checkpoint": {"every_steps": 10**6, "keep_last": 1},
        "export": {"on_finish": False},
        "runtime": {"progress_bar": True, "tensorboard": False},
    }


def write_data(work: Path, tokens_needed: int) -> Path:
    """The shipped arithmetic chats (about 28 tokens each under the char tokenizer), repeated until a run's every
    micro-batch has rows of its own."""
    lines = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines(keepends=True)
    copies = max(1, -(-tokens_needed // (len(lines) * 25)))
    path = work / "sft.jsonl"
    path.write_text("".join(lines) * copies)
    return path


def planned(config: Path, world: int, cap_bytes: int | None) -> dict:
    """The planner's answer for `config` on `world` ranks (host memory: this is a CPU run): the plan itself and the
    longest sequence it says fits `cap_bytes` per rank."""
    from astrai.config import load_job
    from astrai.launch.memory_plan import longest_sequence, make_plan

    plan = make_plan(load_job(config), str(config), world, None, host_memory=cap_bytes)
    rows = {row.component: row.host + row.gpu for row in plan.rows}
    longest = longest_sequence(plan) if cap_bytes else None
    return {
        "host_total": plan.host_total,
        "sequence_rows": rows.get("activations", 0) + rows.get("logits + log-softmax", 0),
        "rows": rows,
        "longest": longest.tokens if longest else None,
        "limited_by": longest.limited_by if longest else None,
    }


# ---------------------------------------------------------------------------------------------
# One measured run


class Watched:
    """A launch whose ranks' peak RSS is polled: stopped as soon as a rank passes `cap_mib` before the last step
    ended; `train_peak_mib` is each rank's high-water mark when rank 0's progress bar showed the last step."""

    def __init__(self, command: list[str], env: dict, cap_mib: float | None, steps: int, timeout: float):
        self.lines: list[str] = []
        self.peaks: dict[int, float] = {}
        self.train_peak_mib: dict[int, float] = {}
        self.status = "ok"
        started = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        reader.start()
        done = re.compile(rf"\b{steps}/{steps} \[")
        import psutil

        root = psutil.Process(process.pid)
        while process.poll() is None:
            self._poll(root)
            if not self.train_peak_mib and any(done.search(line) for line in self.lines[-5:]):
                self._poll(root)
                self.train_peak_mib = dict(self.peaks)
            elif not self.train_peak_mib and cap_mib and max(self.peaks.values(), default=0) > cap_mib:
                self.status = "over_cap"
                os.killpg(process.pid, signal.SIGKILL)
            elif time.perf_counter() - started > timeout:
                self.status = "timeout"
                os.killpg(process.pid, signal.SIGKILL)
            time.sleep(0.1)
        process.wait()
        reader.join(timeout=5)
        self.wall_s = time.perf_counter() - started
        self.returncode = process.returncode
        if self.status == "ok" and (self.returncode != 0 or not self.train_peak_mib):
            self.status = "failed"

    def _read(self, process) -> None:
        buffer = b""
        while chunk := process.stdout.read1(65536):
            *complete, buffer = re.split(rb"[\r\n]", buffer + chunk)
            self.lines += [part.decode(errors="replace") for part in complete if part.strip()]
        if buffer.strip():
            self.lines.append(buffer.decode(errors="replace"))

    def _poll(self, root) -> None:
        try:
            members = root.children(recursive=True)
        except Exception:  # the launcher is gone
            return
        for member in members:
            rank = _rank_of(_cmdline(member))
            peak = _peak_rss_mib(member.pid) if rank is not None else None
            if peak is not None:
                self.peaks[rank] = max(self.peaks.get(rank, 0.0), peak)


def run(
    work: Path, args, variant: str, length: int, steps: int, cap_mib: float | None, tag: str = "", allocator="released"
) -> dict:
    sp, tiled = VARIANTS[variant]
    name = f"{variant}_{length}{tag}"
    shutil.rmtree(work / name, ignore_errors=True)  # a fresh output_dir: never a resume
    config = work / f"{name}.yaml"
    config.write_text(json.dumps(job_dict(work, name, args, length, sp, tiled, steps)))  # JSON is YAML
    command = deepspeed_command(args.ranks, REPO / "astrai/train.py", "--config", str(config))
    load = os.getloadavg()[0]
    env = child_env(OMP_NUM_THREADS=str(args.threads), **ALLOCATORS[allocator])
    watched = Watched(command, env, cap_mib, steps, args.timeout)
    (work / f"{name}.log").write_text("\n".join(watched.lines) + "\n")
    result = {
        "variant": variant,
        "sp": sp,
        "tiled_mlp": tiled,
        "length": length,
        "steps": steps,
        "allocator": allocator,
        "status": watched.status,
        "peak_rss_mib": max(watched.train_peak_mib.values() or watched.peaks.values() or [0.0]),
        "peak_rss_per_rank_mib": watched.train_peak_mib or watched.peaks,
        "process_peak_rss_mib": max(watched.peaks.values(), default=0.0),  # the final publish included
        "wall_s": round(watched.wall_s, 1),
        "load_1min_before": round(load, 2),
        "config": str(config),
    }
    metrics = work / name / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    shutil.rmtree(work / name, ignore_errors=True)  # its checkpoint: ~0.3 GB at 27M, and not what is measured
    timed = [record for record in records if record["step"] > 1] or records
    if timed:
        result["tokens_per_s"] = sum(r["tokens"] for r in timed) / sum(r["tokens"] / r["tokens_per_s"] for r in timed)
        result["tokens_per_step"] = statistics.mean(r["tokens"] for r in timed)
    if watched.status == "failed":
        result["tail"] = "\n".join(watched.lines[-15:])
    mark = {"ok": "fits", "over_cap": "over the cap, stopped"}.get(watched.status, watched.status)
    print(
        f"  {variant} {length:>7,} tokens: peak RSS {result['peak_rss_mib']:,.0f} MiB ({mark}), "
        f"{result['wall_s']:.0f} s" + (f", {result['tokens_per_s']:,.0f} tokens/s" if timed else ""),
        flush=True,
    )
    if watched.status in ("failed", "timeout"):
        print(result.get("tail", ""), flush=True)
    return result


def longest(work: Path, args, variant: str, cap_mib: float, runs: list[dict]) -> dict:
    """Doubling from --start, then bisection to --resolution tokens (multiples of it): the longest length whose
    2-step run stays under the cap."""
    step = args.resolution

    def fits(length: int) -> bool:
        result = run(work, args, variant, length, args.steps, cap_mib, allocator=args.allocator)
        runs.append(result)
        if result["status"] in ("failed", "timeout"):
            raise SystemExit(f"{variant} at {length} tokens {result['status']}: see {work}")
        return result["status"] == "ok"

    low, high = 0, args.start // step
    while high * step <= args.ceiling and fits(high * step):
        low, high = high, high * 2
    if high * step > args.ceiling:
        return {"variant": variant, "longest": low * step, "ceiling": True}
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return {"variant": variant, "longest": low * step, "shortest_over": high * step, "ceiling": False}


# ---------------------------------------------------------------------------------------------
# The planner against the runs


def planner_rows(runs: list[dict], cap_bytes: int, world: int) -> list[dict]:
    """Per finished run: the plan's host total over the measured peak; per variant, between its shortest and its
    longest finished run, the plan's growth of activations + logits over the measured growth of the peak RSS."""
    rows = []
    for result in runs:
        if result["status"] != "ok":
            continue
        plan = planned(Path(result["config"]), world, cap_bytes)
        measured = result["peak_rss_mib"] * MIB
        rows.append(
            {
                "variant": result["variant"],
                "allocator": result["allocator"],
                "length": result["length"],
                "planned_total_mib": plan["host_total"] / MIB,
                "planned_sequence_mib": plan["sequence_rows"] / MIB,
                "measured_mib": result["peak_rss_mib"],
                "total_ratio": plan["host_total"] / measured,
                "rows_mib": {key: value / MIB for key, value in plan["rows"].items()},
            }
        )
    for group in sorted({(row["variant"], row["allocator"]) for row in rows}):
        mine = [row for row in rows if (row["variant"], row["allocator"]) == group]
        mine.sort(key=lambda row: row["length"])
        if len(mine) < 2 or mine[0]["length"] == mine[-1]["length"]:
            continue
        short, long = mine[0], mine[-1]
        grown = long["measured_mib"] - short["measured_mib"]
        planned_growth = long["planned_sequence_mib"] - short["planned_sequence_mib"]
        long["growth"] = {
            "from_length": short["length"],
            "measured_mib": grown,
            "planned_mib": planned_growth,
            "ratio": planned_growth / grown if grown > 0 else None,
        }
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def render(payload: dict) -> str:
    cap, searches = payload["cap_mib"], payload["searches"]
    lines = [f"Cap: {cap:,.0f} MiB peak RSS per rank; model {payload['model']}; {payload['ranks']} ranks.", ""]
    table = []
    for search in searches:
        variant = search["variant"]
        above = f"{search['shortest_over']:,}" if search.get("shortest_over") else "-"
        longest_text = f"{search['longest']:,}" + (" (ceiling)" if search["ceiling"] else "")
        ratio = search.get("over_sp1")
        table.append(
            [
                variant,
                longest_text,
                above,
                f"{ratio:.2f}x" if ratio else "-",
                f"{search['planned_longest']:,}" if search.get("planned_longest") is not None else "-",
            ]
        )
    lines += [
        markdown_table(
            ["variant", "longest that fits", "shortest over the cap", "vs sp1", "planner --max-seq-len"], table
        ),
        "",
    ]
    timing = payload.get("timing")
    if timing:
        lines += [
            markdown_table(
                ["variant", "length", "tokens/step", "tokens/s per round", "median"],
                [
                    [
                        variant,
                        f"{timing['length']:,}",
                        f"{timing['tokens_per_step'][variant]:,.0f}",
                        ", ".join(f"{value:,.0f}" for value in timing["tokens_per_s"][variant]),
                        f"{statistics.median(timing['tokens_per_s'][variant]):,.0f}",
                    ]
                    for variant in timing["tokens_per_s"]
                ],
            ),
            "",
            f"sp2 / sp1 tokens/s: **{timing['ratio']['median']:.2f}x** "
            f"(per round {', '.join(f'{value:.2f}' for value in timing['ratios'])}); busy CPU share before the "
            f"rounds {timing['busy_before']:.0%}, 1-minute load before each launch {timing['loads']}.",
            "",
        ]
    plan_table = []
    for row in payload["planner"]:
        growth = row.get("growth")
        growth_text = "-"
        if growth and growth["ratio"]:
            growth_text = (
                f"{growth['planned_mib']:,.0f} / {growth['measured_mib']:,.0f} = {growth['ratio']:.2f}x "
                f"(from {growth['from_length']:,})"
            )
        plan_table.append(
            [
                row["variant"],
                row["allocator"],
                f"{row['length']:,}",
                f"{row['planned_total_mib']:,.0f}",
                f"{row['measured_mib']:,.0f}",
                f"{row['total_ratio']:.2f}x",
                f"{row['planned_sequence_mib']:,.0f}",
                growth_text,
            ]
        )
    headers = ["variant", "allocator", "length", "plan total (MiB)", "peak RSS (MiB)", "plan / RSS"]
    headers += ["plan activations + logits (MiB)", "plan / measured growth"]
    lines += [
        markdown_table(headers, plan_table),
        "",
        payload["machine_line"],
        "",
        f"Command: `{payload['command']}`",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main


def timing_rounds(work: Path, args, runs: list[dict]) -> dict:
    """sp1 and sp2 at --timing-length, --timing-steps steps each, alternated (the order flips every round)."""
    busy = busy_fraction(2.0)
    speeds: dict[str, list[float]] = {"sp1": [], "sp2": []}
    per_step: dict[str, float] = {}
    loads = []
    for index in range(args.timing_rounds):
        order = ["sp1", "sp2"] if index % 2 == 0 else ["sp2", "sp1"]
        for variant in order:
            tag = f"_t{index}"
            result = run(work, args, variant, args.timing_length, args.timing_steps, None, tag, args.timing_allocator)
            runs.append(result)
            if result["status"] != "ok":
                raise SystemExit(f"timing run {variant} failed: see {work}")
            speeds[variant].append(result["tokens_per_s"])
            per_step[variant] = result["tokens_per_step"]
            loads.append(result["load_1min_before"])
    ratios = [sp2 / sp1 for sp1, sp2 in zip(speeds["sp1"], speeds["sp2"])]
    return {
        "length": args.timing_length,
        "steps": args.timing_steps,
        "tokens_per_s": speeds,
        "tokens_per_step": per_step,
        "ratios": ratios,
        "ratio": summarize(ratios),
        "busy_before": busy,
        "loads": loads,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(parser, "long_context")
    parser.add_argument("--size", choices=sorted(MODELS), default="27m")
    parser.add_argument("--variants", default="sp1,sp2", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--cap-mib", type=float, default=1280, help="peak RSS allowed per rank")
    parser.add_argument("--start", type=int, default=1024, help="first length of the doubling")
    parser.add_argument("--resolution", type=int, default=512, help="the bisection's step (tokens)")
    parser.add_argument("--ceiling", type=int, default=1 << 17, help="no length above this is tried")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of a search run")
    parser.add_argument("--timing-length", type=int, default=4096)
    parser.add_argument("--timing-steps", type=int, default=3)
    parser.add_argument("--timing-rounds", type=int, default=3, help="0: no tokens/s comparison")
    parser.add_argument("--allocator", choices=sorted(ALLOCATORS), default="released", help="of the search runs")
    parser.add_argument("--timing-allocator", choices=sorted(ALLOCATORS), default="kept", help="of the timed runs")
    parser.add_argument("--logits-chunk", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=900, help="per launch")
    args = parser.parse_args(argv)
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    variants = [variant for variant in args.variants.split(",") if variant]
    write_data(work, max(args.ceiling, args.timing_length) * args.ranks * max(args.steps, args.timing_steps))
    cap_bytes = int(args.cap_mib * MIB)
    runs: list[dict] = []
    searches = []
    for variant in variants:
        print(f"[long_context] {variant}: the longest length under {args.cap_mib:,.0f} MiB per rank", flush=True)
        search = longest(work, args, variant, args.cap_mib, runs)
        probe = work / f"{variant}_plan.yaml"
        sp, tiled = VARIANTS[variant]
        probe.write_text(json.dumps(job_dict(work, "plan", args, args.start, sp, tiled, args.steps)))
        answer = planned(probe, args.ranks, cap_bytes)
        search.update(planned_longest=answer["longest"], planned_limited_by=answer["limited_by"])
        searches.append(search)
    base = next((search for search in searches if search["variant"] == "sp1"), None)
    for search in searches:
        if base and base["longest"] and search is not base:
            search["over_sp1"] = search["longest"] / base["longest"]
    timing = timing_rounds(work, args, runs) if args.timing_rounds else None
    planner = planner_rows(runs, cap_bytes, args.ranks)
    payload = {
        "machine": info,
        "machine_line": machine_line(info),
        "command": command_line(),
        "model": f"{args.size} ({', '.join(f'{k} {v}' for k, v in MODELS[args.size].items())})",
        "ranks": args.ranks,
        "cap_mib": args.cap_mib,
        "searches": searches,
        "timing": timing,
        "planner": planner,
        "runs": runs,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    write_results(args.name, payload, render(payload), results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
