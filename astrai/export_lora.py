"""Export of a LoRA run's checkpoint (astrai/export.py hands it over when the manifest records an adapter).

The checkpoint holds the adapter only, so its base is rebuilt from the job (`model.path`, or `model.init`
with the run's seed; a critic from `critic.path` or the policy's start), checked against the base the
manifest names, wrapped with the run's LoRA settings and given the adapter's weights. Then either
`merge_and_unload` (default: a plain transformers folder, the adapter folded into the weights) or, with
`--adapter`, PEFT's own adapter folder (`adapter_config.json` + `adapter_model.safetensors`), which
`PeftModel.from_pretrained(base, folder)` loads.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from astrai.models.lora import (
    LoraError,
    apply_lora,
    base_model_identity,
    check_same_base,
    critic_base_identity,
)

logger = logging.getLogger("astrai.export")


def lora_record(checkpoint: Path, part: str) -> dict | None:
    """The manifest's LoRA record of `part` ({"base", "settings"}), or None for a full fine-tuning part."""
    from astrai.checkpoint import CheckpointError, read_manifest

    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError:  # unreadable: the verification reported it already, or --no-verify asked to go on
        return None
    return ((manifest.meta.get("lora") or {}) if manifest is not None else {}).get(part)


class AdapterFolder:
    """What `write_export` saves for `--adapter`: PEFT's adapter folder (no shards of the base)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def save_pretrained(self, folder, max_shard_size=None) -> None:
        self.model.save_pretrained(str(folder))


def base_model(job, tokenizer, part: str, load_start) -> tuple[torch.nn.Module, dict]:
    """The part's base model with real weights (fp32, plain: no engine) and its identity. `load_start(model,
    path)`: puts `model.init_from_checkpoint`'s policy weights into the model (astrai/export.py's)."""
    from astrai.models.policy import ModelError, build_policy
    from astrai.models.value import build_value_model

    # Training-only switches off: the exported config keeps the architecture's own dropout values.
    update = {"gradient_checkpointing": False, "attn_implementation": None, "disable_dropout": False, "lora": None}
    model_config = job.model.model_copy(update=update)
    try:
        with torch.random.fork_rng(devices=[]):  # build_policy seeds torch: the caller's RNG stays as it was
            if part == "critic":
                model = build_value_model(model_config, tokenizer, job.train.seed, job.critic.path)
                return model, critic_base_identity(job, model)
            model = build_policy(model_config, tokenizer, job.train.seed)
            if model_config.init_from_checkpoint is not None:
                load_start(model, model_config.init_from_checkpoint)
    except (ModelError, OSError, ValueError) as error:
        raise LoraError(f"cannot rebuild the base model of the job: {error}") from None
    return model, base_model_identity(model_config, job.train.seed, model)


def lora_export_model(
    job, tokenizer, checkpoint: Path, part: str, record: dict, state: dict, *, adapter: bool, dtype, load_start
):
    """The model `write_export` saves: the part's base with the adapter weights `state` merged in, or
    (`adapter`) the adapter folder, in `dtype`; `load_start`: see `base_model`. LoraError when the base
    differs from the one the manifest's `record` names, or the weights do not fit."""
    from astrai.config.schema import LoraSection

    model, identity = base_model(job, tokenizer, part, load_start)
    check_same_base({part: record}, {part: {"base": identity}}, checkpoint)
    settings = LoraSection(**record["settings"])
    keep = ("value_head",) if part == "critic" else ()
    wrapped = apply_lora(model, settings, identity, key=f"{part} adapter", keep_trainable=keep)
    trainable = {name for name, parameter in wrapped.named_parameters() if parameter.requires_grad}
    missing, unexpected = sorted(trainable - set(state)), sorted(set(state) - trainable)
    if missing or unexpected:
        raise LoraError(
            f"{checkpoint / part}: the adapter's weights do not fit the job's LoRA model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    wrapped.load_state_dict(state, strict=False)
    if adapter:
        wrapped.to(dtype)
        return AdapterFolder(wrapped)
    merged = wrapped.merge_and_unload()
    merged.to(dtype)
    merged.config.dtype = dtype
    if hasattr(merged.config, "use_cache"):
        merged.config.use_cache = True
    return merged
