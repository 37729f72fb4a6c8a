"""A checkpoint's weights, read once for every reader: the HF export (astrai/export/hf.py) and
`model.init_from_checkpoint` (a new run starts from the policy weights of another run's checkpoint).

The policy is trained as an unchanged transformers module, so DeepSpeed's consolidated state dict already
uses Hugging Face parameter names: the "key map" is the identity, except for tied weights (`lm_head.weight`
is an alias of the input embedding), dropped from the dict and re-tied by transformers after loading.

A LoRA run's checkpoint holds its adapter only, so its base is rebuilt from the job (`model.path`, or
`model.init` with the run's seed; a critic from `critic.path` or the policy's start), checked against the
base the manifest names, wrapped with the run's LoRA settings and given the adapter's weights; merged
(`merge_and_unload`) unless the export asks for PEFT's adapter folder. A base that itself started from
`model.init_from_checkpoint` is read through this module again: a plain recursion, no callback.

For `model.init_from_checkpoint` only the weights travel: the optimizer, its moments, the LR schedule, the
step and the data position start fresh. A resume of the same job is `checkpoint.resume`, not this.
Nothing here parses arguments, draws progress or writes a folder: the model build imports it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from astrai.errors import AstraiError
from astrai.models.lora import (
    LoraError,
    apply_lora,
    base_model_identity,
    check_same_base,
    critic_base_identity,
)
from astrai.models.policy import ModelError
from astrai.models.tokenizer import TOKENIZER_DIR, check_saved_tokenizer
from astrai.train_types import train_type_rules

logger = logging.getLogger("astrai.export")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARTS = ("policy", "critic")


class ExportError(AstraiError):
    """An export that cannot be made; the message says which checkpoint or folder, and why."""


# ----------------------------------------------------------------------------- finding the input


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory for `path`: itself, or the newest checkpoint of a checkpoints folder or
    output_dir. "Newest" is `find_latest`'s: the highest step whose manifest reads; it is verified
    afterwards, so a corrupt newest checkpoint is reported rather than silently skipped for an older one."""
    from astrai.checkpoint import find_latest

    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory")
    # Not job.yaml: an output_dir holds one too.
    if (path / "manifest.json").is_file() or any((path / part).is_dir() for part in PARTS):
        return path
    checkpoints_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    latest = find_latest(checkpoints_dir)
    if latest is None:
        raise ExportError(
            f"{path}: not a checkpoint, and {checkpoints_dir} holds no published checkpoint (step_<N> folder)"
        )
    logger.info("newest checkpoint in %s: %s", checkpoints_dir, latest)
    return Path(latest)


def check_checkpoint(checkpoint: Path, part: str, verify: bool) -> None:
    """Refuse a checkpoint that fails its manifest, or lacks the part; a legacy one only warns."""
    from astrai.checkpoint import CheckpointVerifyError, LegacyCheckpointError, verify_checkpoint

    if part not in PARTS:
        raise ExportError(f"--part: unknown part {part!r} (use one of {', '.join(PARTS)})")
    if part == "critic":
        if not (checkpoint / "critic").is_dir():
            raise ExportError(f"{checkpoint}: checkpoint has no critic part (only online_ppo jobs have one)")
    if verify:
        try:
            report = verify_checkpoint(checkpoint)
        except LegacyCheckpointError:
            logger.warning("%s has no manifest.json (a legacy checkpoint): exporting it unverified", checkpoint)
        except CheckpointVerifyError as error:
            if error.reason == "unsafe pickle":  # never loaded, verified or not
                raise ExportError(str(error)) from None
            raise ExportError(f"{error} (use --no-verify to export it anyway)") from None
        else:
            logger.info("verified %s: %d files, %s", checkpoint, report.files, report.algorithm)
    if not (checkpoint / part).is_dir():
        raise ExportError(f"{checkpoint}: no {part}/ folder (not an AstrAI checkpoint?)")
    # A FIFO in its place would block the reader forever.
    if os.path.lexists(checkpoint / "job.yaml") and not (checkpoint / "job.yaml").is_file():
        raise ExportError(f"{checkpoint}/job.yaml: not a regular file (a FIFO, socket or device): refused")
    if not (checkpoint / "job.yaml").is_file():
        raise ExportError(f"{checkpoint}: no job.yaml, so the model's architecture is unknown")


def load_checkpoint_job(checkpoint: Path):
    """The resolved job the checkpoint was trained with (paths not re-checked: only the model matters)."""
    from astrai.config import ConfigError, load_job

    try:
        return load_job(checkpoint / "job.yaml", check_paths=False)
    except ConfigError as error:
        raise ExportError(f"{checkpoint}/job.yaml: {error}") from None


def load_export_tokenizer(job, checkpoint: Path, tokenizer_dir: str | Path | None):
    """The tokenizer the run trained with: `tokenizer_dir`, else the checkpoint's own `tokenizer/`, else the
    run's saved `<output_dir>/tokenizer` (a built one), else the job's `tokenizer.path` / `model.path`."""
    from astrai.models.tokenizer import TokenizerError, load_tokenizer

    if tokenizer_dir is not None:
        candidates = [Path(tokenizer_dir)]
    elif (checkpoint / "tokenizer").is_dir():  # written into every checkpoint since it is self-contained
        candidates = [checkpoint / "tokenizer"]
    elif job.tokenizer.build is not None:
        # The checkpoint's own run first: a relative output_dir in job.yaml is relative to wherever
        # training ran, and could name another run's tokenizer from here.
        # <run>/checkpoints/step_<N>, or its portable form <run>/checkpoints/portable/step_<N>.
        folder = checkpoint.resolve().parent
        folder = folder.parent if folder.name == "portable" else folder
        run_dir = folder.parent if folder.name == "checkpoints" else None
        candidates = ([run_dir / "tokenizer"] if run_dir else []) + [Path(job.output_dir) / "tokenizer"]
    else:
        candidates = [Path(job.tokenizer.path or job.model.path)]
    for candidate in candidates:
        if candidate.is_dir():
            try:
                return load_tokenizer(str(candidate), job.tokenizer.chat_template)
            except TokenizerError as error:
                raise ExportError(str(error)) from None
    tried = ", ".join(str(candidate) for candidate in candidates)
    raise ExportError(f"tokenizer of {checkpoint} not found (tried {tried}); give --tokenizer-dir")


# ----------------------------------------------------------------------------- model and weights


def build_skeleton(job, tokenizer):
    """The job's architecture with every tensor on the meta device (no memory, no init work)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from astrai.models.policy import ModelError, build_policy

    try:
        if job.model.init is not None:
            # build_policy itself, so that vocab size, special ids and any future default match training;
            # training-only switches are turned off, and its seeding must not touch the caller's RNG.
            # disable_dropout off: the exported config.json keeps the architecture's own dropout values.
            update = {"gradient_checkpointing": False, "attn_implementation": None, "disable_dropout": False}
            model_config = job.model.model_copy(update=update)
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                return build_policy(model_config, tokenizer, job.train.seed)
        if not Path(job.model.path).is_dir():
            raise ExportError(
                f"model.path {job.model.path!r} of the job is not a folder here: its config.json gives the architecture"
            )
        config = AutoConfig.from_pretrained(job.model.path, local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ModelError, OSError, ValueError) as error:
        raise ExportError(f"cannot rebuild the model of the job: {error}") from None


def critic_skeleton(job, tokenizer):
    """The critic (`ValueModel`: trunk + value head) on the meta device: the trunk of `critic.path`'s
    architecture when the run started its critic there, else of the policy's."""
    from transformers import AutoConfig, AutoModel

    from astrai.models.value import ValueModel, trunk_of

    if job.critic.path is None:
        trunk = trunk_of(build_skeleton(job, tokenizer))
    elif not Path(job.critic.path).is_dir():
        raise ExportError(
            f"critic.path {job.critic.path!r} of the job is not a folder here: its config.json gives the critic's "
            "architecture"
        )
    else:
        with torch.device("meta"):
            trunk = AutoModel.from_config(
                AutoConfig.from_pretrained(job.critic.path, local_files_only=True), dtype=torch.float32
            )
    with torch.device("meta"):
        return ValueModel(trunk)


def policy_skeleton(job, model, tokenizer):
    """The module the job's policy engine trained, from its causal LM skeleton: the model itself, or for `rm`
    its trunk under the scalar head (as `RewardModelStrategy.policy_module` builds it)."""
    if not train_type_rules(job.train.train_type).reward_head:
        return model
    from astrai.models.reward import reward_model_of

    with torch.device("meta"):
        return reward_model_of(model, tokenizer)


def tied_aliases(model) -> dict[str, str]:
    """{alias: source} of the weights this model ties (e.g. lm_head.weight -> embed_tokens.weight).
    A critic has no lm_head, so nothing of it is tied."""
    if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "get_expanded_tied_weights_keys"):
        return {}
    return dict(model.get_expanded_tied_weights_keys(all_submodels=True))


def prepare_state(state: dict[str, torch.Tensor], model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Check `state` against the skeleton (names and shapes), drop tied aliases, cast to `dtype`.

    Casts one tensor at a time, releasing its fp32 original, so peak memory stays near one copy.
    """
    aliases = tied_aliases(model)
    for alias, source in aliases.items():
        if alias in state and source in state and not torch.equal(state[alias], state[source]):
            raise ExportError(
                f"{alias} and {source} differ in the checkpoint, but the config ties them (tie_word_embeddings)"
            )
        state.pop(alias, None)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items() if name not in aliases}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = [
        f"{name} {tuple(state[name].shape)} != {tuple(shape)}"
        for name, shape in expected.items()
        if name in state and state[name].shape != shape
    ]
    if missing or unexpected or wrong_shape:
        problems = [
            f"{label}: {', '.join(names)}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape))
            if names
        ]
        raise ExportError("checkpoint weights do not fit the job's architecture: " + "; ".join(problems))
    converted = {}
    for name in sorted(state):
        converted[name] = state.pop(name).to(dtype).contiguous()
    return converted


def part_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of one part: a portable form's fp32.safetensors as is (`python -m astrai
    convert`, or a resume on another topology), else DeepSpeed's own consolidation of its shards."""
    from astrai.resume.portable import INFO_FILE

    if (folder / INFO_FILE).is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "fp32.safetensors"))
    from astrai.engine import consolidated_state_dict

    return consolidated_state_dict(folder)


def load_weights(model, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Put the tensors into the meta skeleton (assign: no copy) and re-tie aliases to their source."""
    result = model.load_state_dict(state, strict=False, assign=True)
    leftover = [name for name in result.missing_keys if name not in tied_aliases(model)]
    if leftover or result.unexpected_keys:  # prepare_state checked already; this guards against drift
        raise ExportError(f"weights not loaded: missing {leftover}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    model.config.dtype = dtype
    model.config.use_cache = True  # a `model.path` config saved with gradient checkpointing may have it off


# ----------------------------------------------------------------------------- a LoRA run's parts


def lora_record(checkpoint: Path, part: str) -> dict | None:
    """The manifest's LoRA record of `part` ({"base", "settings"}), or None for a full fine-tuning part."""
    from astrai.checkpoint import CheckpointError, read_manifest

    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError:  # unreadable: the verification reported it already, or --no-verify asked to go on
        return None
    return ((manifest.meta.get("lora") or {}) if manifest is not None else {}).get(part)


def base_model(job, tokenizer, part: str) -> tuple[torch.nn.Module, dict]:
    """The part's base model with real weights (fp32, plain: no engine) and its identity. `load_start(model,
    path)`: puts `model.init_from_checkpoint`'s policy weights into the model (astrai/export/hf.py's)."""
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
                load_policy_state(model, model_config.init_from_checkpoint)
    except (ModelError, OSError, ValueError) as error:
        raise LoraError(f"cannot rebuild the base model of the job: {error}") from None
    return model, base_model_identity(model_config, job.train.seed, model)


def lora_model(job, tokenizer, checkpoint: Path, part: str, record: dict, state: dict, *, adapter: bool, dtype):
    """The part's base with the adapter weights `state` merged in, or (`adapter`) the PEFT model holding the
    adapter unmerged, in `dtype`. LoraError when the base differs from the one the manifest's `record` names,
    or the weights do not fit."""
    from astrai.config.schema import LoraSection

    model, identity = base_model(job, tokenizer, part)
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
        return wrapped
    merged = wrapped.merge_and_unload()
    merged.to(dtype)
    merged.config.dtype = dtype
    if hasattr(merged.config, "use_cache"):
        merged.config.use_cache = True
    return merged


def adapted_model(job, tokenizer, checkpoint: Path, part: str, lora: dict, *, adapter: bool, dtype):
    """A LoRA part's merged model (or, `adapter`, its unmerged PEFT model), with its errors as ExportError."""

    try:
        state = part_weights(checkpoint / part)
    except (OSError, ValueError, KeyError) as error:
        raise ExportError(f"cannot read the DeepSpeed weights in {checkpoint / part}: {error}") from None
    try:
        return lora_model(job, tokenizer, checkpoint, part, lora, state, adapter=adapter, dtype=dtype)
    except LoraError as error:
        raise ExportError(str(error)) from None


# ----------------------------------------------------------------------------- a policy for model.init_from_checkpoint


def policy_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's policy as full fp32 weights: its own, or for a LoRA run its base with the adapter merged
    (what `model.init_from_checkpoint` starts from)."""
    lora = lora_record(checkpoint, "policy")
    if lora is None:
        return part_weights(checkpoint / "policy")
    job = load_checkpoint_job(checkpoint)
    tokenizer = load_export_tokenizer(job, checkpoint, None)
    return dict(
        adapted_model(job, tokenizer, checkpoint, "policy", lora, adapter=False, dtype=torch.float32).state_dict()
    )


def load_policy_state(model, path: str | Path) -> None:
    """`policy_state` of the checkpoint `path` names (a step folder or an output_dir) into `model`."""
    state = prepare_state(policy_state(resolve_checkpoint(path)), model, torch.float32)
    load_weights(model, state, torch.float32)


def resolve_init_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: itself, or the newest one of an output_dir or checkpoints folder."""
    try:
        return resolve_checkpoint(path)
    except ExportError as error:
        raise ModelError(f"model.init_from_checkpoint: {error}") from None


def load_checkpoint_weights(model: torch.nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Copy the checkpoint's policy weights into `model` (built, not yet in an engine); returns the
    checkpoint. Names and shapes must match the model's exactly (tied aliases aside). `tokenizer`:
    the job's, refused when it differs from the one the checkpoint saved (its ids would mean other
    tokens)."""
    checkpoint = resolve_init_checkpoint(path)
    folder = checkpoint / "policy"
    if not folder.is_dir():
        raise ModelError(f"model.init_from_checkpoint: {checkpoint} has no policy/ folder")
    if tokenizer is not None:
        check_saved_tokenizer(tokenizer, checkpoint / TOKENIZER_DIR, "model.init_from_checkpoint")
    try:
        # A LoRA run's checkpoint holds its adapter only: its base with the adapter merged starts this run.
        state = prepare_state(policy_state(checkpoint), model, torch.float32)
    except ExportError as error:
        raise ModelError(f"model.init_from_checkpoint: {checkpoint}: {error}") from None
    result = model.load_state_dict(state, strict=False)  # copies into the model's tensors: ties stay tied
    missing = [name for name in result.missing_keys if name not in tied_aliases(model)]
    if missing or result.unexpected_keys:
        unexpected = result.unexpected_keys[:5]
        raise ModelError(f"model.init_from_checkpoint: not loaded: missing {missing[:5]}, unexpected {unexpected}")
    return checkpoint
