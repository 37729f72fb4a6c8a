"""Where a GRPO step of `benchmarks/grpo_vs_trl.py` spends its time: cProfile over AstrAI's online loop.

    python benchmarks/profile_grpo_step.py                  # the benchmark's job, 8 steps, 1 process
    python benchmarks/profile_grpo_step.py --steps 12 --top 40
    python benchmarks/profile_grpo_step.py --set rl.packing=true --name profile_grpo_step_packed
    python benchmarks/profile_grpo_step.py --trl               # also TRL's GRPOTrainer (benchmarks/.venv-trl)

The same job as grpo_vs_trl.py's `astrai` variant (its `astrai_job`: small Llama, 16 prompts x 8, 8 new tokens,
KL 0.04 with a reference, one optimizer step per rollout, fp32, ZeRO-2 template), built and run in this
process (one rank, no launcher) with cProfile around `train_online` only (the build and the final checkpoint
are outside the steps or reported apart). The step's time is split by the cumulative time of the functions
that do each part; shares are of the loop's total, so they hold on a loaded machine where seconds do not.
Writes the breakdown into benchmarks/results/<name>.json and .md, the pstats file into <name>_work/.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import child_env, fresh_workspace, machine_line  # noqa: E402
from benchmarks.grpo_vs_trl import astrai_job, prepare  # noqa: E402

LOOP = ("astrai/training/loops.py", "train_online")
FUNCTIONS = {  # name -> (file suffix, function): cumulative seconds, recursion counted once
    "generate_rollout": ("rollout/generation.py", "generate_rollout"),
    "sample_responses": ("rollout/generation.py", "sample_responses"),
    "response_logprobs": ("rollout/scoring.py", "frozen_logprobs"),  # behaviour (if any) and reference
    "score": ("strategies/online_base.py", "score"),
    "frozen_targets": ("strategies/grpo.py", "frozen_targets"),
    "compute_loss": ("strategies/grpo.py", "compute_loss"),
    "backward": ("engine/engines.py", "backward"),
    "finish_update": ("astrai/training/loops.py", "finish_update"),
    "minibatches": ("strategies/online_base.py", "minibatches"),
    "close_step": ("astrai/training/loops.py", "_close_step"),
    "global_sums": ("astrai/training/loops.py", "_global_sums"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads, as the benchmark's ranks")
    parser.add_argument("--set", action="append", default=[], help="a job override, e.g. rl.packing=true")
    parser.add_argument("--trl", action="store_true", help="also profile TRL's GRPOTrainer on the same job")
    parser.add_argument("--top", type=int, default=0, help="also print the N functions with most own time")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default="profile_grpo_step")
    return parser.parse_args(argv)


def check_functions() -> None:
    """Every function profiled is still where FUNCTIONS says: a rename would otherwise read as 0 seconds."""
    package = Path(__file__).resolve().parents[1] / "astrai"
    for suffix, name in [LOOP, *FUNCTIONS.values()]:
        path = package / suffix.removeprefix("astrai/")
        if not path.is_file() or f"def {name}(" not in path.read_text():
            raise SystemExit(f"profile_grpo_step: no function {name} in astrai/{suffix.removeprefix('astrai/')}")


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    """Cumulative seconds of the function(s) `name` in a file ending with `suffix` (recursion counted once)."""
    return sum(
        entry[3] for (path, _, function), entry in stats.stats.items() if function == name and path.endswith(suffix)
    )


def breakdown(stats: pstats.Stats, behaviour: bool) -> dict:
    """The loop's seconds by part. In generate_rollout: sampling, the behaviour forward (when the job takes one)
    and the rest (texts, padding, masks); in frozen_targets: the reference forward and the rest (advantages,
    collation of the targets)."""
    total = cumulative(stats, *LOOP)
    seconds = {name: cumulative(stats, *where) for name, where in FUNCTIONS.items()}
    inside_rollout = seconds["response_logprobs"] if behaviour else 0.0  # else every call is the reference's
    parts = {
        "rollout: generate (prefill + decode steps)": seconds["sample_responses"],
        "rollout: behaviour log-probs": inside_rollout,
        "rollout: texts, masks, padding": seconds["generate_rollout"] - seconds["sample_responses"] - inside_rollout,
        "reward": seconds["score"],
        "reference forward": seconds["response_logprobs"] - inside_rollout,
        "targets: advantages, tensors": seconds["frozen_targets"] - (seconds["response_logprobs"] - inside_rollout),
        "policy forward + loss": seconds["compute_loss"],
        "policy backward": seconds["backward"],
        "optimizer step": seconds["finish_update"],
        "minibatch slicing": seconds["minibatches"],
        "metrics, log, checkpoint": seconds["close_step"] + seconds["global_sums"],
    }
    parts["other (loop, Python)"] = total - sum(parts.values())
    return {"loop_s": total, "parts": {label: {"s": s, "share": s / total} for label, s in parts.items()}}


TRL_LOOP = ("transformers/trainer.py", "_inner_training_loop")
TRL_FUNCTIONS = {
    "generate": ("trl/trainer/grpo_trainer.py", "_generate_single_turn"),
    "tokenize": ("trl/trainer/grpo_trainer.py", "_tokenize_prompts"),
    "reward": ("trl/trainer/grpo_trainer.py", "_calculate_rewards"),
    "score": ("trl/trainer/grpo_trainer.py", "_generate_and_score_completions"),
    "logps": ("trl/trainer/grpo_trainer.py", "_get_per_token_logps_and_entropies"),
    "compute_loss": ("trl/trainer/grpo_trainer.py", "_compute_loss"),
    "backward": ("accelerate/accelerator.py", "backward"),
    "clip": ("accelerate/accelerator.py", "clip_grad_norm_"),
    "optimizer": ("accelerate/optimizer.py", "step"),
}


def trl_breakdown(stats: pstats.Stats) -> dict:
    """TRL's GRPOTrainer loop by the same parts: `_generate_and_score_completions` holds generation, prompt
    tokenisation, rewards and the reference (and old-policy) forwards; `_compute_loss` the policy forward."""
    total = cumulative(stats, *TRL_LOOP)
    seconds = {name: cumulative(stats, *where) for name, where in TRL_FUNCTIONS.items()}
    in_loss = seconds["compute_loss"]
    reference = seconds["logps"] - min(in_loss, seconds["logps"])  # the policy's calls are inside _compute_loss
    parts = {
        "rollout: generate (prefill + decode steps)": seconds["generate"],
        "rollout: texts, masks, padding": seconds["score"] - seconds["generate"] - seconds["reward"] - reference,
        "reward": seconds["reward"],
        "reference forward": reference,
        "policy forward + loss": in_loss,
        "policy backward": seconds["backward"],
        "optimizer step": seconds["optimizer"] + seconds["clip"],
    }
    parts["other (loop, Python)"] = total - sum(parts.values())
    return {"loop_s": total, "parts": {label: {"s": s, "share": s / total} for label, s in parts.items()}}


def profile_trl(work: Path, tokenizer: Path, init: dict, args) -> dict | None:
    """benchmarks/trl_grpo.py under cProfile with the python of benchmarks/.venv-trl (made as grpo_vs_trl.py
    makes it); None when that venv cannot be made."""
    from benchmarks.grpo_vs_trl import TRL_VENV, ensure_trl_venv, trl_arguments

    if (why := ensure_trl_venv()) is not None:
        print(f"TRL skipped: {why}")
        return None
    output = work / "trl.pstats"
    command = [str(TRL_VENV / "bin" / "python"), "-m", "cProfile", "-o", str(output)]
    command += trl_arguments(init, tokenizer, args, work / "trl_steps.json")
    environment = child_env(OMP_NUM_THREADS=str(args.threads))  # as grpo_vs_trl.py launches it
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # set by our own rank above
        environment.pop(name, None)
    subprocess.run(command, check=True, env=environment)
    return {**trl_breakdown(pstats.Stats(str(output))), "steps": args.steps}


def markdown(result: dict) -> str:
    lines = ["| part of the loop | share | s |", "|---|---|---|"]
    for label, value in result["parts"].items():
        lines.append(f"| {label} | {value['share'] * 100:.1f}% | {value['s']:.2f} |")
    lines.append(f"| **loop total** ({result['steps']} steps) | 100% | {result['loop_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_functions()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    tokenizer, init = prepare(work, args.size)
    args.rounds, args.warmup = 1, 0
    job_path = astrai_job(work, tokenizer, init, args, "profiled", "astrai")  # (--set rl.share_prefix=true)

    import torch

    torch.set_num_threads(args.threads)
    from astrai.engine import setup_distributed, shutdown_distributed, tune_malloc
    from astrai.launch.environment import apply_environment
    from astrai.launch.job_checks import load_and_check
    from astrai.training.build import build_run
    from astrai.training.loops import train_online

    job = load_and_check(str(job_path), args.set)
    apply_environment(job.runtime.environment)
    dist = setup_distributed(600)
    if job.runtime.tune_malloc:  # as astrai/train.py does: without it every step faults its buffers in again
        tune_malloc()
    torch.set_num_threads(args.threads)  # setup pins threads per rank; profile at the benchmark's count
    run = build_run(job, dist, str(job_path))
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    train_online(run)
    profiler.disable()
    wall = time.perf_counter() - started
    shutdown_distributed()
    stats = pstats.Stats(profiler)
    behaviour = run.strategy.needs_behaviour_logprobs()
    result = {
        **breakdown(stats, behaviour),
        "steps": args.steps,
        "set": args.set,
        "wall_s": wall,
        "machine": machine_line(info),
    }
    table = markdown(result)
    print(table)
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)
    if args.trl and (trl := profile_trl(work, tokenizer, init, args)) is not None:
        result["trl"] = trl
        table += "\n\nTRL GRPOTrainer, same job:\n\n" + markdown(trl)
        print(markdown(trl))
    (results_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (results_dir / f"{args.name}.md").write_text(table + "\n")
    stats.dump_stats(str(work / "profile.pstats"))
    print(f"results in {results_dir / args.name}.json, .md; the profile in {work / 'profile.pstats'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
