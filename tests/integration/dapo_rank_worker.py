"""`run_plan.py` with the grpo strategy instrumented for tests/integration/test_dapo_ranks.py: each rank appends
to <output_dir>/dapo_rank<r>.jsonl what it drew in every sampling round, the groups it trained on in every
step, and the shape of its minibatches. The instrumentation only records; the real methods run unchanged.

    deepspeed --num_gpus 2 tests/integration/dapo_rank_worker.py --plan plan.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from astrai.strategies.grpo import GrpoStrategy  # noqa: E402
from tests.integration import run_plan  # noqa: E402


def record(strategy, entry: dict) -> None:
    path = os.path.join(strategy.job.output_dir, f"dapo_rank{strategy.dist.rank}.jsonl")
    with open(path, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def instrument() -> None:
    rollout, sample, minibatches = GrpoStrategy.rollout, GrpoStrategy.sample, GrpoStrategy.minibatches

    def recorded_rollout(self, policy, examples, *, step, policy_version, sampling_round=0):
        result = rollout(
            self, policy, examples, step=step, policy_version=policy_version, sampling_round=sampling_round
        )
        ids = [json.loads(example["row"])["id"] for example in examples]
        record(self, {"kind": "round", "step": step, "round": sampling_round, "ids": ids})
        return result

    def recorded_sample(self, policy, prompt_batches, *, step, policy_version):
        result = sample(self, policy, prompt_batches, step=step, policy_version=policy_version)
        rollout = result.rollout
        record(
            self,
            {
                "kind": "step",
                "step": step,
                "ids": [row["id"] for row in rollout.rows],
                "responses": rollout.response_texts,
                "rewards": rollout.rewards.tolist(),
                "group_size": rollout.group_size,
                "prompts_drawn": result.prompts_drawn,
            },
        )
        return result

    def recorded_minibatches(self, targets, *, step, epoch):
        for micro_batches in minibatches(self, targets, step=step, epoch=epoch):
            sizes = [int(batch["input_ids"].shape[0]) for batch in micro_batches]
            record(self, {"kind": "minibatch", "step": step, "micro_batches": sizes})
            yield micro_batches

    GrpoStrategy.rollout, GrpoStrategy.sample = recorded_rollout, recorded_sample
    GrpoStrategy.minibatches = recorded_minibatches


if __name__ == "__main__":
    instrument()
    sys.exit(run_plan.main())
