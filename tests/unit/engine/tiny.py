"""The one-layer Llama the in-process engine tests build (50-token vocabulary, hidden 16)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = LlamaConfig(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16,
)


def tiny_llama() -> LlamaForCausalLM:
    """A fresh model drawn from torch's current RNG state (seed it first for fixed weights)."""
    return LlamaForCausalLM(TINY_LLAMA)
