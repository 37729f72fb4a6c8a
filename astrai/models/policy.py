"""The policy: any transformers causal LM, from a local folder or built from an architecture block."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from astrai.errors import AstraiError
from astrai.models.activation_offload import offload_saved_activations
from astrai.models.attention import attention_problem

logger = logging.getLogger("astrai.models")

# Names of the dropout probabilities transformers models keep besides nn.Dropout modules: config fields
# (attn_pdrop, resid_pdrop, embd_pdrop, hidden_dropout, attention_dropout, activation_dropout, layerdrop, ...)
# and the float copies attention and decoder layers take of them at construction (OPT's `self.dropout`).
DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop", re.IGNORECASE)

# transformers 5 validates config fields strictly (types, heads dividing the hidden size) with these.
CONFIG_ERRORS = (ValueError, TypeError, KeyError, StrictDataclassError)


class ModelError(AstraiError):
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
        except CONFIG_ERRORS as error:
            raise ModelError(f"model.init: {last_line(error)}") from None
        torch.manual_seed(seed)  # every rank builds the same initial weights
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
        except ImportError as error:  # an attention implementation that cannot run here (no GPU for flash_attn)
            where = "ASTR_BACKEND" if os.environ.get("ASTR_BACKEND") else "model.attn_implementation"
            raise ModelError(f"{where}: {attention!r}: {last_line(error)}") from None
    else:
        model = load_causal_lm(model_config.path, **extra)
    rows = embedding_rows(model)
    if len(tokenizer) > rows:
        raise ModelError(f"tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows}")
    coefficient = router_aux_loss_coef(model_config.router_aux_loss_coef, model)
    if model_config.router_aux_loss_coef and not routes_tokens(model):
        name = type(model).__name__
        raise ModelError(f"model.router_aux_loss_coef: {name} has no mixture-of-experts router (use null or 0)")
    if coefficient > 0:
        logger.info(
            "router load-balancing loss: %g x aux_loss added to the loss (model.router_aux_loss_coef)", coefficient
        )
    if model_config.disable_dropout:
        changed = disable_dropout(model)
        logger.info("model.disable_dropout: %d dropout probabilities of %s set to 0", changed, type(model).__name__)
    if model_config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        if model_config.gradient_checkpointing == "offload":
            offload_saved_activations(model)
    return model


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of `model` to 0, in place; returns how many were not 0 already.

    Switching modules to eval() is not enough and not what the loops do: the trainable engines stay in
    train() mode for every forward (loss, behaviour log-probs, values). nn.Dropout modules get p = 0, as
    TRL's `disable_dropout_in_model` does; that alone misses the functional dropout many architectures
    apply with a float they copied from the config (GPT-2's and OPT's attention, OPT's decoder layers) or
    read from the config at each forward (Falcon, GPT-Neo), so those floats and the config fields are
    zeroed too. A config shared by several modules is zeroed once."""
    changed = 0
    configs: dict[int, PreTrainedConfig] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p != 0
            module.p = 0.0
        changed += _zero_dropout_floats(module)
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            configs[id(config)] = config
    for config in configs.values():
        changed += _zero_config_dropout(config)
    return changed


def _zero_dropout_floats(owner) -> int:
    """Zero the numeric attributes of `owner` (a module or a config) named like a dropout probability."""
    changed = 0
    for name, value in list(vars(owner).items()):
        if DROPOUT_NAME.search(name) and isinstance(value, float | int) and not isinstance(value, bool):
            changed += value != 0
            setattr(owner, name, 0.0)  # through setattr: a config validates and maps its fields
    return changed


def _zero_config_dropout(config: PreTrainedConfig) -> int:
    """Zero a config's dropout fields, and those of its sub-configs (e.g. a `text_config`)."""
    changed = _zero_dropout_floats(config)
    for value in vars(config).values():
        if isinstance(value, PreTrainedConfig):
            changed += _zero_config_dropout(value)
    return changed


def causal_lm(model):
    """The transformers model under `model`: a DeepSpeed engine's `.module`, then a LoRA policy's base model
    (PEFT's wrapper passes every forward argument on to it). For the critic, its ValueModel."""
    module = getattr(model, "module", model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module


@functools.cache
def forward_parameters(model_class: type) -> frozenset[str]:
    """The argument names of the class's forward: asked once per class, not at every forward of a hot loop."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def routes_tokens(model) -> bool:
    """Whether the causal LM under `model` is a mixture of experts that can return its router's
    load-balancing loss (`output_router_logits`: Qwen2-MoE, Mixtral, ...)."""
    return "output_router_logits" in forward_parameters(type(causal_lm(model)))


def router_aux_loss_coef(setting: float | None, model) -> float:
    """`model.router_aux_loss_coef` resolved for `model`: null -> the model config's own `router_aux_loss_coef`
    (transformers' default 0.001 for Qwen2-MoE and Mixtral), 0 -> off; 0 for a model without a router."""
    if not routes_tokens(model):
        return 0.0
    if setting is None:
        return float(getattr(getattr(model, "module", model).config, "router_aux_loss_coef", 0.0) or 0.0)
    return float(setting)


def last_line(error: Exception) -> str:
    """The telling line of a (possibly multi-line) library error: strict validation puts the cause last."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def check_model_config(model_config, backend: str | None = None) -> str | None:
    """What is wrong with `model.init` or `model.path`'s config.json, or with the attention implementation
    for it (`backend`: ASTR_BACKEND as the job's ranks will see it, which wins over `model.attn_implementation`),
    found without building the model (so before any rank starts); None when nothing is. The message starts
    with the key it names."""
    if model_config.init is not None:
        settings = dict(model_config.init)
        model_type = settings.pop("model_type")
        # The tokenizer's size is known only once built; a count above any token id keeps id checks quiet.
        settings.setdefault("vocab_size", 1 << 20)
        where = "model.init"
        try:
            config = AutoConfig.for_model(model_type, **settings)
        except CONFIG_ERRORS as error:
            return f"{where}: {last_line(error)}"
    else:
        where = f"model.path: {Path(model_config.path) / 'config.json'}"
        try:
            config = AutoConfig.from_pretrained(str(model_config.path), local_files_only=True)
        except (OSError, *CONFIG_ERRORS) as error:
            return f"{where}: {last_line(error)}"
    problem = _architecture_problem(config, where)
    attention = backend or model_config.attn_implementation
    if problem is None and attention:
        key = "ASTR_BACKEND (runtime.environment or the shell)" if backend else "model.attn_implementation"
        problem = attention_problem(attention, config, key)
    return problem


def _architecture_problem(config, where: str) -> str | None:
    """Shapes a config accepts but a model cannot be built (or run) with, for any architecture that names them."""
    names = (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
    )
    sizes = {name: getattr(config, name, None) for name in names}
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"{where}: {name} must be a positive integer, got {value!r}"
    hidden, heads, kv_heads = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if hidden is not None and heads is not None and getattr(config, "head_dim", None) is None and hidden % heads:
        return f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})"
    if heads is not None and kv_heads is not None and heads % kv_heads:
        return f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
    return None


def embedding_rows(model) -> int:
    """Rows of the input embedding; under ZeRO-3 partitioned loading the local tensor is empty and
    DeepSpeed keeps the full shape in `ds_shape`."""
    weight = model.get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def load_causal_lm(path: str | Path, **kwargs) -> PreTrainedModel:
    """A causal LM from a local folder only (never a hub download)."""
    if not Path(path).is_dir():
        raise ModelError(
            f"model.path: {str(path)!r} is not a local folder (AstrAI never downloads from a hub at run time)"
        )
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True, **kwargs)
    except SafetensorError as error:
        file = unreadable_weights(Path(path)) or path
        raise ModelError(f"model.path: {file}: cannot read the weights: {error}") from None
    except (OSError, ValueError, ImportError) as error:  # ImportError: an attention implementation not runnable here
        raise ModelError(f"model.path: cannot load {str(path)!r}: {error}") from None


def unreadable_weights(folder: Path) -> Path | None:
    """The first safetensors file of `folder` whose header does not cover the file (truncated, or not safetensors)."""
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return file
    return None
