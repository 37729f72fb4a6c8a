"""online_ppo without DeepSpeed: the ValueModel critic (zero head, trunk parity, folder layout, the policy
class untouched), frozen targets pinned in PPOTargets (not on the rollout) and unchanged across replay epochs, the
losses by hand, dual-clip and the entropy bonus through compute_loss, advantage whitening, KL in the reward or
the loss, the adaptive KL coefficient, reward preprocessing, config."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel

from astrai.algos import FixedKLController, compute_gae, kl_shaped_rewards, masked_whiten, ppo_policy_loss
from astrai.config.schema import JobConfig, ModelConfig
from astrai.engine import DistInfo
from astrai.models.policy import build_policy
from astrai.models.value import ValueModel, build_value_model, load_value_model, trunk_of
from astrai.rollout.generation import generate_rollout
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.rewards import WeightedReward
from astrai.rollout.scoring import PlainForward, batches_of
from astrai.strategies.online_base import batch_geometry
from astrai.strategies.ppo import PPOStrategy
from astrai.training.step_metrics import online_record
from tests.unit.rollout_fixtures import (
    LLAMA_INIT,
    LengthReward,
    PlainEngine,
    behaviour_scoring,
    online_job,
    tiny_model,
    tiny_tokenizer,
)

TINY = LLAMA_INIT


def job(**sections) -> JobConfig:
    return online_job("online_ppo", TINY, **sections)


def ppo_with(config: JobConfig, tokenizer, critic: ValueModel, reference=None) -> PPOStrategy:
    """A PPOStrategy set up by hand: what `setup` builds, minus DeepSpeed (one rank)."""
    strategy = PPOStrategy(config, tokenizer)
    strategy.geometry = batch_geometry(config, 1)
    strategy.dist = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    strategy.reward = WeightedReward([(LengthReward(), 1.0)])
    strategy.reference = PlainEngine(reference) if reference is not None else None
    strategy.critic = PlainEngine(critic)
    strategy.kl_controller = FixedKLController(config.rl.kl_coef)
    strategy.loss_kl_coef = config.rl.kl_coef
    return strategy


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def rollout_and_models(tokenizer):
    policy = tiny_model(tokenizer, seed=0)
    reference = tiny_model(tokenizer, seed=1)  # differs from the policy: the KL is not 0
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    settings = job().rollout
    result = generate_rollout(
        PlainEngine(policy),
        tokenizer,
        Prompts(prompts, chats, [{}, {}]),
        settings,
        seed=3,
        scoring=behaviour_scoring(settings, tokenizer, 2),
    )
    return result, policy, reference


def fresh_critic(policy) -> ValueModel:
    return ValueModel(trunk_of(copy.deepcopy(policy)))


# ----------------------------------------------------------------------------- the critic model


def test_warm_start_head_is_zero_and_trunk_equals_the_policy(tokenizer):
    model_config = ModelConfig(init=TINY)
    policy = build_policy(model_config, tokenizer, seed=11)
    critic = build_value_model(model_config, tokenizer, seed=11)
    ids = torch.randint(1, len(tokenizer), (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=mask)
        policy_hidden = policy.model(input_ids=ids, attention_mask=mask).last_hidden_state
        critic_hidden = critic.trunk(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (
        values.shape == (3, 9) and values.dtype == torch.float32 and torch.equal(values, torch.zeros(3, 9))
    )  # exactly 0
    assert torch.equal(policy_hidden, critic_hidden)  # trunk parity: same weights, same hidden states
    assert torch.count_nonzero(critic.value_head.weight) == 0 and torch.count_nonzero(critic.value_head.bias) == 0
    assert not any("lm_head" in name for name in critic.state_dict())


def test_the_policy_class_is_unchanged(tokenizer):
    forward = LlamaForCausalLM.forward
    policy = build_policy(ModelConfig(init=TINY), tokenizer, seed=11)
    build_value_model(ModelConfig(init=TINY), tokenizer, seed=11)
    assert type(policy) is LlamaForCausalLM and LlamaForCausalLM.forward is forward
    assert not hasattr(policy, "value_head") and set(policy.state_dict()) == set(
        LlamaForCausalLM(policy.config).state_dict()
    )
    assert not issubclass(ValueModel, PreTrainedModel) and ValueModel.__bases__ == (torch.nn.Module,)


def test_critic_folder_round_trip(tmp_path, tokenizer):
    policy = tiny_model(tokenizer, seed=2)
    critic = fresh_critic(policy)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(0))
    critic.value_head.bias.data.fill_(0.25)
    critic.save_pretrained(tmp_path / "critic")
    assert {"config.json", "model.safetensors", "value_head.safetensors", "value_head.json"} <= {
        p.name for p in (tmp_path / "critic").iterdir()
    }
    loaded = load_value_model(tmp_path / "critic")
    ids = torch.randint(1, len(tokenizer), (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids), critic(input_ids=ids), atol=1e-6)
    # A causal LM folder gives its trunk and a zero head.
    policy.save_pretrained(tmp_path / "policy")
    from_lm = load_value_model(tmp_path / "policy")
    assert torch.count_nonzero(from_lm.value_head.weight) == 0
    with torch.no_grad():
        assert torch.allclose(
            from_lm.trunk(input_ids=ids).last_hidden_state, policy.model(input_ids=ids).last_hidden_state, atol=1e-6
        )
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "policy")) is LlamaForCausalLM


# ----------------------------------------------------------------------------- frozen targets


def test_frozen_targets_are_pinned_on_the_targets(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    result = copy.copy(result)
    config = job(rl={"kl_coef": 0.1, "gamma": 0.9, "gae_lambda": 0.8, "whiten_advantages": False, "kl_estimator": "k3"})
    strategy = ppo_with(config, tokenizer, fresh_critic(policy), reference)
    targets = strategy.frozen_targets(result)
    mask = targets["response_mask"]
    assert torch.equal(targets["values"], torch.zeros_like(targets["values"]))  # zero head: every first value is 0
    assert not hasattr(result, "values") and not hasattr(result, "advantages")  # the rollout knows generation only
    ref = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(reference, targets)
    kl = torch.where(mask.bool(), torch.expm1(ref - result.behaviour_logprobs) - (ref - result.behaviour_logprobs), 0.0)
    assert torch.allclose(targets.kl, kl, atol=1e-6) and (targets.kl[mask.bool()] > 0).all()
    rewards = kl_shaped_rewards(result.rewards, kl, mask, 0.1)
    advantages, returns = compute_gae(rewards, torch.zeros_like(rewards), mask, 0.9, 0.8)
    assert torch.allclose(targets["advantages"], advantages, atol=1e-6) and torch.allclose(
        targets["returns"], returns, atol=1e-6
    )
    record = online_record({**result.metric_sums(), **targets.metric_sums()})
    assert (
        record["explained_variance"] == 0.0 and record["values_mean"] == 0.0 and record["kl_coef"] == pytest.approx(0.1)
    )
    assert record["kl"] == pytest.approx(float(kl[mask.bool()].mean()), rel=1e-5)
    assert "reference_logprobs" not in targets  # the KL is in the reward, not the loss


def test_replay_epochs_read_the_same_pinned_targets_while_the_critic_learns(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    critic, model = fresh_critic(policy), copy.deepcopy(policy)
    strategy = ppo_with(job(rl={"kl_coef": 0.0}), tokenizer, critic)
    targets = strategy.frozen_targets(copy.copy(result))
    targets["row"] = torch.arange(targets["input_ids"].shape[0])
    pinned = {key: targets[key].clone() for key in ("advantages", "returns", "values")}
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.5)
    policy_optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(3):
        seen = {}
        for micro_batches in strategy.minibatches(targets, step=1, epoch=epoch):
            for batch in micro_batches:
                strategy.compute_critic_loss(
                    PlainEngine(critic), batch, float(batch["response_mask"].sum())
                ).loss.backward()
                strategy.compute_loss(PlainEngine(model), batch, float(batch["response_mask"].sum())).loss.backward()
                for index, row in enumerate(batch["row"].tolist()):
                    seen[row] = {key: batch[key][index] for key in pinned}
            critic_optimizer.step(), critic_optimizer.zero_grad(), policy_optimizer.step(), policy_optimizer.zero_grad()
        assert sorted(seen) == list(range(8))
        for key, tensor in pinned.items():
            assert torch.equal(torch.stack([seen[row][key] for row in range(8)]), tensor), (epoch, key)
    moved = strategy.frozen_targets(copy.copy(result))["values"]  # recomputing now WOULD give other targets
    assert not torch.allclose(moved, pinned["values"])
    assert torch.equal(targets["advantages"], pinned["advantages"])


# ----------------------------------------------------------------------------- losses


def test_losses_at_the_behaviour_weights_by_hand(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    strategy = ppo_with(job(rl={"kl_coef": 0.0, "vf_coef": 0.5}), tokenizer, fresh_critic(policy))
    targets = strategy.frozen_targets(copy.copy(result))
    mask = targets["response_mask"].bool()
    tokens = float(mask.sum())
    output = strategy.compute_loss(PlainEngine(policy), targets, normalizer=tokens)
    # ratio == 1: loss = -sum_t A_t / T, nothing clipped, approx_kl 0
    assert output.loss.item() == pytest.approx(-targets["advantages"][mask].sum().item() / tokens, abs=1e-6)
    assert (
        output.sums["clip_frac"] == 0.0
        and output.sums["approx_kl"] == pytest.approx(0.0, abs=1e-6)
        and output.sums["entropy"] > 0
    )
    critic_output = strategy.compute_critic_loss(PlainEngine(fresh_critic(policy)), targets, normalizer=tokens)
    squared = 0.5 * (targets["returns"][mask] ** 2).mean()  # values are 0
    assert critic_output.loss.item() == pytest.approx(0.5 * squared.item(), rel=1e-5)  # times vf_coef
    assert critic_output.sums["value_loss"] / tokens == pytest.approx(squared.item(), rel=1e-5)  # logged before vf_coef
    assert critic_output.sums["value_clip_frac"] == 0.0


def test_whitened_advantages_are_the_masked_whitening_of_raw_gae_while_returns_keep_the_raw_ones(
    tokenizer, rollout_and_models
):
    result, policy, _ = rollout_and_models
    critic = fresh_critic(policy)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(4))
    critic.value_head.bias.data.fill_(0.3)  # nonzero values: returns = raw advantages + values tells them apart
    strategy = ppo_with(
        job(rl={"kl_coef": 0.0, "gamma": 0.9, "gae_lambda": 0.8, "whiten_advantages": True}), tokenizer, critic
    )
    targets = strategy.frozen_targets(copy.copy(result))
    mask = targets["response_mask"]
    values = targets["values"]
    assert values[mask.bool()].abs().min() > 0
    rewards = kl_shaped_rewards(torch.tensor(strategy_rewards(result)), torch.zeros_like(values), mask, 0.0)
    raw_advantages, raw_returns = compute_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(targets["advantages"], masked_whiten(raw_advantages, mask), atol=1e-5)
    assert torch.allclose(targets["returns"], raw_returns, atol=1e-5) and torch.allclose(
        raw_returns, raw_advantages + values * mask, atol=1e-6
    )
    assert not torch.allclose(
        targets["returns"], targets["advantages"] + values * mask, atol=1e-2
    )  # not the whitened ones
    whitened = targets["advantages"][mask.bool()]
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-5) and whitened.std().item() == pytest.approx(
        1.0, abs=1e-3
    )


def test_dual_clip_through_the_strategy_matches_the_pure_loss(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    strategy = ppo_with(job(rl={"kl_coef": 0.0, "dual_clip_c": 3.0}), tokenizer, fresh_critic(policy))
    batch = dict(strategy.frozen_targets(copy.copy(result)))
    mask = batch["response_mask"]
    generator = torch.Generator().manual_seed(5)
    current = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(policy, batch)
    # Behaviour log-probs 0..3 nats below the current ones: ratios 1..20, so the dual clip binds on negative advantages.
    batch["behaviour_logprobs"] = torch.where(
        mask.bool(), current - 3.0 * torch.rand(current.shape, generator=generator), 0.0
    )
    batch["advantages"] = torch.where(mask.bool(), torch.randn(current.shape, generator=generator), 0.0)
    tokens = float(mask.sum())
    output = strategy.compute_loss(PlainEngine(policy), batch, normalizer=tokens)
    pure = ppo_policy_loss(
        current, batch["behaviour_logprobs"], batch["advantages"], mask, clip_eps=0.2, clip_eps_high=0.2, dual_clip=3.0
    )
    undual = ppo_policy_loss(
        current, batch["behaviour_logprobs"], batch["advantages"], mask, clip_eps=0.2, clip_eps_high=0.2
    )
    assert output.loss.item() == pytest.approx(pure.loss.item(), abs=1e-5)
    assert output.sums["clip_frac"] / tokens == pytest.approx(pure.clip_fraction.item(), abs=1e-6)
    assert pure.loss.item() < undual.loss.item() - 0.1  # the cap is active on this batch


def test_entropy_bonus_is_minus_coef_times_the_token_mean_entropy_and_moves_the_gradient(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    coef = 0.05
    batch = ppo_with(job(rl={"kl_coef": 0.0}), tokenizer, fresh_critic(policy)).frozen_targets(copy.copy(result))
    mask = batch["response_mask"].bool()
    tokens = float(mask.sum())

    def loss_and_gradient(entropy_coef):
        model = copy.deepcopy(policy)
        strategy = ppo_with(job(rl={"kl_coef": 0.0, "entropy_coef": entropy_coef}), tokenizer, fresh_critic(policy))
        output = strategy.compute_loss(PlainEngine(model), batch, normalizer=tokens)
        output.loss.backward()
        return output, torch.cat([p.grad.flatten() for p in model.parameters()])

    plain, plain_gradient = loss_and_gradient(0.0)
    bonus, bonus_gradient = loss_and_gradient(coef)
    # The token-mean entropy, independently: torch's Categorical over the same response logits.
    model = copy.deepcopy(policy)
    entropy = torch.distributions.Categorical(logits=PlainForward().logits(model, batch)[0]).entropy()
    entropy_mean = entropy[mask].sum() / tokens
    entropy_mean.backward()
    entropy_gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert bonus.sums["policy_loss"] == pytest.approx(
        plain.sums["policy_loss"], abs=1e-5
    )  # the surrogate itself is unchanged
    assert bonus.loss.item() == pytest.approx(plain.loss.item() - coef * entropy_mean.item(), abs=1e-5)
    assert bonus.sums["entropy"] / tokens == pytest.approx(entropy_mean.item(), rel=1e-5)
    difference = bonus_gradient - plain_gradient
    assert difference.norm() > 1e-4 * plain_gradient.norm()
    assert torch.allclose(difference, -coef * entropy_gradient, atol=1e-6, rtol=1e-4)


def test_kl_in_the_loss_instead_of_the_reward(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    strategy = ppo_with(
        job(rl={"kl_coef": 0.2, "kl_in_reward": False, "whiten_advantages": False}),
        tokenizer,
        fresh_critic(policy),
        reference,
    )
    targets = strategy.frozen_targets(copy.copy(result))
    mask = targets["response_mask"]
    plain = compute_gae(
        kl_shaped_rewards(
            targets["returns"].new_tensor(strategy_rewards(result)),
            torch.zeros_like(mask, dtype=torch.float32),
            mask,
            0.0,
        ),
        torch.zeros_like(targets["returns"]),
        mask,
        1.0,
        0.95,
    )
    assert torch.allclose(targets["advantages"], plain[0], atol=1e-6)  # no KL in the rewards
    assert "reference_logprobs" in targets
    output = strategy.compute_loss(PlainEngine(policy), targets, normalizer=float(mask.sum()))
    assert output.sums["kl"] > 0 and output.sums["loss"] > output.sums["policy_loss"]


def strategy_rewards(result) -> list[float]:
    return [float(len(text)) for text in result.response_texts]


def test_adaptive_kl_coefficient_follows_the_target_and_round_trips(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    config = job(rl={"kl_coef": 0.1, "target_kl": 1e-4, "kl_horizon": 80})
    strategy = ppo_with(config, tokenizer, fresh_critic(policy), reference)
    from astrai.algos import AdaptiveKLController

    strategy.kl_controller = AdaptiveKLController(0.1, 1e-4, 80)
    rollout = copy.copy(result)
    targets = strategy.frozen_targets(rollout)
    # the KL per response is far above the target: error clipped at +0.2, 8 responses over a horizon of 80
    assert targets.kl_coef == pytest.approx(0.1)  # the rewards were shaped with the coefficient before the update
    assert strategy.kl_controller.value == pytest.approx(0.1 * (1 + 0.2 * 8 / 80))
    state = strategy.state_dict()
    other = ppo_with(config, tokenizer, fresh_critic(policy), reference)
    other.kl_controller = AdaptiveKLController(0.1, 1e-4, 80)
    other.load_state_dict(state)
    assert other.kl_controller.value == strategy.kl_controller.value


def test_reward_clip_then_batch_normalization(tokenizer, rollout_and_models):
    _, policy, _ = rollout_and_models
    strategy = ppo_with(job(rl={"reward_clip": 2.0, "reward_normalization": "batch"}), tokenizer, fresh_critic(policy))
    scores = strategy.sequence_scores(torch.tensor([5.0, -7.0, 0.0, 1.0]))
    clipped = torch.tensor([2.0, -2.0, 0.0, 1.0])
    assert torch.allclose(scores, (clipped - clipped.mean()) / clipped.std(), atol=1e-4)


# ----------------------------------------------------------------------------- config


def test_config_aliases_and_checks():
    assert (job(rl={"clip_eps": 0.1}).rl.clip_eps_low, job(rl={"clip_eps": 0.1}).rl.clip_eps_high) == (0.1, 0.1)
    assert job(rl={"clip_eps": 0.1, "clip_eps_high": 0.3}).rl.clip_eps_high == 0.3
    assert job(rl={"clip_eps": 0.1, "clip_eps_low": 0.1}).rl.clip_eps_low == 0.1  # a dumped job.yaml reloads
    with pytest.raises(ValidationError, match="give `rl.clip_eps` .* or `rl.clip_eps_low`"):
        job(rl={"clip_eps": 0.1, "clip_eps_low": 0.3})
    with pytest.raises(ValidationError, match="starting `rl.kl_coef` > 0"):
        job(rl={"target_kl": 1.0, "kl_coef": 0.0})
    with pytest.raises(ValidationError, match="leaves no step"):
        job(critic={"warmup_rollouts": 3})
    defaults = job().rl
    assert (defaults.gamma, defaults.gae_lambda, defaults.clip_eps_low, defaults.value_clip, defaults.kl_in_reward) == (
        1.0,
        0.95,
        0.2,
        0.2,
        True,
    )
    assert job().critic.warmup_rollouts == 0 and job().critic.path is None


def test_cli_shorthands_and_the_quickstart_config(monkeypatch):
    from astrai.launch.job_checks import load_and_check
    from astrai.train import parse_args

    args = parse_args(
        [
            "--config",
            "configs/quickstart_ppo.yaml",
            "--set",
            "rl.gamma=0.5",
            "--ppo_gamma",
            "0.99",
            "--ppo_gae_lambda",
            "0.9",
            "--ppo_vf_coef",
            "0.1",
        ]
    )
    assert args.set == [
        "rl.gamma=0.5",
        "rl.gamma=0.99",
        "rl.gae_lambda=0.9",
        "rl.vf_coef=0.1",
    ]  # after --set: the shorthand wins
    tiny = [
        "model.path=null",
        "model.init={model_type: llama}",
        "tokenizer.build={kind: char}",
    ]  # runs/quickstart/hf may not exist
    monkeypatch.setenv("WORLD_SIZE", "1")
    job = load_and_check("configs/quickstart_ppo.yaml", tiny + args.set)
    assert (job.train.train_type, job.rl.gamma, job.rl.gae_lambda, job.rl.vf_coef) == ("online_ppo", 0.99, 0.9, 0.1)
    assert job.data.path == "data/arithmetic/prompts_64.jsonl" and job.rl.clip_eps_high == 0.2


def test_sampler_behaviour_logprobs_from_the_job_config_give_ratio_one_at_the_behaviour_weights(tokenizer):
    """rollout.behaviour_logprobs: sampler, through the job schema: the rollout keeps the sampling logits'
    log-probs, and the first PPO loss at the same weights sees a ratio of 1 (fp32: nothing clipped, approx_kl ~0)."""
    policy = tiny_model(tokenizer, seed=0)
    config = job(rollout={"behaviour_logprobs": "sampler", "max_new_tokens": 8}, rl={"kl_coef": 0.0})
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    result = generate_rollout(
        PlainEngine(policy),
        tokenizer,
        Prompts(prompts, chats, [{}, {}]),
        config.rollout,
        seed=3,
        scoring=behaviour_scoring(config.rollout, tokenizer, 2),
    )
    strategy = ppo_with(config, tokenizer, fresh_critic(policy))
    targets = strategy.frozen_targets(result)
    mask = targets["response_mask"].bool()
    recomputed = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(PlainEngine(policy), targets)
    assert (
        torch.allclose(targets["behaviour_logprobs"], recomputed, atol=1e-5)
        and (targets["behaviour_logprobs"][mask] < 0).all()
    )
    output = strategy.compute_loss(PlainEngine(policy), targets, normalizer=float(mask.sum()))
    assert output.sums["clip_frac"] == 0.0 and output.sums["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert (
        JobConfig.model_validate(
            {**config.model_dump(), "rollout": {"behaviour_logprobs": "recompute"}}
        ).rollout.behaviour_logprobs
        == "recompute"
    )
    with pytest.raises(ValidationError, match="behaviour_logprobs"):
        job(rollout={"behaviour_logprobs": "cache"})
