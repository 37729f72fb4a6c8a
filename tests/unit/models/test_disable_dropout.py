"""`model.disable_dropout`: every dropout probability of the policy, critic and reference is 0 from the
build on, so the forwards of the loops (which keep the trainable engines in train() mode) are deterministic.

Checked by outputs, not by attributes: GPT-2 and OPT apply part of their dropout functionally with a float
copied from the config, which zeroing nn.Dropout modules alone would miss. Then on real one-rank
DeepSpeed runs of a GPT-2 (its config's dropouts are 0.1): grpo's first-minibatch ratio is 1 and its KL
at step 1 is 0, online_ppo's first ratio is 1, DPO's implicit rewards exactly 0 at the first step; with
`model.disable_dropout: false` none of these hold (so the tests can fail).

"Ratio 1" is within fp32 rounding, not bit for bit: the behaviour log-probs come from the rollout's forward
over all 8 sequences and the loss's from a minibatch of 4, and a CPU may pick other matmul blocking for
other batch shapes (an AMD EPYC with AVX-512 differs by 2.4e-7 where an Intel Xeon gives 0). Dropout left
on moves them by more than 1e-3, four orders of magnitude above the 1e-5 allowed. DPO's policy and reference
run the very same forward on the same batch, so its rewards stay exactly 0.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import FalconConfig, GPT2Config, OPTConfig

from astrai.config import load_job
from astrai.config.schema import ModelConfig
from astrai.models.policy import build_policy, disable_dropout
from astrai.models.tokenizer import build_tokenizer
from astrai.models.value import ValueModel, build_value_model, trunk_of
from astrai.rollout.scoring import PlainForward, masked_token_logprobs
from astrai.training.build import build_run
from astrai.training.loops import train_offline, train_online
from tests.conftest import REPO

# fp32 log-probs of a 2-layer model through two batch shapes: a few ulps of |logprob| ~ 3 (~2e-7 each).
SAME_FORWARD_ATOL = 1e-5
GPT2 = "{model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 4, n_positions: 128}"  # dropouts: GPT2Config's 0.1
COMMON = """\
output_dir: {output_dir}
model: {{init: {gpt2}}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
ONLINE = """\
rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 4, behaviour_logprobs: recompute}}
rl: {{kl_coef: 0.1}}
reward: {{function: "tests.unit.strategies.test_ppo_engines:digit_count"}}
train: {{train_type: {train_type}, max_steps: 1, micro_batch_size: 4, lr: 1e-3, lr_schedule: constant,
         warmup_steps: 0, seed: 5}}
"""
DPO = "train: {train_type: dpo, max_steps: 1, micro_batch_size: 4, lr: 1e-3, seed: 5}\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("disable_dropout")
    for name in ("prompts", "preference"):
        lines = (REPO / f"data/arithmetic/{name}.jsonl").read_text().splitlines(keepends=True)[:8]
        (folder / f"{name}.jsonl").write_text("".join(lines))
    return folder


def make_run(dist, folder, name, body, data, *overrides):
    config = folder / f"{name}.yaml"
    config.write_text(COMMON.format(output_dir=folder / name, gpt2=GPT2, data=folder / data) + body)
    return build_run(load_job(config, list(overrides)), dist, str(config))


def first_record(folder, name) -> dict:
    return json.loads((folder / name / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize(
    "config",
    [
        GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=40, bos_token_id=0, eos_token_id=0),
        OPTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            vocab_size=40,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            attention_dropout=0.1,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        ),
        FalconConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=40,
            attention_dropout=0.1,
            hidden_dropout=0.1,
        ),
    ],
    ids=["gpt2", "opt", "falcon"],
)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_model_in_train_mode_gives_the_same_logits_twice(config, attention):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config.__class__(**config.to_dict()), attn_implementation=attention
    ).train()
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout is on to begin with
    assert disable_dropout(model) > 0
    assert model.training and torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert disable_dropout(model) == 0  # nothing left to switch off


@pytest.mark.parametrize("disabled", [True, False])
def test_a_critic_from_critic_path_and_the_policy_are_deterministic_in_train_mode(tmp_path, disabled):
    tokenizer = build_tokenizer("char", ["0123456789+-="])
    settings = ModelConfig.model_validate(
        {
            "init": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
            "disable_dropout": disabled,
        }
    )
    with_dropout = settings.model_copy(update={"disable_dropout": False})
    ValueModel(trunk_of(build_policy(with_dropout, tokenizer, 0))).save_pretrained(tmp_path / "critic")
    ids = torch.randint(0, len(tokenizer), (2, 10), generator=torch.Generator().manual_seed(0))
    policy = build_policy(settings, tokenizer, 0).train()
    critic = build_value_model(settings, tokenizer, 0, critic_path=str(tmp_path / "critic")).train()
    with torch.no_grad():
        assert torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits) == disabled
        hidden = [critic.trunk(input_ids=ids).last_hidden_state for _ in range(2)]  # (the value head is still 0)
        assert torch.equal(*hidden) == disabled
    assert (policy.config.attn_pdrop == 0.0) == disabled


def check_first_ratio(run, checks: list):
    """Wrap the strategy's loss: at its first call, the loss forward's log-probs (the same call, in train()
    mode) against the rollout's behaviour log-probs, recorded as the largest difference."""
    compute_loss, temperature = run.strategy.compute_loss, run.job.rollout.temperature

    def recording(engine, batch, normalizer):
        if not checks:
            logits = PlainForward(temperature).logits(engine, batch)[0]
            logprobs = masked_token_logprobs(logits, batch["response_ids"], batch["response_mask"]).detach()
            checks.append(float((logprobs - batch["behaviour_logprobs"]).abs().max()))
        return compute_loss(engine, batch, normalizer)

    run.strategy.compute_loss = recording


@pytest.mark.parametrize("disabled", [True, False])
def test_grpo_ratio_one_and_kl_zero_at_the_first_step(one_rank, folder, disabled):
    # Two minibatches of 4 sequences: behaviour log-probs recomputed at rollout time, the ratio read by the loss.
    name = f"grpo_{disabled}"
    run = make_run(
        one_rank, folder, name, ONLINE.format(train_type="grpo"), "prompts.jsonl", f"model.disable_dropout={disabled}"
    )
    assert run.strategy.needs_behaviour_logprobs() and run.engines["policy"].module.training
    checks = []
    check_first_ratio(run, checks)
    train_online(run)
    if disabled:
        assert len(checks) == 1 and checks[0] < SAME_FORWARD_ATOL  # ratio 1 up to rounding
    else:
        assert checks[0] > 1e-3
    # One minibatch per step: the only update of step 1 starts at the reference, so k3 is 0 up to rounding:
    # k3(d) = e^d - 1 - d ~ d^2 / 2 for a log-prob difference d of rounding size (< 1e-5), so below 1e-10.
    single = f"grpo_single_{disabled}"
    run = make_run(
        one_rank,
        folder,
        single,
        ONLINE.format(train_type="grpo"),
        "prompts.jsonl",
        f"model.disable_dropout={disabled}",
        "train.grad_accum_steps=2",
    )
    train_online(run)
    kl = first_record(folder, single)["kl"]
    assert 0.0 <= kl < 1e-10 if disabled else kl > 1e-4


@pytest.mark.parametrize("disabled", [True, False])
def test_online_ppo_first_ratio_is_one_and_the_critic_is_deterministic(one_rank, folder, disabled):
    name = f"ppo_{disabled}"
    run = make_run(
        one_rank,
        folder,
        name,
        ONLINE.format(train_type="online_ppo"),
        "prompts.jsonl",
        f"model.disable_dropout={disabled}",
        "critic.warmup_rollouts=0",
    )
    critic = run.engines["critic"]
    ids = torch.randint(1, len(run.tokenizer), (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trunk = critic.module.trunk
        same = torch.equal(trunk(input_ids=ids).last_hidden_state, trunk(input_ids=ids).last_hidden_state)
    assert critic.module.training and same == disabled
    checks = []
    check_first_ratio(run, checks)
    train_online(run)
    assert len(checks) == 1
    assert checks[0] < SAME_FORWARD_ATOL if disabled else checks[0] > 1e-3


@pytest.mark.parametrize("disabled", [True, False])
def test_dpo_rewards_are_zero_at_the_first_step(one_rank, folder, disabled):
    name = f"dpo_{disabled}"
    run = make_run(one_rank, folder, name, DPO, "preference.jsonl", f"model.disable_dropout={disabled}")
    train_offline(run)
    record = first_record(folder, name)
    rewards = (record["rewards_chosen"], record["rewards_rejected"], record["reward_margin"])
    if disabled:
        assert rewards == (0.0, 0.0, 0.0) and record["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)  # log 2
    else:
        assert all(reward != 0.0 for reward in rewards)
