"""LoRA adapters through PEFT (`model.lora`, `critic.lora`): wrap a model before its engine is built, so
that only the adapter (and `modules_to_save`) is trainable, in the optimizer and in checkpoints.

The base weights are never saved by a LoRA run: every start rebuilds them from `model.path` /
`model.init` (as a full run's first start does), so a checkpoint records which base it adapts
(`base_model_identity`) and a resume onto another base is refused (`check_same_base`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from astrai.errors import AstraiError

logger = logging.getLogger("astrai.models")

ADAPTER_NAME = "default"  # PEFT's name of the one adapter a run trains
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class LoraError(AstraiError):
    """A LoRA setting that does not fit the model, or a checkpoint of another base; the message says which."""


def is_lora_model(module) -> bool:
    """Whether `module` (or the module an engine wraps) is a PEFT model."""
    from peft import PeftModel

    return isinstance(getattr(module, "module", module), PeftModel)


def linear_types() -> tuple[type, ...]:
    """The layer types PEFT's LoRA adapts as linear maps: torch's Linear and transformers' Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, Conv1D)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of every linear module of `model` (what an error about target_modules lists)."""
    return [name for name, module in model.named_modules() if isinstance(module, linear_types())]


def decoder_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(name, list) of the decoder blocks: the ModuleList as long as the config's `num_hidden_layers`,
    else the longest ModuleList. Derived from the model, so no architecture's names are assumed."""
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)]
    if not lists:
        raise LoraError(f"{type(model).__name__} has no list of decoder blocks: give lora.target_modules")
    matching = [item for item in lists if len(item[1]) == layers]
    return (matching or sorted(lists, key=lambda item: -len(item[1])))[0]


def default_target_modules(model: torch.nn.Module) -> list[str]:
    """Every linear layer inside the decoder blocks, as the name suffixes PEFT matches (`q_proj`, `mlp.c_fc`, ...);
    modules outside the blocks (the lm_head, a value head) are not adapted."""
    prefix, blocks = decoder_blocks(model)
    suffixes = set()
    for block in blocks:
        for name, module in block.named_modules():
            if isinstance(module, linear_types()):
                suffixes.add(name)
    if not suffixes:
        raise LoraError(f"the decoder blocks ({prefix}) hold no linear layer: give lora.target_modules")
    return sorted(suffixes)


def unmatched_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Entries of `targets` that match no linear module of `model` (by PEFT's rule: the full name, or a
    suffix after a dot)."""
    names = linear_module_names(model)
    return [target for target in targets if not any(name == target or name.endswith("." + target) for name in names)]


def unmatched_modules_to_save(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Entries of `names` that match no module of `model` by PEFT's rule for modules_to_save (a module's full
    name ends with the entry), so PEFT would train nothing for them, silently."""
    modules = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
    return [target for target in names if not any(name.endswith(target) for name in modules)]


def check_targets(model: torch.nn.Module, settings, key: str) -> None:
    """Refuse target_modules and modules_to_save that match nothing, listing the model's modules (one line)."""
    unknown = unmatched_modules_to_save(model, settings.modules_to_save or [])
    if unknown:
        children = [name for name, _ in model.named_children()]
        parts = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
        leaves = sorted(part for part in parts if not part.isdigit())  # a block's index in its list names no kind
        raise LoraError(
            f"{key}.modules_to_save: {unknown} match no module of {type(model).__name__}; its modules are named "
            f"{leaves} (top level: {children})"
        )
    if settings.target_modules is None:
        default_target_modules(model)  # raises when the blocks hold no linear layer
        return
    unmatched = unmatched_targets(model, settings.target_modules)
    if unmatched:
        suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear_module_names(model)})
        raise LoraError(
            f"{key}.target_modules: {unmatched} match no linear module of {type(model).__name__}; its linear modules "
            f"are named {suffixes} (full names such as {linear_module_names(model)[:3]})"
        )


def peft_config(model: torch.nn.Module, settings):
    """PEFT's LoraConfig for `settings` (a `LoraSection`) on `model`."""
    from peft import LoraConfig

    init = True if settings.init == "default" else settings.init
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=default_target_modules(model) if settings.target_modules is None else settings.target_modules,
        modules_to_save=settings.modules_to_save,
        use_rslora=settings.use_rslora,
        use_dora=settings.use_dora,
        init_lora_weights=init,
        bias="none",
        # A causal LM gets PEFT's causal-LM wrapper (generate, the loss inputs); a critic the plain one.
        task_type="CAUSAL_LM" if hasattr(model, "generate") else None,
    )


def apply_lora(
    model: torch.nn.Module, settings, base: dict, *, key: str = "model.lora", keep_trainable: tuple[str, ...] = ()
):
    """`model` wrapped in a PEFT LoRA model: base weights frozen, the adapter (and modules_to_save, and the
    parameters under the `keep_trainable` module names, e.g. a critic's value head) trainable. `base`: the
    base model's identity (`base_model_identity`), kept on the wrapper for the checkpoint's manifest."""
    from peft import get_peft_model

    check_targets(model, settings, key)
    config = peft_config(model, settings)
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5's name
    if checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need an input with grad
    wrapped = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    for prefix in keep_trainable:
        for parameter in wrapped.get_base_model().get_submodule(prefix).parameters():
            parameter.requires_grad_(True)
    wrapped.astrai_lora = {"base": base, "settings": lora_settings_record(settings)}
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in wrapped.parameters())
    logger.info(
        "%s: r=%d on %s; %d trainable parameters of %d (%.2f%%)",
        key,
        settings.r,
        ", ".join(sorted(config.target_modules)),
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return wrapped


# ----------------------------------------------------------------------------- which base a run adapts


def base_model_identity(model_config, seed: int, model: torch.nn.Module) -> dict:
    """What a LoRA checkpoint records of its base (`model` before wrapping): a `model.path` by its resolved
    path and a hash of its config.json, weights index and weights files (`folder_hash`);
    a `model.init` (or `model.init_from_checkpoint`) model by a hash of its initial weights."""
    if model_config.path is not None and model_config.init_from_checkpoint is None:
        folder = Path(model_config.path).resolve()
        return {"path": str(folder), "hash": folder_hash(folder)}
    source = model_config.init_from_checkpoint or f"model.init (seed {seed})"
    return {"path": str(source), "hash": weights_hash(model)}


def critic_base_identity(job, model: torch.nn.Module) -> dict:
    """The critic's base: `critic.path`'s folder, else the policy's starting weights as built (trunk + zero head)."""
    if job.critic.path is not None:
        folder = Path(job.critic.path).resolve()
        return {"path": str(folder), "hash": folder_hash(folder)}
    return base_model_identity(job.model, job.train.seed, model)


SAMPLE_BYTES = 64 << 10  # bytes read at each sampled offset of a weights file
SAMPLES = 64  # sampled offsets per file: two trainings of one architecture differ in every sample


def folder_hash(folder: Path) -> str:
    """sha256 of config.json, the weights index and, per weights file, its name, size, safetensors header and
    SAMPLES evenly spaced slices (the whole file when smaller): a few MB read per file even for a 70B model,
    yet another training of the same architecture (same header) hashes differently."""
    digest = hashlib.sha256()
    for name in ("config.json", *WEIGHT_INDEX_FILES):
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for file in sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            if size <= SAMPLES * SAMPLE_BYTES:
                digest.update(handle.read())
                continue
            for index in range(SAMPLES):
                handle.seek(index * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 of every parameter's name, shape and bytes (fp32), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def lora_settings_record(settings) -> dict:
    return json.loads(settings.model_dump_json())


def check_same_base(saved: dict | None, current: dict | None, checkpoint) -> None:
    """Refuse a resume that would put a checkpoint's adapter on another base, or mix LoRA and full runs.
    `saved` / `current`: the manifest's and this job's `lora` record ({"base": identity, ...}) or None."""
    if saved is None and current is None:
        return
    if saved is None:
        raise LoraError(
            f"{checkpoint} is a full fine-tuning checkpoint and this job trains a LoRA adapter (model.lora): to adapt "
            f"its weights, start a new run with model.init_from_checkpoint: {checkpoint}"
        )
    if current is None:
        raise LoraError(
            f"{checkpoint} holds a LoRA adapter only (its run had model.lora) and this job has no model.lora: "
            "resume with the same model.lora, or export the merged model (export-hf) and start from it"
        )
    for part in sorted(set(saved) | set(current)):
        before, now = saved.get(part), current.get(part)
        if before is None or now is None:
            raise LoraError(
                f"{checkpoint}: the {part} has a LoRA adapter in {'the checkpoint' if now is None else 'this job'} only"
            )
        if before["base"]["hash"] != now["base"]["hash"]:
            raise LoraError(
                f"{checkpoint}: its {part} adapter was trained on the base model {before['base']['path']} (hash "
                f"{before['base']['hash'][:12]}) but this job's base is {now['base']['path']} (hash "
                f"{now['base']['hash'][:12]}): an adapter resumes only on its own base"
            )
        if before["base"]["path"] != now["base"]["path"]:
            logger.warning(
                "%s: %s base model moved from %s to %s (same config and weights: resuming)",
                checkpoint,
                part,
                before["base"]["path"],
                now["base"]["path"],
            )


def lora_checkpoint_meta(engines: dict) -> dict:
    """{"lora": {part: {"base": identity, "settings": ...}}} for a manifest, or {} without an adapter."""
    record = {
        name: engine.module.astrai_lora for name, engine in engines.items() if hasattr(engine.module, "astrai_lora")
    }
    return {"lora": record} if record else {}


# ----------------------------------------------------------------------------- checked before any rank starts


def check_lora_job(job, engine_parts: tuple[str, ...]) -> str | None:
    """What is wrong with `model.lora` / `critic.lora` for the job's architecture (target_modules matching
    nothing), judged on a meta-device skeleton of the model (no weights, no memory); None when nothing is.
    engine_parts: the engines the train type builds (`Strategy.engine_parts`); a critic.lora without a critic
    is not judged (no engine uses it)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    parts = (
        ("policy", "model.lora", job.model.lora, None),
        ("critic", "critic.lora", job.critic.lora, job.critic.path),
    )
    for part, key, settings, critic_path in parts:
        if settings is None or part not in engine_parts:
            continue
        try:
            if critic_path is not None:
                config, build = AutoConfig.from_pretrained(critic_path, local_files_only=True), AutoModel
            elif job.model.init is not None:
                init = dict(job.model.init)
                init.setdefault("vocab_size", 256)  # the tokenizer's size is unknown here; names do not depend on it
                config, build = AutoConfig.for_model(init.pop("model_type"), **init), AutoModelForCausalLM
            else:
                config, build = AutoConfig.from_pretrained(job.model.path, local_files_only=True), AutoModelForCausalLM
            with torch.device("meta"):
                skeleton = build.from_config(config)
        except (OSError, ValueError, TypeError, KeyError):
            continue  # the model's own check (check_model_config) names that problem
        try:
            check_targets(skeleton, settings, key)
        except LoraError as error:
            return str(error)
    return None
