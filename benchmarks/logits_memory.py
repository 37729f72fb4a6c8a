"""Peak memory of one sft forward + backward with and without `train.logits_chunk_size`.

Each variant runs in a fresh process: build the model (a Llama with a 151,936-token vocabulary: hidden 256,
2 layers, untied output layer, fp32), take the resident set, then run `--steps` sft steps through the
strategy's own `compute_loss` + backward and report the kernel's high-water mark (VmHWM) above that
starting point, and the median step time. The variants alternate over `--rounds`, as every benchmark here.

    python benchmarks/logits_memory.py                       # chunk 0 (full logits), 512, 256, 128
    python benchmarks/logits_memory.py --chunks 0,512 --vocab 2048 --seq-len 64   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_launch_arguments,
    child_env,
    command_line,
    fmt_summary,
    fresh_workspace,
    markdown_table,
    summarize,
    write_results,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="0,512,256,128", help="train.logits_chunk_size values; 0 = full logits")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    add_launch_arguments(parser, "logits_memory")
    return parser.parse_args(argv)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(plan: dict) -> int:
    """One variant in this process: prints one JSON line with the peak above the start and step times."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from astrai.config.schema import JobConfig
    from astrai.strategies.language_modeling import SftStrategy

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=plan["vocab"],
        hidden_size=plan["hidden"],
        intermediate_size=4 * plan["hidden"],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=plan["seq_len"],
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    job = JobConfig.model_validate(
        {
            "output_dir": "/tmp/unused",
            "model": {"init": {"model_type": "llama"}},
            "tokenizer": {"build": {"kind": "char"}},
            "data": {"path": "unused.jsonl"},
            "train": {"train_type": "sft", "max_steps": 1, "logits_chunk_size": plan["chunk"]},
        }
    )
    strategy = SftStrategy(job, None)
    input_ids = torch.randint(0, plan["vocab"], (plan["batch"], plan["seq_len"]))
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": torch.ones_like(input_ids),
    }
    start_kib = status_kib("VmRSS")
    times, losses = [], []
    for _ in range(plan["steps"]):
        began = time.perf_counter()
        output = strategy.compute_loss(model, batch, normalizer=float(batch["loss_mask"][:, 1:].sum()))
        output.loss.backward()
        times.append(time.perf_counter() - began)
        losses.append(float(output.loss))
        model.zero_grad(set_to_none=False)  # the gradients stay allocated: every step's peak is comparable
    peak_kib = status_kib("VmHWM")
    print(
        "RESULT "
        + json.dumps({"peak_above_start_mib": (peak_kib - start_kib) / 1024, "times": times, "losses": losses})
    )
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    results_dir, _, info = fresh_workspace(args.results_dir, args.name)
    chunks = [int(value) for value in args.chunks.split(",")]
    runs: dict[int, list[dict]] = {chunk: [] for chunk in chunks}
    for round_index in range(args.rounds):
        order = chunks[round_index % len(chunks) :] + chunks[: round_index % len(chunks)]
        for chunk in order:
            plan = {
                "chunk": chunk,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "seq_len": args.seq_len,
                "batch": args.batch,
                "steps": args.steps,
            }
            command = [sys.executable, __file__, "--worker", json.dumps(plan)]
            completed = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=1800)
            if completed.returncode != 0:
                print(completed.stdout[-2000:], completed.stderr[-4000:], file=sys.stderr)
                return 1
            line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
            runs[chunk].append(json.loads(line.removeprefix("RESULT ")))
            print(f"round {round_index} chunk {chunk}: {runs[chunk][-1]['peak_above_start_mib']:.0f} MiB")
    full = runs.get(0)
    rows = []
    for chunk in chunks:
        peaks = [run["peak_above_start_mib"] for run in runs[chunk]]
        steady = [statistics.median(run["times"][1:] or run["times"]) for run in runs[chunk]]
        ratio = (
            fmt_summary(summarize([t / statistics.median(f["times"][1:] or f["times"]) for t, f in zip(steady, full)]))
            if full
            else "-"
        )
        loss_gap = max(
            abs(a - b)
            for run, base in zip(runs[chunk], full or runs[chunk])
            for a, b in zip(run["losses"], base["losses"])
        )
        rows.append([chunk or "off (full logits)", fmt_summary(summarize(peaks), 0), ratio, f"{loss_gap:.1e}"])
    tokens = args.batch * args.seq_len
    markdown = (
        f"Llama, hidden {args.hidden}, 2 layers, vocab {args.vocab:,}, untied, fp32; batch {args.batch} x seq "
        f"{args.seq_len} = {tokens} positions; {args.steps} sft steps per process, {args.rounds} rounds.\n"
        f"Full logits of the micro-batch: {tokens * args.vocab * 4 / 2**20:.0f} MiB fp32.\n\n"
        + markdown_table(
            [
                "train.logits_chunk_size",
                "peak RSS above the built model, MiB",
                "step time / full logits",
                "max loss gap vs full",
            ],
            rows,
        )
        + f"\n\n`{command_line()}`"
    )
    payload = {"machine": info, "args": vars(args), "runs": {str(k): v for k, v in runs.items()}}
    write_results(args.name, payload, markdown, results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
