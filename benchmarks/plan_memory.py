"""`python -m astrai plan` against the measured peak RSS of real short runs (docs/benchmarks.md).

    .venv/bin/python benchmarks/plan_memory.py [--sizes small,medium,large]

1. the runtime baseline (astrai/launch/memory_plan.py RUNTIME_BASELINE_BYTES): the peak RSS of a real 3-step run of a
   ~5k-parameter model minus its planned components (data, tokenizer, trainer, allocator included); and,
   for comparison, of a process that only imports torch, deepspeed and astrai and starts a gloo group;
2. per size: an `sft` job of a Llama built from `model.init`, 3 steps, launched with the real deepspeed
   launcher; the peak RSS of its largest rank (RUSAGE_CHILDREN of a wrapper process, so earlier runs do
   not count) against the plan's host total for that job (which includes the baseline).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import child_env, deepspeed_launcher, free_port  # noqa: E402


# name: (model.init, ZeRO stage, ranks)
def llama(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
    }


SIZES = {
    "baseline": (llama(16, 32, 1, 2), 0, 1),
    "small": (llama(320, 864, 4, 5), 0, 1),
    "medium": (llama(640, 1728, 6, 10), 2, 2),
    "large": (llama(1024, 2752, 10, 16), 2, 2),
    "large_zero3": (llama(1024, 2752, 10, 16), 3, 2),
}
# The wrapper reports the largest peak RSS (KiB on Linux) of every process it waited for, transitively.
PEAK_OF_CHILDREN = (
    "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
    "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, done.returncode)"
)
BASELINE = (
    "import resource, deepspeed, torch, transformers, datasets; "
    "import astrai.training.build, astrai.training.loops, astrai.strategies, astrai.checkpoint; "
    "import astrai.launch.preflight, astrai.export.hf; "
    "from astrai.engine import setup_distributed; setup_distributed(60); "
    "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 0)"
)


def peak_kib(command: list[str], env: dict) -> int:
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    line = [line for line in done.stdout.splitlines() if line.startswith("PEAK_KIB")]
    if not line or line[-1].split()[2] != "0":
        raise SystemExit(f"{command[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return int(line[-1].split()[1])


def write_job(folder: Path, init: dict, stage: int) -> Path:
    job = {
        "output_dir": str(folder / "run"),
        "model": {
            "init": {
                "model_type": "llama",
                "num_key_value_heads": init["num_attention_heads"],
                "max_position_embeddings": 64,
                "tie_word_embeddings": True,
                **init,
            }
        },
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": str(REPO / "data/arithmetic/sft.jsonl"), "max_seq_len": 64},
        "train": {"train_type": "sft", "max_steps": 3, "micro_batch_size": 4, "lr": 1e-3, "seed": 1},
        "deepspeed": {"config": str(REPO / f"ds_configs/zero{max(stage, 1)}.json"), "zero_stage": stage},
        "checkpoint": {"every_steps": 1000},
        "export": {"on_finish": False},
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def planned(config: Path, ranks: int) -> dict:
    from astrai.config import load_job
    from astrai.launch.memory_plan import make_plan

    return make_plan(load_job(config), str(config), ranks, None).to_json()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(SIZES))
    args = parser.parse_args()
    env = child_env()
    one_rank = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    baseline = peak_kib([sys.executable, "-c", BASELINE], {**env, **one_rank})
    print(f"imports + one-rank gloo group: {baseline / 1024:.0f} MiB peak RSS")
    for name in args.sizes.split(","):
        init, stage, ranks = SIZES[name]
        with tempfile.TemporaryDirectory() as folder:
            config = write_job(Path(folder), init, stage)
            plan = planned(config, ranks)
            launch = deepspeed_launcher() + [f"--num_gpus={ranks}", "--master_port", str(free_port())]
            launch += ["astrai/train.py", "--config", str(config)]
            measured = peak_kib([sys.executable, "-c", PEAK_OF_CHILDREN, *launch], env) * 1024
        ratio = plan["host_total"] / measured
        if name == "baseline":
            from astrai.launch.memory_plan import RUNTIME_BASELINE_BYTES

            components = plan["host_total"] - RUNTIME_BASELINE_BYTES
            print(
                f"runtime baseline: measured {measured / 2**20:.0f} MiB - planned components "
                f"{components / 2**20:.1f} MiB = {(measured - components) / 2**20:.0f} MiB "
                f"(RUNTIME_BASELINE_BYTES: {RUNTIME_BASELINE_BYTES / 2**20:.0f} MiB)"
            )
            continue
        print(
            f"{name}: {plan['policy_parameters'] / 1e6:.1f}M parameters, ZeRO-{plan['zero_stage']}, {ranks} rank(s): "
            f"planned {plan['host_total'] / 2**20:.0f} MiB, measured peak RSS {measured / 2**20:.0f} MiB, "
            f"plan/measured {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
