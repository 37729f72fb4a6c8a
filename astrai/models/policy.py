"""The policy: any transformers causal LM, from a local folder or built from an architecture block."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase


class ModelError(Exception):
    """A model that cannot be built or loaded; the message names the key and the reason."""


def attention_implementation(configured: str | None) -> str | None:
    """`ASTR_BACKEND` (per-job environment) wins over `model.attn_implementation`."""
    return os.environ.get("ASTR_BACKEND") or configured


def build_policy(model_config, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """Build (`model.init`) or load (`model.path`) the policy in fp32; DeepSpeed casts it for training."""
    attention = attention_implementation(model_config.attn_implementation)
    extra = {"attn_implementation": attention} if attention else {}
    if model_config.init is not None:
        settings = dict(model_config.init)
        model_type = settings.pop("model_type")
        settings.setdefault("vocab_size", len(tokenizer))
        settings.setdefault("pad_token_id", tokenizer.pad_token_id)
        settings.setdefault("eos_token_id", tokenizer.eos_token_id)
        settings.setdefault("bos_token_id", tokenizer.bos_token_id)
        try:
            config = AutoConfig.for_model(model_type, **settings)
        except (ValueError, TypeError) as error:
            raise ModelError(f"model.init: {error}") from None
        torch.manual_seed(seed)  # every rank builds the same initial weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    else:
        model = load_causal_lm(model_config.path, **extra)
    rows = embedding_rows(model)
    if len(tokenizer) > rows:
        raise ModelError(f"tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows}")
    if model_config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def embedding_rows(model) -> int:
    """Rows of the input embedding; under ZeRO-3 partitioned loading the local tensor is empty and
    DeepSpeed keeps the full shape in `ds_shape`."""
    weight = model.get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def load_causal_lm(path: str | Path, **kwargs) -> PreTrainedModel:
    """A causal LM from a local folder only (never a hub download)."""
    if not Path(path).is_dir():
        raise ModelError(f"model.path: {str(path)!r} is not a local folder (AstrAI never downloads from a hub at run time)")
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True, **kwargs)
    except (OSError, ValueError) as error:
        raise ModelError(f"model.path: cannot load {str(path)!r}: {error}") from None
