"""`model.router_aux_loss_coef`: a mixture-of-experts policy (a tiny Qwen2-MoE built from config) trains with
its router's load-balancing loss in every train type, as transformers' own loss with labels does.

- seq: the strategy's loss equals transformers' `loss` with labels (cross-entropy + coef x aux_loss), with
  the model config's coefficient (null) or one set in the job; 0 turns it off; the router's gradient
  moves by exactly coef x the gradient of aux_loss.
- dpo, grpo, online_ppo: the loss with the term minus the loss without it is coef x aux_loss x units /
  normalizer (the micro-batch's share of the step), and `router_aux_loss` is in the metric sums.
- a dense model with a coefficient is refused when it is built; one-rank DeepSpeed runs of sft and grpo
  log `router_aux_loss`.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from astrai.config import load_job
from astrai.config.schema import JobConfig
from astrai.models.policy import ModelError, build_policy, router_aux_loss_coef
from astrai.models.tokenizer import build_tokenizer
from astrai.rollout.sequences import join_sequences
from astrai.strategies import strategy_class
from astrai.training.build import build_run
from astrai.training.loops import train_offline, train_online
from tests.conftest import REPO

ROUTER = "model.layers.0.mlp.gate.weight"
MOE = dict(
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("char", ["0123456789+-= abc\n"])


def moe_model(tokenizer, coef: float = 0.001) -> Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), router_aux_loss_coef=coef, pad_token_id=tokenizer.pad_token_id, **MOE
    )
    return Qwen2MoeForCausalLM(config)


def job(train_type: str, coef: float | None, **sections) -> JobConfig:
    raw = {
        "output_dir": "/tmp/unused",
        "model": {"init": {"model_type": "qwen2_moe"}, "router_aux_loss_coef": coef},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": "unused.jsonl"},
        "train": {"train_type": train_type, "max_steps": 1, "micro_batch_size": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2},
        "reward": {"function": "astrai.rollout.rewards:arithmetic_exact_match"},
    }
    if train_type not in ("grpo", "online_ppo"):
        raw.pop("rollout"), raw.pop("reward")
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return JobConfig.model_validate(raw)


def router_gradient(model, loss) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return dict(model.named_parameters())[ROUTER].grad.clone()


@pytest.mark.parametrize("coef", [None, 0.5])
def test_seq_loss_is_transformers_loss_with_labels(tokenizer, coef):
    model = moe_model(tokenizer, coef=0.001 if coef is None else coef)
    ids = torch.randint(4, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    strategy = strategy_class("seq")(job("seq", coef), tokenizer)
    weight = strategy.loss_weight(batch)
    output = strategy.compute_loss(model, batch, normalizer=float(weight))
    reference = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids, output_router_logits=True)
    assert torch.allclose(output.loss, reference.loss, atol=1e-6)
    assert output.sums["router_aux_loss"] == pytest.approx(float(reference.aux_loss.detach()) * weight, rel=1e-6)
    assert output.sums["loss"] / weight == pytest.approx(
        float((reference.loss - model.router_aux_loss_coef * reference.aux_loss).detach()), rel=1e-5
    )
    # 0 turns it off: the cross-entropy alone, no metric; the router's gradient differs by coef x d aux / d router.
    off = strategy_class("seq")(job("seq", 0.0), tokenizer).compute_loss(model, batch, normalizer=float(weight))
    assert "router_aux_loss" not in off.sums and torch.allclose(
        off.loss, output.loss - model.router_aux_loss_coef * reference.aux_loss
    )
    aux = model(input_ids=ids, attention_mask=batch["attention_mask"], output_router_logits=True).aux_loss
    with_term, without, of_aux = (
        router_gradient(model, output.loss),
        router_gradient(model, off.loss),
        router_gradient(model, aux),
    )
    assert of_aux.abs().sum() > 0 and torch.allclose(
        with_term - without, model.router_aux_loss_coef * of_aux, atol=1e-7
    )


def test_a_dense_model_refuses_a_coefficient_and_resolves_to_zero(tokenizer):
    dense = job(
        "seq",
        0.01,
        model={
            "init": {
                "model_type": "llama",
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        },
    )
    with pytest.raises(
        ModelError, match="model.router_aux_loss_coef: LlamaForCausalLM has no mixture-of-experts router"
    ):
        build_policy(dense.model, tokenizer, 0)
    model = build_policy(dense.model.model_copy(update={"router_aux_loss_coef": None}), tokenizer, 0)
    assert (
        router_aux_loss_coef(None, model) == 0.0 and strategy_class("seq")(dense, tokenizer).router_options(model) == {}
    )
    assert (
        router_aux_loss_coef(None, moe_model(tokenizer, 0.02)) == 0.02
        and router_aux_loss_coef(0.0, moe_model(tokenizer)) == 0.0
    )


def online_batch(tokenizer):
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(4, len(tokenizer), (4, 5), generator=generator)
    responses = torch.randint(4, len(tokenizer), (4, 6), generator=generator)
    response_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [1] * 2 + [0] * 4])
    batch = join_sequences(prompts, torch.ones_like(prompts), responses, response_mask)
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return batch


@pytest.mark.parametrize("train_type", ["dpo", "grpo", "online_ppo"])
def test_every_train_type_adds_coef_times_aux_scaled_like_its_loss(tokenizer, train_type):
    model = moe_model(tokenizer)
    if train_type == "dpo":
        ids = torch.randint(4, len(tokenizer), (4, 8), generator=torch.Generator().manual_seed(3))
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.tensor([[0] * 4 + [1] * 4] * 4),
            "reference_logps": torch.tensor([-9.0, -8.0, -10.0, -7.0]),
        }
    else:
        batch = online_batch(tokenizer)
        batch["behaviour_logprobs"] = torch.zeros(4, 6)
        if train_type == "online_ppo":
            batch["advantages"] = batch["advantages"][:, None].expand(4, 6).clone()

    def loss_with(coef):
        strategy = strategy_class(train_type)(job(train_type, coef), tokenizer)
        strategy.reference, strategy.loss_kl_coef = None, 0.0
        units = strategy.loss_weight(batch)
        return strategy.compute_loss(model, batch, normalizer=3.0 * units), units

    (on, units), (off, _) = loss_with(0.25), loss_with(0.0)
    aux = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
    ).aux_loss
    assert torch.allclose(on.loss - off.loss, 0.25 * aux / 3.0, atol=1e-6)  # units / normalizer = 1 / 3
    metric_units = units if train_type == "dpo" else float(batch["response_mask"].sum())
    assert (
        on.sums["router_aux_loss"] == pytest.approx(float(aux.detach()) * metric_units, rel=1e-6)
        and "router_aux_loss" not in off.sums
    )
    assert on.sums["loss"] == pytest.approx(off.sums["loss"], rel=1e-6)  # the logged loss is the train type's own


RUN = """\
output_dir: {output_dir}
model:
  init: {{model_type: qwen2_moe, hidden_size: 32, intermediate_size: 32, moe_intermediate_size: 16,
          shared_expert_intermediate_size: 16,
          num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, num_experts: 4, num_experts_per_tok: 2,
          max_position_embeddings: 64}}
  router_aux_loss_coef: 0.1
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 4}}
reward: {{function: "tests.unit.strategies.test_ppo_engines:digit_count"}}
train: {{train_type: {train_type}, max_steps: 2, micro_batch_size: 4, grad_accum_steps: 2, lr: 1e-3, warmup_steps: 0,
         seed: 5}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def router_weight(engine) -> torch.Tensor:
    with engine.gathered_parameters():  # whole under ZeRO-3
        return dict(engine.module.named_parameters())[ROUTER].detach().clone()


@pytest.mark.parametrize(("train_type", "data", "zero_stage"), [("sft", "sft.jsonl", 3), ("grpo", "prompts.jsonl", 0)])
def test_deepspeed_runs_log_router_aux_loss(one_rank, tmp_path, train_type, data, zero_stage):
    lines = (REPO / f"data/arithmetic/{data}").read_text().splitlines(keepends=True)[:16]
    (tmp_path / data).write_text("".join(lines))
    config = tmp_path / "job.yaml"
    config.write_text(RUN.format(output_dir=tmp_path / "out", data=tmp_path / data, train_type=train_type))
    run = build_run(load_job(config, [f"deepspeed.zero_stage={zero_stage}"]), one_rank, str(config))
    policy = run.engines["policy"]
    before = router_weight(policy)
    (train_offline if train_type == "sft" else train_online)(run)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(
        record["router_aux_loss"] > 0 for record in records
    )  # top_k (2) when perfectly balanced
    assert not torch.equal(router_weight(policy), before)  # the router trained


def test_a_lora_policy_keeps_its_router_loss(tokenizer):
    """PEFT's wrapper takes **kwargs: whether the policy routes tokens is its base model's forward."""
    from astrai.config.schema import LoraSection
    from astrai.models.lora import apply_lora
    from astrai.models.policy import routes_tokens

    wrapped = apply_lora(moe_model(tokenizer), LoraSection(r=2), {"path": "test", "hash": ""})
    assert routes_tokens(wrapped) and router_aux_loss_coef(None, wrapped) == 0.001
    ids = torch.tensor([[3, 4, 5, 6]])
    output = wrapped(input_ids=ids, attention_mask=torch.ones_like(ids), output_router_logits=True)
    assert output.aux_loss is not None and output.aux_loss > 0
