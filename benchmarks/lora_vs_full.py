"""LoRA against full fine-tuning in the same run: trainable parameters, optimizer-state bytes, checkpoint
bytes, peak RSS per rank and tokens/s of the same sft job, with and without `model.lora` (issue #25).

    python benchmarks/lora_vs_full.py                      # ~100M Llama, r=16, ZeRO-2, 1 rank
    python benchmarks/lora_vs_full.py --ranks 2
    python benchmarks/lora_vs_full.py --size tiny --steps 2 --warmup 1     (smoke size)

Each variant is launched as users run AstrAI (`deepspeed astrai/train.py --config job.yaml`) with the
same model (`model.init`, seed), data, batch and ZeRO-2 config; on one rank ZeRO-2 is kept
(`deepspeed.single_rank_stage0: false`), so the fp32 master partition is there as on several ranks.
Rounds alternate the variants (full, lora, full, lora, ...) so a load change on a shared machine
hits both. Measured:
    trainable      parameters with requires_grad (the model built on the meta device, wrapped as the job wraps it)
    optimizer      bytes of DeepSpeed's `*optim_states.pt` files in the final checkpoint (fp32 master + Adam moments)
    checkpoint     bytes of the final checkpoint's `policy/` folder (all ranks' files), and of the whole checkpoint
    peak RSS       each rank's kernel high-water mark (VmHWM), polled while it runs
    tokens/s       median of AstrAI's own metrics.jsonl `tokens_per_s` over the steps after --warmup
Targets (#25): checkpoint <= 5% of full, peak RSS <= 0.5x full, tokens/s >= 0.9x full.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    MODELS,
    REPO,
    add_launch_arguments,
    busy_fraction,
    child_env,
    command_line,
    deepspeed_command,
    fmt,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    prepare_sft_data,
    require_success,
    summarize,
    write_results,
)

# ~98M parameters: the largest Llama this shared 2-core machine trains fully in fp32 Adam under ~3 GB per rank.
SIZES = {
    **MODELS,
    "base100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=8192,
    ),
}
VARIANTS = ("full", "lora")
TARGETS = {"checkpoint": 0.05, "peak_rss": 0.5, "tokens_per_s": 0.9}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="base100m", choices=sorted(SIZES))
    parser.add_argument("--rank", type=int, default=16, help="LoRA r (alpha = 2r)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    parser.add_argument("--rounds", type=int, default=1)
    add_launch_arguments(parser, "lora_vs_full")
    return parser.parse_args(argv)


def model_block(size: str, seq_len: int) -> dict:
    return {"model_type": "llama", **SIZES[size], "max_position_embeddings": seq_len, "tie_word_embeddings": False}


def lora_block(rank: int) -> dict:
    return {"r": rank, "alpha": 2 * rank}


def parameter_counts(init: dict, rank: int) -> dict[str, int]:
    """Total and LoRA-trainable parameters, from the model built on the meta device and wrapped as a job does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from astrai.config.schema import LoraSection
    from astrai.models.lora import apply_lora

    settings = dict(init)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings))
    total = sum(p.numel() for p in model.parameters())
    wrapped = apply_lora(model, LoraSection(**lora_block(rank)), {"path": "meta", "hash": ""})
    return {"total": total, "lora_trainable": sum(p.numel() for p in wrapped.parameters() if p.requires_grad)}


def job_file(work: Path, data: dict[str, Path], args, init: dict, name: str, lora: bool) -> Path:
    import yaml

    job = {
        "output_dir": str(work / "runs" / name),
        "model": {"init": init, **({"lora": lora_block(args.rank)} if lora else {})},
        "tokenizer": {"path": str(data["tokenizer"])},
        "data": {"path": str(data["data"]), "max_seq_len": args.seq_len, "shuffle": False},
        "train": {
            "train_type": "sft",
            "max_steps": args.steps,
            "micro_batch_size": args.micro_batch,
            "lr": 1e-3,
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "seed": 42,
        },
        "deepspeed": {"zero_stage": 2, "single_rank_stage0": False},
        "checkpoint": {"resume": "never", "keep_last": 1},
        "runtime": {"progress_bar": False, "tensorboard": False},
    }
    path = work / "jobs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def folder_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(file.stat().st_size for file in folder.rglob(pattern) if file.is_file())


def run_variant(variant: str, round_index: int, work: Path, data: dict[str, Path], args, init: dict) -> dict:
    name = f"{variant}_r{round_index}"
    job = job_file(work, data, args, init, name, lora=variant == "lora")
    busy = busy_fraction()
    command = deepspeed_command(args.ranks, REPO / "astrai" / "train.py", "--config", str(job))
    result = launch(command, env=child_env(), log=work / "logs" / f"{name}.log")
    require_success(result, name)
    run = work / "runs" / name
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checkpoint = run / "checkpoints" / f"step_{args.steps:08d}"
    record = {
        "variant": variant,
        "round": round_index,
        "cpu_busy_before": busy,
        "tokens_per_s": summarize([step["tokens_per_s"] for step in steps[args.warmup :]])["median"],
        "peak_rss_mib": result.peak_rss_mib,
        "optimizer_bytes": folder_bytes(checkpoint / "policy", "*optim_states.pt"),
        "policy_checkpoint_bytes": folder_bytes(checkpoint / "policy"),
        "checkpoint_bytes": folder_bytes(checkpoint),
        "wall_s": result.wall_s,
    }
    print(
        f"  {name}: {fmt(record['tokens_per_s'], 0)} tokens/s, peak RSS {record['peak_rss_mib']} MiB, "
        f"checkpoint {record['checkpoint_bytes'] / 2**20:.1f} MiB"
    )
    return record


def ratios(summary: dict) -> dict[str, float]:
    full, lora = summary["full"], summary["lora"]
    return {
        "checkpoint": lora["policy_checkpoint_bytes"] / full["policy_checkpoint_bytes"],
        "optimizer": lora["optimizer_bytes"] / full["optimizer_bytes"],
        "peak_rss": lora["peak_rss_mib"] / full["peak_rss_mib"],
        "tokens_per_s": lora["tokens_per_s"] / full["tokens_per_s"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    init = model_block(args.size, args.seq_len)
    data = prepare_sft_data(work / "data", rows=args.micro_batch * args.ranks * args.steps, seq_len=args.seq_len)
    counts = parameter_counts(init, args.rank)
    records = [
        run_variant(variant, round_index, work, data, args, init)
        for round_index in range(args.rounds)
        for variant in VARIANTS
    ]
    summary = {}
    for variant in VARIANTS:
        runs = [record for record in records if record["variant"] == variant]
        summary[variant] = {
            "tokens_per_s": summarize([run["tokens_per_s"] for run in runs])["median"],
            # The largest rank's peak, median over rounds.
            "peak_rss_mib": summarize([max(run["peak_rss_mib"].values()) for run in runs])["median"],
            **{key: runs[-1][key] for key in ("optimizer_bytes", "policy_checkpoint_bytes", "checkpoint_bytes")},
            "trainable": counts["lora_trainable"] if variant == "lora" else counts["total"],
        }
    measured = ratios(summary)
    met = {
        "checkpoint": measured["checkpoint"] <= TARGETS["checkpoint"],
        "peak_rss": measured["peak_rss"] <= TARGETS["peak_rss"],
        "tokens_per_s": measured["tokens_per_s"] >= TARGETS["tokens_per_s"],
    }
    payload = {
        "command": command_line(),
        "machine": info,
        "settings": vars(args) | {"model": init, "parameters": counts["total"]},
        "runs": records,
        "summary": summary,
        "ratios": measured,
        "targets": TARGETS,
        "met": met,
    }
    write_results(args.name, payload, render_markdown(payload), results_dir)
    return 0


def render_markdown(payload: dict) -> str:
    settings, summary, measured, met = payload["settings"], payload["summary"], payload["ratios"], payload["met"]
    rows = []
    for label, key, scale, digits in (
        ("trainable parameters", "trainable", 1, 0),
        ("optimizer state (MiB, checkpoint files)", "optimizer_bytes", 2**20, 1),
        ("policy checkpoint (MiB)", "policy_checkpoint_bytes", 2**20, 2),
        ("whole checkpoint (MiB, tokenizer/job/state included)", "checkpoint_bytes", 2**20, 2),
        ("peak RSS of the largest rank (MiB)", "peak_rss_mib", 1, 0),
        ("tokens/s (median after warmup)", "tokens_per_s", 1, 0),
    ):
        full, lora = summary["full"][key] / scale, summary["lora"][key] / scale
        rows.append([label, fmt(full, digits), fmt(lora, digits), fmt(lora / full, 3)])
    verdicts = [
        f"checkpoint {measured['checkpoint']:.3f}x (target <= {payload['targets']['checkpoint']}): "
        f"{'met' if met['checkpoint'] else 'NOT met'}",
        f"peak RSS {measured['peak_rss']:.3f}x (target <= {payload['targets']['peak_rss']}): "
        f"{'met' if met['peak_rss'] else 'NOT met'}",
        f"tokens/s {measured['tokens_per_s']:.3f}x (target >= {payload['targets']['tokens_per_s']}): "
        f"{'met' if met['tokens_per_s'] else 'NOT met'}",
    ]
    return "\n".join(
        [
            f"LoRA r={settings['rank']} vs full fine-tuning: Llama {settings['size']} "
            f"({settings['parameters'] / 1e6:.1f}M parameters), sft, seq {settings['seq_len']}, micro-batch "
            f"{settings['micro_batch']}, {settings['steps']} steps ({settings['warmup']} warmup), ZeRO-2 kept on "
            f"{settings['ranks']} rank(s), fp32, {settings['rounds']} round(s).",
            "",
            markdown_table(["", "full", f"LoRA r={settings['rank']}", "LoRA / full"], rows),
            "",
            "; ".join(verdicts) + ".",
            "",
            machine_line(payload["machine"]),
            f"Command: `{payload['command']}`",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
