"""Every path of AstrAI at Qwen2.5-0.5B's shape (configs/scale_0p5b.yaml), with peak RSS per rank per phase.

Run it on an otherwise idle machine (the 0.5B shape needs ~8 GB of model states in fp32, 10-20 GB
in all); on a shared one smoke-test it at the tiny shape only:

    python benchmarks/scale_0p5b.py                                   # every phase, the 0.5B shape
    python benchmarks/scale_0p5b.py --phases sft_zero3,publish        # some phases
    python benchmarks/scale_0p5b.py --shape tiny --steps 2            # smoke run (a minute or two)
    python benchmarks/scale_0p5b.py --shape mid --phases sft_zero3,sft_zero3_whole_init   # ~108M, a shared machine

Phases (each one launch; peak RSS = the kernel's high-water mark VmHWM of every rank, polled):
    sft_zero3          sft under ZeRO-3 on 2 ranks for --steps steps; publishes its final checkpoint
    publish            that publish's own time (the rank-0 log line) against a plain copy + fsync of the
                       same checkpoint files (the bytes, written without staging, hashing or manifest)
    resume_2           resume that checkpoint on 2 ranks for one more step (a new output_dir)
    resume_1           resume it on 1 rank: a world-size change (resume/topology.py)
    export_hf          python -m astrai export-hf of that checkpoint (one process)
    sft_zero2_offload  sft under ZeRO-2 with the optimizer offloaded to the CPU, 2 ranks
    grpo               grpo on the arithmetic prompts, 2 ranks, ZeRO-3, --steps rollouts
    online_ppo         online_ppo (policy and critic engines, the reference, the arithmetic reward), 2 ranks,
                       ZeRO-3, --steps rollouts, at --ppo-shape: `auto` takes the largest shape of
                       0p5b > 0p5b_12l > 0p5b_8l > mid > tiny (not above --shape) whose `python -m astrai plan`
                       total for 2 ranks fits in 70% of this machine's memory (the row's note says which; on
                       the 24 GiB machine: 0p5b_8l)
    sft_zero3_whole_init  (only when named) sft_zero3 with model.zero3_init=false: the model built whole on
                       every rank before DeepSpeed partitions it, the baseline of model.zero3_init's building
Beside each measured peak, `python -m astrai plan` gives its per-rank estimate for the same job.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    add_launch_arguments,
    busy_fraction,
    child_env,
    command_line,
    deepspeed_command,
    fresh_workspace,
    launch,
    markdown_table,
    write_results,
)

CONFIG = REPO / "configs" / "scale_0p5b.yaml"
PHASES = ("sft_zero3", "publish", "resume_2", "resume_1", "export_hf", "sft_zero2_offload", "grpo", "online_ppo")
OPTIONAL_PHASES = ("sft_zero3_whole_init",)  # run only when named
NEEDS_CHECKPOINT = {"publish", "resume_2", "resume_1", "export_hf"}
# --shape tiny: the same job at a shape any machine runs in seconds (for the smoke test only).
TINY = {
    "model.init.hidden_size": 64,
    "model.init.intermediate_size": 128,
    "model.init.num_hidden_layers": 2,
    "model.init.num_attention_heads": 4,
    "model.init.num_key_value_heads": 2,
    "model.init.vocab_size": 2048,
    "model.init.max_position_embeddings": 256,
    "tokenizer.build.vocab_size": 2048,
    "data.max_seq_len": 128,
    "train.logits_chunk_size": 64,
}
# --shape mid: the real 151,936-token vocabulary on a ~108M model (hidden 512, 8 layers) with short sequences,
# small enough (~2 GiB per rank) to measure on a machine shared with other jobs.
MID = {
    "model.init.hidden_size": 512,
    "model.init.intermediate_size": 2048,
    "model.init.num_hidden_layers": 8,
    "model.init.num_attention_heads": 8,
    "model.init.num_key_value_heads": 2,
    "data.max_seq_len": 256,
    "train.micro_batch_size": 1,
}
# Largest first (--ppo-shape auto): the 0.5B shape, then with 12 and 8 of its 24 layers (its vocabulary and
# width: 315M and 255M parameters), then mid and tiny.
SHAPES = {
    "0p5b": {},
    "0p5b_12l": {"model.init.num_hidden_layers": 12},
    "0p5b_8l": {"model.init.num_hidden_layers": 8},
    "mid": MID,
    "tiny": TINY,
}
# The plan ran ~30% under the measured peak at the mid shape (docs/benchmarks.md): auto keeps that margin.
PPO_MEMORY_FRACTION = 0.7
PPO_JOB = {
    "train.train_type": "online_ppo",
    "data.path": "data/arithmetic/prompts.jsonl",
    "data.max_seq_len": 64,
    "critic.lr": 1e-5,
}
PUBLISHED = re.compile(r"published (\S+): \d+ files .*?([\d.]+) MiB in ([\d.]+) s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES + OPTIONAL_PHASES)}"
    )
    parser.add_argument("--shape", choices=tuple(SHAPES), default="0p5b")
    parser.add_argument(
        "--ppo-shape",
        choices=("auto", *SHAPES),
        default="auto",
        help="online_ppo's shape; auto: the largest whose plan fits this machine (at most --shape)",
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (rollouts for grpo) per training phase")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per phase")
    add_launch_arguments(parser, "scale_0p5b")
    return parser.parse_args(argv)


class Bench:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.shape = SHAPES[args.shape]
        self.rows: list[dict] = []
        self.checkpoint: Path | None = None
        self.publish_line: tuple[float, float] | None = None  # (MiB, seconds) of sft_zero3's final publish

    def overrides(self, output_dir: Path, **extra) -> list[str]:
        settings = {**self.shape, "output_dir": str(output_dir), "train.max_steps": self.args.steps, **extra}
        return [part for key, value in settings.items() for part in ("--set", f"{key}={value}")]

    def ppo_shape(self) -> tuple[str, str]:
        """online_ppo's shape and why: --ppo-shape, or the largest (not above --shape) whose plan fits."""
        if self.args.ppo_shape != "auto":
            return self.args.ppo_shape, "--ppo-shape"
        names = list(SHAPES)
        budget = PPO_MEMORY_FRACTION * memory_total_mib()
        for name in names[names.index(self.args.shape) :]:
            settings = {**SHAPES[name], **PPO_JOB, "output_dir": str(self.work / "plan"), "train.max_steps": 1}
            overrides = [part for key, value in settings.items() for part in ("--set", f"{key}={value}")]
            per_rank = self.planned_mib(2, overrides)
            if per_rank is not None and 2 * per_rank <= budget:
                fraction = f"{PPO_MEMORY_FRACTION:.0%}"
                return name, f"plan {2 * per_rank:,.0f} MiB for 2 ranks <= {budget:,.0f} MiB ({fraction} of memory)"
            print(f"online_ppo at shape {name}: plan {per_rank} MiB per rank, over {budget:,.0f} MiB", flush=True)
        return names[-1], "no shape's plan fits: the smallest"

    def online_ppo(self) -> None:
        name, reason = self.ppo_shape()
        shape, self.shape = self.shape, SHAPES[name]
        try:
            row = self.train("online_ppo", 2, self.work / "online_ppo", **PPO_JOB)
        finally:
            self.shape = shape
        row["shape"] = name
        row["note"] = f"shape {name} ({reason})"

    def planned_mib(self, ranks: int, overrides: list[str]) -> float | None:
        """`python -m astrai plan`'s per-rank total (host, on this CPU machine; GPU + host elsewhere)."""
        command = [sys.executable, "-m", "astrai", "plan", "--config", str(CONFIG), "--gpus-per-node", str(ranks)]
        result = launch([*command, *overrides, "--json"], env=child_env(), timeout=900)
        text = result.text()
        try:
            plan = json.loads(text[text.index("{") :])
        except ValueError:
            return None
        return (plan["gpu_total"] + plan["host_total"]) / 2**20

    def train(self, phase: str, ranks: int, output_dir: Path, **extra) -> dict:
        overrides = self.overrides(output_dir, **extra)
        busy = busy_fraction()
        command = deepspeed_command(ranks, REPO / "astrai" / "train.py", "--config", str(CONFIG), *overrides)
        result = launch(command, env=child_env(), timeout=self.args.timeout, log=self.work / f"{phase}.log")
        row = {
            "phase": phase,
            "ranks": ranks,
            "exit": result.returncode,
            "wall_s": result.wall_s,
            "peak_rss_mib": result.peak_rss_mib,
            "plan_mib": self.planned_mib(ranks, overrides),
            "machine_busy_before": busy,
        }
        published = [PUBLISHED.search(text) for _, text in result.lines]
        published = [match for match in published if match]
        if published:
            row["publish_mib"], row["publish_s"] = float(published[-1].group(2)), float(published[-1].group(3))
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    def sft_zero3(self) -> None:
        row = self.train("sft_zero3", 2, self.work / "sft")
        steps = sorted((self.work / "sft" / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
        if row["exit"] == 0 and steps:
            self.checkpoint = steps[-1]
            self.publish_line = (row.get("publish_mib"), row.get("publish_s"))

    def publish(self) -> None:
        """A plain copy of the published checkpoint's files (read from the page cache) + fsync of each, and of
        the folder: the same bytes made durable without AstrAI's staging, hashing, manifest and rename."""
        target = self.work / "plain_copy"
        shutil.rmtree(target, ignore_errors=True)
        started = time.perf_counter()
        total = 0
        for source in sorted(p for p in self.checkpoint.rglob("*") if p.is_file()):
            destination = target / source.relative_to(self.checkpoint)
            destination.parent.mkdir(parents=True, exist_ok=True)
            with open(source, "rb") as reader, open(destination, "wb") as writer:
                while block := reader.read(64 << 20):
                    writer.write(block)
                    total += len(block)
                writer.flush()
                os.fsync(writer.fileno())
        folder = os.open(target, os.O_RDONLY)
        os.fsync(folder)
        os.close(folder)
        plain_s = time.perf_counter() - started
        mib, publish_s = self.publish_line or (None, None)
        row = {"phase": "publish", "ranks": 2, "exit": 0, "publish_s": publish_s, "publish_mib": mib}
        row.update(plain_copy_fsync_s=plain_s, plain_mib=total / 2**20)
        row["publish_over_plain"] = publish_s / plain_s if publish_s else None
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(target, ignore_errors=True)

    def resume(self, ranks: int) -> None:
        state = json.loads((self.checkpoint / "trainer_state.json").read_text())
        self.train(
            f"resume_{ranks}",
            ranks,
            self.work / f"resume_{ranks}",
            **{"checkpoint.resume": str(self.checkpoint), "train.max_steps": int(state["step"]) + 1},
        )

    def export_hf(self) -> None:
        destination = self.work / "hf"
        shutil.rmtree(destination, ignore_errors=True)
        command = [sys.executable, "-m", "astrai", "export-hf", str(self.checkpoint), str(destination)]
        result = launch(command, env=child_env(), timeout=self.args.timeout, log=self.work / "export_hf.log")
        row = {"phase": "export_hf", "ranks": 1, "exit": result.returncode, "wall_s": result.wall_s}
        row["peak_rss_mib"] = result.peak_rss_mib
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def run(self, phases: list[str]) -> None:
        if NEEDS_CHECKPOINT & set(phases) and "sft_zero3" not in phases:
            phases = ["sft_zero3", *phases]  # they read its checkpoint
        for phase in phases:
            if phase in NEEDS_CHECKPOINT and self.checkpoint is None:
                self.rows.append({"phase": phase, "exit": None, "note": "skipped: sft_zero3 left no checkpoint"})
                continue
            if phase == "sft_zero3":
                self.sft_zero3()
            elif phase == "publish":
                self.publish()
            elif phase in ("resume_2", "resume_1"):
                self.resume(int(phase[-1]))
            elif phase == "export_hf":
                self.export_hf()
            elif phase == "sft_zero2_offload":
                self.train(
                    phase,
                    2,
                    self.work / phase,
                    **{"deepspeed.config": "ds_configs/zero2.json", "deepspeed.offload_optimizer": "cpu"},
                )
            elif phase == "sft_zero3_whole_init":
                self.train(phase, 2, self.work / phase, **{"model.zero3_init": "false"})
            elif phase == "online_ppo":
                self.online_ppo()
            elif phase == "grpo":
                grpo = {
                    "train.train_type": "grpo",
                    "data.path": "data/arithmetic/prompts.jsonl",
                    "data.max_seq_len": 64,
                }
                self.train(phase, 2, self.work / phase, **grpo)


def memory_total_mib() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def render(rows: list[dict], args) -> str:
    def mib(value) -> str:
        return "-" if value is None else f"{value:,.0f}"

    table = []
    for row in rows:
        peaks = row.get("peak_rss_mib") or {}
        notes = []
        if row.get("publish_s") is not None:
            notes.append(f"publish {row['publish_s']:.1f} s for {row.get('publish_mib') or 0:,.0f} MiB")
        if row.get("plain_copy_fsync_s") is not None:
            notes.append(f"plain copy + fsync {row['plain_copy_fsync_s']:.1f} s")
        if row.get("publish_over_plain"):
            notes.append(f"ratio {row['publish_over_plain']:.2f}x")
        if row.get("note"):
            notes.append(row["note"])
        table.append(
            [
                row["phase"],
                row.get("ranks", "-"),
                "ok" if row.get("exit") == 0 else f"exit {row.get('exit')}",
                " / ".join(mib(peaks[rank]) for rank in sorted(peaks)) or "-",
                mib(row.get("plan_mib")),
                f"{row['wall_s']:.0f}" if row.get("wall_s") else "-",
                "; ".join(notes),
            ]
        )
    headers = ["phase", "ranks", "result", "peak RSS per rank, MiB", "plan per rank, MiB", "wall s", "notes"]
    return f"Shape: {args.shape}, {args.steps} steps per training phase.\n\n" + markdown_table(headers, table)


def main(argv=None) -> int:
    args = parse_args(argv)
    phases = [phase for phase in args.phases.split(",") if phase]
    unknown = sorted(set(phases) - set(PHASES) - set(OPTIONAL_PHASES))
    if unknown:
        print(f"unknown phases {unknown}; choose from {', '.join(PHASES + OPTIONAL_PHASES)}", file=sys.stderr)
        return 2
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    bench = Bench(args, work)
    bench.run(phases)
    markdown = render(bench.rows, args) + f"\n\n`{command_line()}`"
    write_results(args.name, {"machine": info, "args": vars(args), "rows": bench.rows}, markdown, results_dir)
    return 0 if all(row.get("exit") in (0, None) for row in bench.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
