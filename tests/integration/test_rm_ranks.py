"""`rm` on 2 real gloo ranks: the reward model learns its pairs; ZeRO-0/1/2/3 agree; resume is exact, and
continues on another ZeRO stage; the export is a plain transformers sequence classifier that scores as the
checkpoint does and records the reward's statistics over the training pairs; `rm.share_prefix` trains as the
plain forward does under ZeRO-3; online_ppo takes the export as `reward.model_path` (with
`reward.normalize: stored`) and as `critic.path`.

ONE launch runs everything (a launch costs 10-20 s of imports): a short SFT of a tiny Llama on shipped
arithmetic chats, exported on finish; every rm job starts from that export (its trunk, its tokenizer),
on 16 pairs made from the shipped preference pairs. Tolerances as tests/integration/test_train_ranks.py
(CPU fp32: ZeRO stages differ in reduction order only, 1e-4 relative) and test_topology_ranks.py (another
stage: 1e-5).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from astrai.checkpoint import verify_checkpoint
from tests.conftest import REPO
from tests.integration.plan import arithmetic_sft_run, launch_plan, metrics

pytestmark = pytest.mark.slow
STEP4, STEP12 = "checkpoints/step_00000004", "checkpoints/step_00000012"
PAIRS = 16
MARGIN = 0.5

RM_JOB = """\
output_dir: {folder}/{name}
model: {{path: {folder}/sft_hf}}
data: {{path: {folder}/pairs.jsonl, max_seq_len: 32}}
train: {{train_type: rm, max_steps: 12, micro_batch_size: 4, lr: 1e-3, max_grad_norm: 1.0, lr_schedule: constant,
        warmup_steps: 0, seed: 7}}
deepspeed: {{zero_stage: 2}}
checkpoint: {{every_steps: 4}}
runtime: {{progress_bar: false, tensorboard: false}}
"""

PPO_JOB = """\
output_dir: {folder}/ppo_from_rm
model: {{path: {folder}/sft_hf}}
data: {{path: {folder}/prompts.jsonl, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 4, max_new_tokens: 4}}
reward: {{model_path: {folder}/rm_z2/hf, normalize: stored}}
critic: {{path: {folder}/rm_z2/hf}}
train: {{train_type: online_ppo, max_steps: 2, micro_batch_size: 8, lr: 5e-4, seed: 7}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rm_ranks")
    lines = (REPO / "data/arithmetic/preference.jsonl").read_text().splitlines()[:PAIRS]
    # A feature a tiny model finds in a few steps (the rejected answer is the chosen one written twice), so
    # that 12 steps show learning; whether a reward model learns arithmetic is the quickstart's measurement.
    rows = [dict(json.loads(line), margin=MARGIN) for line in lines]
    rows = [dict(row, rejected=row["chosen"] * 2) for row in rows]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = [arithmetic_sft_run(folder) | {"set": ["train.max_steps=40"]}]

    def add(name, *sets, **extra):
        (folder / f"{name}.yaml").write_text(RM_JOB.format(folder=folder, name=name))
        runs.append({"name": name, "config": str(folder / f"{name}.yaml"), "set": list(sets), **extra})

    add("rm_z2", "export.on_finish=true")
    add("rm_z3", "deepspeed.zero_stage=3")
    add("rm_z1", "deepspeed.zero_stage=1", "train.max_steps=3")
    add("rm_z0", "deepspeed.zero_stage=0", "train.max_steps=3")
    add("rm_resume", f"checkpoint.resume={folder / 'rm_z2' / STEP4}")
    add("rm_to_z3", f"checkpoint.resume={folder / 'rm_z2' / STEP4}", "deepspeed.zero_stage=3")
    add("rm_margin", "rm.margin_field=margin", "rm.center_rewards_coef=0.01", "train.max_steps=2")
    add("rm_prefix_z3", "rm.share_prefix=true", "deepspeed.zero_stage=3")
    (folder / "ppo_from_rm.yaml").write_text(PPO_JOB.format(folder=folder))
    runs.append({"name": "ppo_from_rm", "config": str(folder / "ppo_from_rm.yaml")})
    return folder, rows, launch_plan(folder, runs)


def compare(folder, name, reference, steps, rel, fields=("loss", "accuracy", "margin", "chosen_reward")):
    records = {record["step"]: record for record in metrics(folder, name)}
    expected = {record["step"]: record for record in metrics(folder, reference)}
    assert sorted(records) == list(steps)
    for field in fields:
        assert [records[step][field] for step in steps] == pytest.approx(
            [expected[step][field] for step in steps], rel=rel, abs=1e-6
        ), field


def test_every_run_finishes(trained):
    _, _, results = trained
    for name, result in results.items():
        assert result["ok"], (name, result)


def test_the_reward_model_learns_its_pairs(trained):
    folder, _, _ = trained
    records = metrics(folder, "rm_z2")
    assert set(records[0]) >= {"loss", "accuracy", "chosen_reward", "rejected_reward", "margin", "lr", "grad_norm"}
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # zero-initialised head: every reward 0
    assert records[0]["accuracy"] == 0.0 and records[0]["margin"] == 0.0
    last = records[-4:]
    assert sum(record["loss"] for record in last) / 4 < 0.8 * math.log(2)  # measured: 0.51
    assert sum(record["accuracy"] for record in last) / 4 >= 0.9
    assert all(record["margin"] > 0 for record in last)


@pytest.mark.parametrize("name, steps", [("rm_z0", range(1, 4)), ("rm_z1", range(1, 4)), ("rm_z3", range(1, 13))])
def test_zero_stages_agree(trained, name, steps):
    compare(trained[0], name, "rm_z2", steps, rel=1e-4)


def test_the_shared_prompt_forward_trains_as_the_plain_one_under_zero3(trained):
    """rm.share_prefix: two forwards a micro-batch on every rank (the prompts, then the completions against their
    keys and values), partitioned parameters gathered for each; the run follows the plain ZeRO-3 run."""
    compare(trained[0], "rm_prefix_z3", "rm_z3", range(1, 13), rel=1e-5)


def test_resume_is_exact_and_continues_on_another_stage(trained):
    folder, _, _ = trained
    compare(folder, "rm_resume", "rm_z2", range(5, 13), rel=1e-6)
    compare(folder, "rm_to_z3", "rm_z2", range(5, 13), rel=1e-5)
    manifest = json.loads((folder / "rm_to_z3" / STEP12 / "manifest.json").read_text())
    assert manifest["meta"]["zero_stage"] == {"policy": 3}


def test_margin_and_centring_enter_the_loss(trained):
    folder, _, _ = trained
    first = metrics(folder, "rm_margin")[0]
    # every reward 0 at step 1: -log sigmoid(0 - 0.5) = log(1 + e^0.5), the centring term (0 + 0)^2 = 0
    assert first["loss"] == pytest.approx(math.log(1 + math.exp(MARGIN)), abs=1e-6)
    assert first["margin"] == 0.0  # the model's separation, without the data's margin


def checkpoint_scores(folder, sequences):
    """The rewards of step 12's consolidated weights in the module rm trained (no export involved)."""
    from transformers import AutoModelForCausalLM

    from astrai.data.collate import pad_right
    from astrai.engine import consolidated_state_dict
    from astrai.models.reward import RewardModel
    from astrai.models.tokenizer import load_tokenizer
    from astrai.models.value import trunk_of

    tokenizer = load_tokenizer(str(folder / "sft_hf"))
    model = RewardModel(trunk_of(AutoModelForCausalLM.from_pretrained(folder / "sft_hf")), tokenizer.pad_token_id)
    model.load_state_dict(consolidated_state_dict(folder / "rm_z2" / STEP12 / "policy"))
    with torch.no_grad():
        ids = pad_right(sequences, tokenizer.pad_token_id)
        return model.eval()(ids, pad_right([[1] * len(s) for s in sequences], 0))


def test_the_export_scores_as_the_checkpoint_and_records_its_statistics(trained):
    from transformers import AutoModelForSequenceClassification

    from astrai.config.schema import RewardConfig
    from astrai.rollout.rewards import build_reward

    folder, rows, _ = trained
    export = folder / "rm_z2" / "hf"
    verify_checkpoint(folder / "rm_z2" / STEP12)
    classifier = AutoModelForSequenceClassification.from_pretrained(export)  # plain transformers
    assert classifier.config.num_labels == 1 and classifier.config.pad_token_id is not None
    reward = build_reward(RewardConfig(model_path=str(export), batch_size=5), torch.device("cpu"))
    inputs = {
        "messages": [[{"role": "user", "content": row["prompt"]}] for row in rows] * 2,
        "responses": [row["chosen"] for row in rows] + [row["rejected"] for row in rows],
        "prompts": [""] * (2 * len(rows)),
    }
    scored = reward(inputs).total
    texts = [
        reward.sources[0][0].tokenizer(text, add_special_tokens=False)["input_ids"]
        for text in reward.sources[0][0].texts(inputs)
    ]
    assert (scored - checkpoint_scores(folder, texts)).abs().max() <= 1e-4
    assert float((scored[:PAIRS] > scored[PAIRS:]).float().mean()) >= 0.9  # it prefers the right answers
    stats = json.loads((export / "reward_stats.json").read_text())
    assert stats["pairs"] == PAIRS
    assert stats["mean"] == pytest.approx(float(scored.double().mean()), abs=1e-5)
    assert stats["std"] == pytest.approx(float(scored.double().std()), abs=1e-5)


def test_online_ppo_takes_the_export_as_reward_and_critic(trained):
    folder, _, results = trained
    assert results["ppo_from_rm"]["step"] == 2
    first = metrics(folder, "ppo_from_rm")[0]
    # the critic starts from the reward model's head, not at zero, so it explains some variance at once
    assert first["values_mean"] != 0.0
