"""A GRPO step of AstrAI against TRL's GRPOTrainer: same model, prompts, reward, group size and sampling.

    python benchmarks/grpo_vs_trl.py                          # small-width Llama, 16 prompts x 8, 8 new tokens
    python benchmarks/grpo_vs_trl.py --dry-run                # writes and validates the AstrAI job only (no TRL)

Variants, alternated round by round (the order rotates every round), one launch each:
    astrai            `deepspeed --num_gpus 1 astrai/train.py` (1 CPU rank), rollout.share_prefill true (default)
    astrai_unshared   the same with rollout.share_prefill false (every copy of a prompt prefilled)
    astrai_prefix     `astrai` with rl.share_prefix true (the policy's and the reference's forwards run each
                      distinct prompt once; the replay keeps groups together: 4 prompts per micro-batch of 32)
    trl               benchmarks/trl_grpo.py with the python of benchmarks/.venv-trl (created on first use with
                      `pip install torch==2.13.0 trl`; the variant is skipped with a note when that fails)
Both sides: the Llama of `benchmarks/common.py` MODELS[--size] with the char tokenizer's vocabulary (built by
AstrAI's builder from the arithmetic data, ChatML template), same init seed; the shipped arithmetic prompts
(data/arithmetic/prompts_64.jsonl) as one user message each; the exact-match reward of configs/quickstart_grpo.yaml
(astrai.rollout.rewards:arithmetic_exact_match); temperature 1, top_p 1, top_k off; clip 0.2, KL coefficient
0.04 (a reference model on both sides); token-mean loss; one optimizer step per rollout (micro-batch 32 x
accumulation); fp32; no checkpoints, exports, eval or logging during the steps. Measured: wall seconds per step
(AstrAI: differences of metrics.jsonl's elapsed_s; TRL: between consecutive on_step_end callbacks), median over the
steps after `--warmup`; the ratio is TRL's seconds per step over AstrAI's (AstrAI's speed in units of TRL's).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    child_env,
    command_line,
    deepspeed_command,
    fmt,
    fmt_summary,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    model_init,
    parameter_count,
    summarize,
    write_results,
)

TRL_VENV = REPO / "benchmarks" / ".venv-trl"
PROMPTS = REPO / "data" / "arithmetic" / "prompts_64.jsonl"
KL_COEF, LR, MICRO_BATCH, MAX_SEQ_LEN = 0.04, 3e-4, 32, 64
VARIANTS = ("astrai_prefix", "astrai", "astrai_unshared", "trl")
# The AstrAI variants' settings: rollout.share_prefill, rl.share_prefix.
ASTRAI_SETTINGS = {"astrai": (True, False), "astrai_unshared": (False, False), "astrai_prefix": (True, True)}
# (variant, baseline) pairs whose ratios are reported: baseline's seconds per step / variant's.
COMPARISONS = (
    ("astrai_prefix", "trl"),
    ("astrai", "trl"),
    ("astrai_unshared", "trl"),
    ("astrai", "astrai_unshared"),
    ("astrai_prefix", "astrai"),
)
STATISTIC = {"step_s": "median step", "best_step_s": "best step"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="benchmarks/common.py MODELS key (vocab from the tokenizer)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps per launch not measured")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dry-run", action="store_true", help="build and validate the AstrAI job, launch nothing")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default="grpo_vs_trl")
    return parser.parse_args(argv)


def prepare(work: Path, size: str) -> tuple[Path, dict]:
    """The char tokenizer (AstrAI's builder, arithmetic characters) and the init block with its vocabulary."""
    from astrai.models.tokenizer import build_tokenizer, save_tokenizer

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    texts = [row["prompt"] + row["answer"] for row in rows] + ["0123456789+-*=\n "]
    tokenizer = build_tokenizer("char", texts)
    folder = work / "tokenizer"
    save_tokenizer(tokenizer, folder)
    init = model_init(size, MAX_SEQ_LEN)
    init["vocab_size"] = len(tokenizer)
    return folder, init


def astrai_job(work: Path, tokenizer: Path, init: dict, args, name: str, variant: str) -> Path:
    import yaml

    share_prefill, share_prefix = ASTRAI_SETTINGS[variant]
    responses = args.prompts_per_step * args.group_size
    job = {
        "output_dir": str(work / "runs" / name),
        "model": {"init": init},
        "tokenizer": {"path": str(tokenizer)},
        "data": {"path": str(PROMPTS), "max_seq_len": MAX_SEQ_LEN},
        "rollout": {
            "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "share_prefill": share_prefill,
        },
        "rl": {
            "epochs_per_rollout": 1,
            "clip_eps_low": 0.2,
            "kl_coef": KL_COEF,
            "loss_aggregation": "token_mean",
            "share_prefix": share_prefix,
        },
        "reward": {"function": "astrai.rollout.rewards:arithmetic_exact_match"},
        "train": {
            "train_type": "grpo",
            "max_steps": args.steps,
            "micro_batch_size": MICRO_BATCH,
            "grad_accum_steps": responses // MICRO_BATCH,
            "lr": LR,
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "seed": 42,
        },
        "deepspeed": {"config": str(REPO / "ds_configs" / "zero2.json")},
        "checkpoint": {"resume": "never", "keep_last": 1},
        "export": {"on_finish": False},
        "runtime": {"progress_bar": False},
    }
    path = work / "jobs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def ensure_trl_venv() -> str | None:
    """TRL in its own venv (never in the project's): None when ready, else why the variant is skipped."""
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


def trl_arguments(init: dict, tokenizer: Path, args, out: Path) -> list[str]:
    """benchmarks/trl_grpo.py and its arguments for the job's settings (TRL's python goes before them)."""
    command = [str(REPO / "benchmarks" / "trl_grpo.py")]
    command += ["--model", json.dumps(init), "--tokenizer", str(tokenizer), "--prompts", str(PROMPTS)]
    command += ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step)]
    command += ["--group-size", str(args.group_size), "--micro-batch", str(MICRO_BATCH)]
    command += ["--new-tokens", str(args.new_tokens), "--kl-coef", str(KL_COEF), "--lr", str(LR), "--out", str(out)]
    return command


def run_variant(variant: str, round_index: int, work: Path, tokenizer: Path, init: dict, args) -> dict:
    name = f"{variant}_r{round_index}"
    log = work / "logs" / f"{name}.log"
    if variant == "trl":
        out = work / "out" / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        command = [str(TRL_VENV / "bin" / "python"), *trl_arguments(init, tokenizer, args, out)]
    else:
        job = astrai_job(work, tokenizer, init, args, name, variant)
        command = deepspeed_command(1, REPO / "astrai" / "train.py", "--config", str(job))
    result = launch(command, env=child_env(), log=log)
    record = {"variant": variant, "round": round_index, "returncode": result.returncode, "wall_s": result.wall_s}
    if result.returncode != 0:
        record["error"] = "\n".join(text for _, text in result.lines[-15:])
        print(f"  {name}: FAILED (exit {result.returncode}); see {log}")
        return record
    if variant == "trl":
        report = json.loads(out.read_text())
        seconds = report["step_seconds"]
        record.update(trl_version=report["trl"], threads=report["threads"])
        for _, text in result.lines:  # TRL's end-of-training summary: means over the whole run
            if match := re.search(r"'completions/mean_length': '([0-9.e+-]+)'", text):
                record["response_len_mean"] = float(match.group(1))
    else:
        steps = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "elapsed_s" in s and "rollout_s" in s]
        elapsed = [0.0] + [s["elapsed_s"] for s in steps]
        seconds = [b - a for a, b in zip(elapsed, elapsed[1:])]
        record.update(
            rollout_s=summarize([s["rollout_s"] for s in steps[args.warmup :]])["median"],
            train_s=summarize([s["train_s"] for s in steps[args.warmup :]])["median"],
            response_len_mean=sum(s["response_len_mean"] for s in steps) / len(steps),
        )
    # The best step too: on a shared machine a neighbour's burst lengthens some steps, never shortens one.
    measured = summarize(seconds[args.warmup :])
    record.update(step_seconds=seconds, step_s=measured["median"], best_step_s=measured["min"])
    print(f"  {name}: {fmt(record['step_s'], 3)} s/step (median of steps {args.warmup + 1}-{len(seconds)})")
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    started = time.perf_counter()
    tokenizer, init = prepare(work, args.size)
    variants = [v for v in args.variants.split(",") if v]
    if args.dry_run:
        from astrai.config.loader import load_job

        for variant in ASTRAI_SETTINGS:
            job = astrai_job(work, tokenizer, init, args, variant, variant)
            load_job(job)
            print(f"dry run: {job} is a valid job")
        return 0
    notes = []
    if "trl" in variants and (why := ensure_trl_venv()):
        notes.append(f"trl skipped: {why}")
        variants.remove("trl")
    records = []
    for round_index in range(args.rounds):
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        print(f"round {round_index + 1}/{args.rounds}: {', '.join(order)}", flush=True)
        for variant in order:
            records.append(run_variant(variant, round_index, work, tokenizer, init, args))
    by = {(r["variant"], r["round"]): r for r in records if r.get("step_s")}
    summary = {v: summarize([by[(v, k)]["step_s"] for k in range(args.rounds) if (v, k) in by]) for v in variants}
    best = {v: summarize([by[(v, k)]["best_step_s"] for k in range(args.rounds) if (v, k) in by]) for v in variants}
    lengths = {
        v: summarize([r["response_len_mean"] for r in by.values() if r["variant"] == v and "response_len_mean" in r])
        for v in variants
    }
    ratios = []
    for key in ("step_s", "best_step_s"):
        for variant, baseline in COMPARISONS:
            values = [
                by[(baseline, k)][key] / by[(variant, k)][key]
                for k in range(args.rounds)
                if (variant, k) in by and (baseline, k) in by
            ]
            if values:
                ratios.append({"variant": variant, "baseline": baseline, "of": key, **summarize(values)})
    trl_version = next((r["trl_version"] for r in records if r.get("trl_version")), None)
    payload = {
        "benchmark": args.name,
        "command": command_line(),
        "machine": info,
        "settings": vars(args),
        "trl": trl_version,
        "model": init,
        "parameters": parameter_count(init),
        "summary": summary,
        "best_step": best,
        "ratios": ratios,
        "notes": notes,
        "runs": records,
        "total_s": time.perf_counter() - started,
    }
    lines = [
        f"### GRPO step, AstrAI vs TRL GRPOTrainer ({payload['parameters'] / 1e6:.1f}M-parameter Llama, "
        f"{args.prompts_per_step} prompts x group {args.group_size}, {args.new_tokens} new tokens, 1 CPU process, "
        f"fp32, {args.rounds} rounds x {args.steps} steps, first {args.warmup} not measured)",
        "",
        machine_line(info) + f" TRL {trl_version}.",
        "",
        markdown_table(
            ["variant", "baseline", "per launch", "speed ratio (baseline s/step / variant s/step)", "rounds"],
            [[r["variant"], r["baseline"], STATISTIC[r["of"]], fmt_summary(r), r["n"]] for r in ratios],
        ),
        "",
        markdown_table(
            ["variant", "median step (s)", "best step (s)", "mean response tokens (EOS included)"],
            [[v, fmt_summary(s, 3), fmt_summary(best[v], 3), fmt_summary(lengths[v], 2)] for v, s in summary.items()],
        ),
        "",
        *notes,
        f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min).",
    ]
    write_results(args.name, payload, "\n".join(lines), results_dir)
    shutil.rmtree(work / "runs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
