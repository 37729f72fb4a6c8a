"""Tiny models and an engine stand-in for the rollout and grpo unit tests (no DeepSpeed, one process)."""

from __future__ import annotations

import contextlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.models.tokenizer import build_tokenizer

ALPHABET = "0123456789+-= abcdefghijklmnopqrstuvwxyz\n"


def tiny_tokenizer():
    return build_tokenizer("char", [ALPHABET])


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: high-entropy outputs, so sampling is diverse."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).float()


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
