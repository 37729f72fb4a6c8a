"""Rollouts: `group_size` sampled responses per prompt from the policy's current weights.

Generation is transformers' `generate` (KV cache, stop at EOS) on the engine's module, with every
sampling knob set explicitly so that a model's own `generation_config.json` (a repetition penalty,
a default top_k) cannot change what is sampled. The tokens are drawn by AstrAI's `TokenSampler`
(`token_sampler.py`: inverse-CDF sampling over transformers' own temperature/top_k/top_p warpers, ~8x
cheaper than generate's `torch.multinomial` on a CPU), inside generate running greedily.

Behaviour log-probs, and how sampling-vs-training mismatch is handled: the log-probs the importance
ratios divide by are NOT the ones the sampler saw. After sampling, the policy engine's own forward
(the very call the loss makes, same weights, same precision, no KV cache) recomputes them. So at the
first minibatch the ratio is exactly 1 wherever that forward is deterministic, and the kernel
differences between cached generation and a full forward (about 1e-6 in fp32, 1e-2 in bf16) never
enter the loss. What remains is the sampler's truncation: with top_p < 1 or top_k > 0 the tokens come
from a truncated distribution while the ratio uses the full (temperature-scaled) one, a small bias
shared by TRL, OpenRLHF and verl; the defaults (top_p 1, top_k 0) have none.
`rollout.behaviour_logprobs: sampler` skips that forward and keeps, at each generation step, the
log-prob of the sampled token under the sampler's own raw logits (full, temperature-scaled softmax):
1.1x the rollout's tokens/s on a CPU, at the price of the cached-vs-full kernel difference entering
the first ratio (about 1e-6 in fp32; about 1e-2 in bf16, where recompute is the safe choice). The
default, `auto`, takes exactly that trade: `sampler` when the policy trains in fp32, `recompute` in
bf16/fp16.

ZeRO-3 (`rollout.zero3_generation`): by default generation runs in a plain, hook-free copy of the
policy that `Engine.generation_module()` allocates for the rollout and fills one gathered parameter
at a time, so no rank waits on another while sampling and no DeepSpeed hook runs per token. `gather`
samples from the partitioned module inside one gather of every parameter instead, with `synced_gpus`
so that a rank whose responses all ended keeps stepping while others generate (every forward of the
partitioned module is a collective); its hooks make it ~5x slower on a CPU.

One prefill per prompt group (`rollout.share_prefill`, default on): the distinct prompts run one forward and
their KV cache is repeated to the group before generate decodes (`group_prefill.py`); same tokens for the
same seed as prefilling every copy.

Sampling randomness: each rollout draws from its own seed, `sampling_seed(seed, step, rank)`, in a
forked RNG, so a resumed run samples the same responses as an uninterrupted one (same world size).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from astrai.models.lora import is_lora_model
from astrai.rollout.group_prefill import group_prefill_cache, shares_prefill
from astrai.rollout.prompts import Prompts
from astrai.rollout.scoring import ScoringForward
from astrai.rollout.sequences import join_sequences, left_pad, response_mask, truncated_rows
from astrai.rollout.token_sampler import TokenSampler

SEED_MODULUS = 2**63 - 1


def sampling_seed(seed: int, step: int, rank: int, stream: int = 0) -> int:
    """A distinct, deterministic seed per (train.seed, step, rank, stream); stream 0 samples, others shuffle."""
    value = seed
    for part in (step, rank, stream):
        value = (value * 1_000_003 + part) % SEED_MODULUS
    return value


@dataclass
class RolloutResult:
    """One rank's rollout of a step: N = prompts x group_size sequences, each group contiguous
    ([p0 r0, p0 r1, ..., p1 r0, ...]), in the layout of `sequences.py`. Tensors live on the device."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    response_ids: torch.Tensor  # [N, R] right-padded
    response_mask: torch.Tensor  # [N, R], 1 up to and including the first EOS
    # [N, R] float32, policy engine forward at sampling time, 0 on padding; None when the strategy needs
    # none (grpo with one optimizer update per rollout: the loss forward runs on the sampling weights)
    behaviour_logprobs: torch.Tensor | None
    truncated: torch.Tensor  # [N] bool, no EOS within max_new_tokens
    prompt_texts: list[str]  # the rendered prompt (chat template applied) of each sequence
    response_texts: list[str]  # the response without special tokens
    messages: list[list[dict]]  # the prompt's chat messages of each sequence
    rows: list[dict]  # the data row of each sequence's prompt (every field, e.g. `answer`)
    group_size: int
    policy_version: int = 0  # optimizer updates the sampling weights had received (set by the strategy)
    rewards: torch.Tensor | None = None  # [N] float32, set by the reward stage
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N], unweighted
    overlong_penalties: torch.Tensor | None = None  # [N] float32 (rl.overlong_penalty), already added to `rewards`
    # [N] bool: the rows that take loss; None: all. rl.mask_truncated clears the truncated rows, whose response
    # mask `training_tensors` then empties (rewards, lengths and metrics still see every token).
    loss_rows: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.response_ids.shape[0]

    def training_tensors(self) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask, position_ids [N, P + R]; response_ids, response_mask,
        behaviour_logprobs [N, R]: what every online loss reads."""
        tensors = join_sequences(self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask)
        if self.loss_rows is not None:  # attention still sees the response; only the loss mask empties
            keep = self.loss_rows.to(tensors["response_mask"].dtype)[:, None]
            tensors["response_mask"] = tensors["response_mask"] * keep
        if self.behaviour_logprobs is not None:
            tensors["behaviour_logprobs"] = self.behaviour_logprobs
        return tensors

    def metric_sums(self) -> dict[str, float]:
        """Sums that, added over ranks, give the step's rollout metrics (`step_metrics.rollout_metrics`)."""
        sums = {
            "rollout/responses": float(self.size),
            "rollout/response_tokens": float(self.response_mask.sum()),
            "rollout/truncated": float(self.truncated.sum()),
        }
        if self.rewards is not None:
            rewards = self.rewards.double()
            sums.update({"rollout/reward": float(rewards.sum()), "rollout/reward_squared": float((rewards**2).sum())})
            for name, values in self.reward_components.items():
                sums[f"rollout/reward_{name}"] = float(values.double().sum())
        if self.overlong_penalties is not None:
            sums["rollout/overlong_penalty"] = float(self.overlong_penalties.double().sum())
        return sums


@contextlib.contextmanager
def forked_rng(seed: int, device: torch.device):
    """Seed torch for the block only; the global RNG continues afterwards as if untouched."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def behaviour_logprobs_source(setting: str, precision: str | None) -> str:
    """`rollout.behaviour_logprobs` resolved for a policy training in `precision` (None: unknown): `auto` is
    `sampler` in fp32, where cached generation and the full forward agree to ~1e-6 so the extra forward
    buys nothing, and `recompute` otherwise (bf16/fp16 kernels differ by ~1e-2)."""
    if setting != "auto":
        return setting
    return "sampler" if precision == "fp32" else "recompute"


def generation_mode(setting: str, lora: bool) -> str:
    """The `Engine.generation_module` mode a rollout samples in, from `rollout.zero3_generation`: a LoRA policy
    samples in its own module ("gather"), since the plain copy is of a transformers class. The planner counts
    the ZeRO-3 copy's memory from this same answer."""
    return "gather" if lora else setting


def sampling_config(settings, tokenizer, *, do_sample: bool = True):
    """A GenerationConfig with every sampling knob set (nothing inherited from the model's defaults).

    do_sample=True: transformers' own sampling with the rollout's knobs (what plain `generate` does).
    do_sample=False: what the rollout runs: greedy over the `TokenSampler`'s draw, every processor of
    generate's off (the knobs neutral: the sampler applies temperature, top_k and top_p itself)."""
    from transformers import GenerationConfig

    if do_sample:
        knobs = dict(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    else:
        knobs = dict(temperature=1.0, top_p=1.0, top_k=0)
    return GenerationConfig(
        do_sample=do_sample,
        num_beams=1,
        **knobs,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


@torch.no_grad()
def sample_responses(
    engine,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings,
    tokenizer,
    sampler: TokenSampler | None = None,
    group_size: int = 1,
) -> torch.Tensor:
    """Sampled continuation ids [N, R] (R <= max_new_tokens; finished rows padded with the pad id).
    sampler: the TokenSampler generate calls at every step (pass one built with keep_logprobs to read the
    sampler's behaviour log-probs afterwards); by default one without. group_size: the prompt rows are
    groups of this many identical rows; with `settings.share_prefill` each group's prompt is prefilled once
    (`group_prefill.py`)."""
    from transformers import LogitsProcessorList

    if sampler is None:
        sampler = TokenSampler(
            settings.temperature, settings.top_k, settings.top_p, keep_logprobs=False, vocab_size=len(tokenizer)
        )

    mode = generation_mode(getattr(settings, "zero3_generation", "copy"), is_lora_model(engine.module))
    # Only the partitioned module's forwards are collectives: then a rank whose responses all ended keeps stepping.
    synced = engine.zero_stage == 3 and mode == "gather" and dist.is_initialized() and dist.get_world_size() > 1
    with engine.generation_module(mode) as model:
        was_training = model.training
        model.eval()  # no dropout while sampling; the behaviour log-probs come from the training forward anyway
        try:
            share = shares_prefill(settings, group_size, prompt_ids, model, synced=synced)
            cache = {"cache": group_prefill_cache(model, prompt_ids, prompt_mask, group_size)} if share else {}
            output = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=sampling_config(settings, tokenizer, do_sample=False),
                synced_gpus=synced,
                logits_processor=LogitsProcessorList([sampler]),
                **cache,
            )
        finally:
            model.train(was_training)
    return output[:, prompt_ids.shape[1] :]


def generate_rollout(
    engine, tokenizer, prompts: Prompts, settings, *, seed: int, scoring: ScoringForward | None = None
) -> RolloutResult:
    """Sample `settings.group_size` responses to each prompt and take their behaviour log-probs (recomputed
    by `scoring`, the job's scoring forward, on the engine, or kept from the sampler: `settings.behaviour_logprobs`,
    see `behaviour_logprobs_source`).

    engine: the policy `Engine` (or anything with `.module`, `.zero_stage`, `.generation_module()`
    and a forward); prompts: this rank's prompts (token ids with the chat template applied; messages and rows,
    handed on to the rewards). settings: the `rollout:` config section; seed: the sampling seed
    (`sampling_seed`). Every rank must call this with the same number of prompts under ZeRO-3. scoring None
    takes no behaviour log-probs (the result's behaviour_logprobs is None). The result's policy_version is the
    caller's to set (0 here): generation does not know how many updates the weights have had.
    """
    group = settings.group_size
    device = engine.device
    repeated = [list(ids) for ids in prompts.ids for _ in range(group)]
    padded_prompts, prompt_mask = (tensor.to(device) for tensor in left_pad(repeated, tokenizer.pad_token_id))
    source = behaviour_logprobs_source(
        getattr(settings, "behaviour_logprobs", "recompute"), getattr(engine, "precision", None)
    )
    from_sampler = scoring is not None and source == "sampler"
    # vocab_size: a model vocabulary padded past the tokenizer samples, and scores, only the tokenizer's ids.
    sampler = TokenSampler(
        settings.temperature, settings.top_k, settings.top_p, keep_logprobs=from_sampler, vocab_size=len(tokenizer)
    )
    with forked_rng(seed, device):
        response_ids = sample_responses(engine, padded_prompts, prompt_mask, settings, tokenizer, sampler, group)
    mask = response_mask(response_ids, tokenizer.eos_token_id)
    if scoring is None:
        behaviour = None
    elif from_sampler:
        behaviour = sampler.logprobs(response_ids, mask)
    else:
        behaviour = scoring.frozen_logprobs(engine, join_sequences(padded_prompts, prompt_mask, response_ids, mask))
    prompt_texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts.ids]
    response_texts = [
        tokenizer.decode(ids[keep.bool()].tolist(), skip_special_tokens=True) for ids, keep in zip(response_ids, mask)
    ]
    return RolloutResult(
        prompt_ids=padded_prompts,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=mask,
        behaviour_logprobs=behaviour,
        truncated=truncated_rows(response_ids, tokenizer.eos_token_id),
        prompt_texts=[text for text in prompt_texts for _ in range(group)],
        response_texts=response_texts,
        messages=[list(chat) for chat in prompts.messages for _ in range(group)],
        rows=[dict(row) for row in prompts.rows for _ in range(group)],
        group_size=group,
    )
