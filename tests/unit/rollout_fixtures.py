"""Tiny models and an engine stand-in for the rollout and grpo unit tests (no DeepSpeed, one process)."""

from __future__ import annotations

import contextlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.config.schema import JobConfig
from astrai.models.tokenizer import build_tokenizer
from astrai.rollout.scoring import PlainForward, ScoringForward, batches_of

ALPHABET = "0123456789+-= abcdefghijklmnopqrstuvwxyz\n"


def tiny_tokenizer():
    return build_tokenizer("char", [ALPHABET])


# The 2-layer, 32-wide Llama most in-process tests build; the vocabulary and special ids are each test's own.
LLAMA_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# The same as a job's `model.init` block (tied embeddings).
LLAMA_INIT = {"model_type": "llama", **LLAMA_SHAPE, "tie_word_embeddings": True}


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: high-entropy outputs, so sampling is diverse."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **LLAMA_SHAPE,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).float()


def behaviour_scoring(
    settings, tokenizer, batch_size: int | None = None, variant: type[ScoringForward] = PlainForward
) -> ScoringForward:
    """The scoring forward that recomputes the behaviour log-probs of a rollout sampled with the `rollout:`
    `settings` (at their temperature, over the tokenizer's vocabulary), `batch_size` sequences at a time
    (None: all in one forward), as a job's `scoring_forward` does."""
    micro_batches = None if batch_size is None else batches_of(batch_size)
    return variant(settings.temperature, len(tokenizer), micro_batches=micro_batches)


class PlainEngine:
    """What the rollout code needs of `astrai.engine.Engine`, around a bare model."""

    zero_stage = 0
    device = torch.device("cpu")

    def __init__(self, model):
        self.module = model

    def __call__(self, **inputs):
        return self.module(**inputs)

    @contextlib.contextmanager
    def gathered_parameters(self):
        yield

    @contextlib.contextmanager
    def generation_module(self, zero3_mode: str = "copy"):
        yield self.module


def online_job(train_type: str, model_init: dict, **sections) -> JobConfig:
    """A validated online job for in-process strategy tests: 3 steps, 2 prompts x 4 responses of at most 5
    tokens, micro-batch 2 x 2 accumulation; each of `sections` (e.g. rl={...}) is merged over its section."""
    raw = {
        "output_dir": "/tmp/unused",
        "model": {"init": model_init},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": "unused.jsonl"},
        "train": {"train_type": train_type, "max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 5},
        "reward": {"function": "astrai.rollout.rewards:arithmetic_exact_match"},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return JobConfig.model_validate(raw)


class LengthReward:
    """A reward that varies with every response: its length in characters."""

    name = "length"

    def __call__(self, inputs):
        return [float(len(text)) for text in inputs["responses"]]
