"""Eval on 2 real gloo ranks reports the figures of 1 rank, all under ZeRO-3: sft and dpo (every eval forward a
collective; 5 eval rows, so one rank runs a padding forward) and grpo (greedy and sampled answers, pass@k, from
one gathered copy of the policy per eval).

The 2-rank runs share ONE launch (run_plan.py); the 1-rank runs are the same jobs in this process. The step-0
evals (`eval.at_start`) measure the same starting weights on both, so they agree up to the order of the float
sums; sft also trains the same global batch (2 ranks x 2 = 1 rank x 4), so its last eval agrees too.
"""

from __future__ import annotations

import pytest

from astrai.launch.job_checks import load_and_check
from astrai.training.build import build_run
from astrai.training.loops import TRAIN_LOOPS
from tests.conftest import REPO
from tests.integration.plan import launch_plan, metrics

pytestmark = pytest.mark.slow

JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
train: {{train_type: {train_type}, max_steps: 3, micro_batch_size: {micro}, lr: 5e-3, lr_schedule: constant, seed: 7}}
deepspeed: {{zero_stage: {stage}}}
checkpoint: {{resume: never}}
eval: {{data_path: {eval_data}, at_start: true, pass_k: 2, samples_per_prompt: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
ONLINE = """\
rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 4}
reward: {function: "tests.unit.eval.test_eval:length_reward"}
"""
DATA = {"sft": "sft", "dpo": "preference", "grpo": "prompts"}


def write(folder, name, train_type, ranks):
    data = folder / f"{DATA[train_type]}.jsonl"
    micro = 4 // ranks if train_type == "sft" else 2
    text = JOB.format(
        output_dir=folder / name,
        data=data,
        train_type=train_type,
        micro=micro,
        stage=3,
        eval_data=folder / f"{DATA[train_type]}_eval.jsonl",
    )
    path = folder / f"{name}.yaml"
    path.write_text(text + (ONLINE if train_type == "grpo" else ""))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_rank):
    folder = tmp_path_factory.mktemp("eval_ranks")
    for name in DATA.values():
        lines = (REPO / f"data/arithmetic/{name}.jsonl").read_text().splitlines(keepends=True)
        (folder / f"{name}.jsonl").write_text("".join(lines[:32]))
        (folder / f"{name}_eval.jsonl").write_text("".join(lines[100:105]))  # 5: odd, one rank pads
    plan = [{"name": f"{kind}_2", "config": write(folder, f"{kind}_2", kind, 2)} for kind in DATA]
    results = launch_plan(folder, plan, ranks=2)
    assert all(result["ok"] for result in results.values()), results
    for kind in DATA:
        config = write(folder, f"{kind}_1", kind, 1)
        run = build_run(load_and_check(config, []), one_rank, config)
        TRAIN_LOOPS[run.strategy.loop](run)
    return folder


def evals(folder, name):
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in metrics(folder, name) if "eval_s" in r
    }


@pytest.mark.parametrize("kind", list(DATA))
def test_two_ranks_report_the_eval_figures_of_one(runs, kind):
    one, two = evals(runs, f"{kind}_1"), evals(runs, f"{kind}_2")
    assert sorted(one) == sorted(two) == [0, 3]
    assert one[0].keys() == two[0].keys() and len(one[0]) >= 2
    for key, value in one[0].items():
        assert two[0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    if kind == "sft":
        for key, value in one[3].items():
            assert two[3][key] == pytest.approx(value, rel=1e-4), key


def test_eval_samples_are_written_once_by_rank_0(runs):
    lines = (runs / "grpo_2" / "eval_samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 3  # steps 0 and 3; rank 0's prompts 0, 2, 4
