"""Hugging Face export: a checkpoint's consolidated weights -> a folder `from_pretrained` loads.

`python -m astrai export-hf <checkpoint> <destination>` (and `export.on_finish` at the end of a run).
`--part critic` writes an online_ppo critic in the layout of `astrai/models/value.py` (its trunk as a
transformers base-model folder, plus value_head.safetensors).
The policy is trained as an unchanged transformers module, so DeepSpeed's consolidated state dict
already uses Hugging Face parameter names: the "key map" of this adapter is the identity, except for
tied weights (`lm_head.weight` is an alias of the input embedding), which are dropped from the dict
and re-tied by transformers after loading.

Steps: verify the checkpoint against its manifest -> rebuild the architecture from the checkpoint's
`job.yaml` on the meta device (no second full copy of the weights) -> load the consolidated fp32
weights strictly, cast to the export dtype -> write safetensors shards, config, generation config and
tokenizer into a hidden staging folder -> one rename makes it visible. A crash at any point leaves
either no destination or the previous export, never a half-written folder under the destination name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from astrai import safe_write
from astrai.errors import AstraiError
from astrai.train_types import train_type_rules

logger = logging.getLogger("astrai.export")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARTS = ("policy", "critic")
LARGE_MODEL_BYTES = 2**30  # fp32 size above which the progress bar shows even when stderr is not a terminal


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


def set_generation_config(model, tokenizer, job) -> None:
    """Generation defaults of a `model.path` model when it has them; end/pad ids from the tokenizer."""
    from transformers import GenerationConfig

    if job.model.path is not None and (Path(job.model.path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(job.model.path, local_files_only=True)
    elif model.generation_config is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        model.generation_config.bos_token_id = tokenizer.bos_token_id


# ----------------------------------------------------------------------------- progress


def progress_bar(model, show: bool | None):
    """A bar over the export's four slow phases (consolidating the checkpoint's shards, casting, writing
    the safetensors shards, flushing them to disk), one tick each, named while in progress: each is one
    library call (DeepSpeed's zero_to_fp32, transformers' save_pretrained, whose own bars show progress
    inside it) or one pass over the files. `show` None: when stderr is a terminal or the fp32 weights
    exceed LARGE_MODEL_BYTES (so the log of a long export says where it is)."""
    from tqdm import tqdm

    if show is None:
        fp32_bytes = 4 * sum(parameter.numel() for parameter in model.parameters())  # meta tensors: sizes only
        show = sys.stderr.isatty() or fp32_bytes > LARGE_MODEL_BYTES
    # No rate or ETA: phases differ too much in length for either to mean anything.
    return tqdm(
        total=4,
        desc="export-hf",
        bar_format="{desc} |{bar:20}| {n_fmt}/{total_fmt} phases, {elapsed}",
        disable=not show,
    )


@contextlib.contextmanager
def phase(bar, name: str):
    bar.set_description_str(f"export-hf: {name}")
    yield
    bar.update()


# ----------------------------------------------------------------------------- crash-safe writing


def fsync_tree(folder: Path) -> None:
    """Every file and directory under `folder` on stable storage before the publishing rename.

    Also gives files the usual umask permissions: safetensors writes its files 0600, and an export
    is meant to be read by other users (a serving container, colleagues)."""
    umask = os.umask(0)
    os.umask(umask)
    for directory, _, names in os.walk(folder):
        for name in names:
            os.chmod(Path(directory) / name, 0o666 & ~umask)
    safe_write.fsync_tree(folder)


RUN_FOLDER_MARKERS = ("checkpoints", "metrics.jsonl", "job.yaml")  # what a training run writes into its output_dir


def check_destination(destination: Path, overwrite: bool) -> None:
    if destination.exists() and not destination.is_dir():
        raise ExportError(f"destination {destination} exists and is not a folder")
    if destination.is_dir() and any(destination.iterdir()):
        if not overwrite:
            raise ExportError(f"destination {destination} is not empty (use --overwrite to replace it)")
        refuse_to_replace_training_output(destination)


def refuse_to_replace_training_output(destination: Path) -> None:
    """--overwrite replaces an earlier export, never a run: refuse a destination that is a run folder
    (an output_dir) or holds a checkpoint anywhere below (a manifest.json of the checkpoint format, or
    a legacy checkpoint's trainer_state.json), naming what was found. Nothing is deleted before this."""
    markers = [name for name in RUN_FOLDER_MARKERS if (destination / name).exists()]
    if markers:
        raise ExportError(
            f"destination {destination} is a training run's folder (it holds {', '.join(markers)}); --overwrite "
            "replaces only an earlier export: choose another destination, e.g. a new folder beside it"
        )
    found = checkpoint_below(destination)
    if found is not None:
        raise ExportError(
            f"destination {destination} holds a checkpoint ({found}); --overwrite replaces only an earlier export: "
            "choose another destination"
        )


def checkpoint_below(folder: Path) -> Path | None:
    """The first checkpoint file found in or below `folder`: an astrai-checkpoint manifest.json or a
    trainer_state.json (legacy checkpoints have no manifest); None when there is none."""
    from astrai.checkpoint import MANIFEST_FORMAT, MANIFEST_NAME

    for root, _folders, files in os.walk(folder):
        if MANIFEST_NAME in files:
            manifest = Path(root) / MANIFEST_NAME
            try:
                document = json.loads(manifest.read_bytes())
            except (OSError, ValueError):
                return manifest  # unreadable: treat as a checkpoint rather than risk deleting one
            if isinstance(document, dict) and document.get("format") == MANIFEST_FORMAT:
                return manifest
        if "trainer_state.json" in files:
            return Path(root) / "trainer_state.json"
    return None


def remove_stale_staging(destination: Path) -> None:
    """Staging folders of crashed exports to the same destination: never loadable, only disk space."""
    for stale in safe_write.stale_staging(destination):
        logger.warning("removing %s, left by an interrupted export", stale)
        shutil.rmtree(stale, ignore_errors=True)


def write_files(model, tokenizer, staging: Path, max_shard_size: str) -> None:
    """config.json, generation_config.json, safetensors shards (+ index past max_shard_size), tokenizer."""
    model.save_pretrained(staging, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(staging)


def publish(staging: Path, destination: Path, overwrite: bool) -> None:
    """Make `staging` the destination by rename. Replacing: old aside, new in, old removed, so that
    the destination name always holds one complete export (or, for an instant, none)."""
    check_destination(destination, overwrite)  # again: another process may have written meanwhile
    fsync_tree(staging)
    safe_write.swap_in(staging, destination)


def write_export(
    model, tokenizer, destination: Path, overwrite: bool, max_shard_size: str | int, bar, finish=None
) -> None:
    """Write the export into a hidden staging folder beside `destination`, then publish it by rename;
    on any failure the staging folder goes, and the destination is as it was."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(destination)
    with safe_write.staging_folder(destination) as staging:
        with phase(bar, "writing shards"):
            write_files(model, tokenizer, staging, max_shard_size)
            if finish is not None:  # an rm export adds reward_stats.json, measured on the written folder
                finish(staging)
        with phase(bar, "flushing to disk"):
            publish(staging, destination, overwrite)


# ----------------------------------------------------------------------------- entry points


def export_checkpoint(
    checkpoint_dir: str | Path,
    destination: str | Path,
    *,
    dtype: str = "fp32",
    part: str = "policy",
    verify: bool = True,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    tokenizer_dir: str | Path | None = None,
    progress: bool | None = None,
    adapter: bool = False,
) -> Path:
    """Export one checkpoint's `part` as a Hugging Face folder at `destination`; returns its path.
    `progress`: show the progress bar (None: when stderr is a terminal or the model is large).
    A LoRA run's part is merged into its base (astrai/export_lora.py); `adapter`: PEFT's adapter folder instead."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: unknown dtype {dtype!r} (use one of {', '.join(DTYPES)})")
    checkpoint, destination = Path(checkpoint_dir), Path(destination)
    check_checkpoint(checkpoint, part, verify)
    check_destination(destination, overwrite)  # fail before the slow part
    job = load_checkpoint_job(checkpoint)
    tokenizer = load_export_tokenizer(job, checkpoint, tokenizer_dir)
    from astrai.export_lora import lora_record

    lora = lora_record(checkpoint, part)
    if adapter and lora is None:
        raise ExportError(
            f"--adapter: the {part} of {checkpoint} has no LoRA adapter (its run trained every weight, without "
            f"{'model' if part == 'policy' else 'critic'}.lora): export it without --adapter"
        )
    if adapter and part == "critic":
        raise ExportError("--adapter: a critic's adapter has no PEFT base class to load it into; export it merged")
    if lora is not None:
        return export_lora_part(
            job, tokenizer, checkpoint, destination, part, lora, adapter, dtype, overwrite, max_shard_size
        )
    model = critic_skeleton(job, tokenizer) if part == "critic" else build_skeleton(job, tokenizer)
    if part == "policy":  # what the policy engine trained (rm: a scalar head on the trunk)
        model = policy_skeleton(job, model, tokenizer)
    bar = progress_bar(model, progress)
    try:
        with phase(bar, "consolidating weights"):
            try:
                state = part_weights(checkpoint / part)
            except (OSError, ValueError, KeyError) as error:
                raise ExportError(f"cannot read the DeepSpeed weights in {checkpoint / part}: {error}") from None
        with phase(bar, f"casting to {dtype}"):
            load_weights(model, prepare_state(state, model, DTYPES[dtype]), DTYPES[dtype])
        finish = None
        if part == "policy" and train_type_rules(job.train.train_type).reward_head:  # a sequence classifier
            from astrai.reward_export import export_classifier

            model, finish = export_classifier(model, job, tokenizer)
        elif part == "policy":
            set_generation_config(model, tokenizer, job)
        write_export(model, tokenizer, destination, overwrite, max_shard_size, bar, finish)
    finally:
        bar.close()
    logger.info("exported %s (%s, %s) to %s", checkpoint, part, dtype, destination)
    return destination


def export_lora_part(job, tokenizer, checkpoint, destination, part, lora, adapter, dtype, overwrite, max_shard_size):
    """A LoRA part: its base rebuilt, the adapter merged into it (or, `adapter`, PEFT's adapter folder)."""
    model = adapted_model(job, tokenizer, checkpoint, part, lora, adapter=adapter, dtype=DTYPES[dtype])
    if part == "policy" and not adapter:
        set_generation_config(model, tokenizer, job)
    write_export(model, tokenizer, destination, overwrite, max_shard_size, progress_bar(model, False))
    kind = "PEFT adapter" if adapter else "LoRA merged into its base"
    logger.info("exported %s (%s, %s, %s) to %s", checkpoint, part, kind, dtype, destination)
    return destination


def adapted_model(job, tokenizer, checkpoint: Path, part: str, lora: dict, *, adapter: bool, dtype):
    """A LoRA part's merged model (or adapter folder), astrai/export_lora.py's, with its errors as ExportError."""
    from astrai.export_lora import lora_export_model
    from astrai.models.lora import LoraError

    try:
        state = part_weights(checkpoint / part)
    except (OSError, ValueError, KeyError) as error:
        raise ExportError(f"cannot read the DeepSpeed weights in {checkpoint / part}: {error}") from None
    try:
        return lora_export_model(
            job, tokenizer, checkpoint, part, lora, state, adapter=adapter, dtype=dtype, load_start=load_policy_state
        )
    except LoraError as error:
        raise ExportError(str(error)) from None


def policy_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's policy as full fp32 weights: its own, or for a LoRA run its base with the adapter merged
    (what `model.init_from_checkpoint` starts from)."""
    from astrai.export_lora import lora_record

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


def export_finished_run(job) -> Path:
    """`export.on_finish` (rank 0, after training): the run's newest checkpoint to `export.hf_dir`,
    replacing an earlier export; the bar follows `runtime.progress_bar`.

    Not re-verified, the one exception to "export reads only verified checkpoints": this process has
    just published that checkpoint (files hashed into its manifest, then renamed into place), so hashing
    it again would re-read what it wrote seconds ago and add minutes to every large run. A relaunch of a
    finished run trains no step and exports the checkpoint it resumed from instead; the files its resume
    loaded were compared with the manifest as they loaded (`checkpoint.verify_on_load`, on by default).
    """
    from astrai.checkpoint import find_latest

    if job.export.hf_dir is None:
        raise ExportError("export.on_finish needs export.hf_dir")
    checkpoint = find_latest(Path(job.output_dir) / "checkpoints")
    if checkpoint is None:
        raise ExportError(f"export.on_finish: no checkpoint in {job.output_dir}/checkpoints to export")
    progress = None if job.runtime.progress_bar else False
    return export_checkpoint(
        checkpoint, job.export.hf_dir, dtype=job.export.dtype, verify=False, overwrite=True, progress=progress
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m astrai export-hf", description="Export a checkpoint as a Hugging Face model folder."
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint (step_<N>), a checkpoints folder or an output_dir (its newest checkpoint)"
    )
    parser.add_argument("destination", help="folder to create (must be absent or empty unless --overwrite)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the exported weights (default fp32)"
    )
    parser.add_argument(
        "--part", choices=PARTS, default="policy", help="which model of the checkpoint (default policy)"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip re-hashing the checkpoint against its manifest")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export (atomically); a run folder or a folder holding a checkpoint is refused",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)"
    )
    parser.add_argument("--tokenizer-dir", default=None, help="tokenizer folder (default: the run's own)")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write PEFT's adapter folder (PeftModel.from_pretrained) instead of the merged model",
    )
    parser.add_argument(
        "--best", action="store_true", help="the best checkpoint by the run's checkpoint.keep_best, not the newest"
    )
    return parser.parse_args(argv)


def export_main(argv: list[str]) -> int:
    """`python -m astrai export-hf ...`: 0 exported, 1 failed (one line on stderr), 2 bad arguments."""
    try:
        args = parse_args(argv)
    except SystemExit as exit_request:  # argparse exits on bad arguments and --help; return its status
        return int(exit_request.code or 0)
    logging.basicConfig(level=logging.INFO, format="astrai export-hf: %(message)s")
    from astrai.best_checkpoint import find_best

    try:
        # stdout carries the destination alone (`dest=$(python -m astrai export-hf ...)`); DeepSpeed prints
        # its consolidation steps and import warnings there, so those go to stderr with the log.
        with contextlib.redirect_stdout(sys.stderr):
            checkpoint = find_best(args.checkpoint) if args.best else resolve_checkpoint(args.checkpoint)
            path = export_checkpoint(
                checkpoint,
                args.destination,
                dtype=args.dtype,
                part=args.part,
                verify=not args.no_verify,
                overwrite=args.overwrite,
                max_shard_size=args.max_shard_size,
                tokenizer_dir=args.tokenizer_dir,
                adapter=args.adapter,
            )
    except (AstraiError, OSError, ValueError) as error:  # the checkpoint's, the tokenizer's, the model's
        message = " ".join(str(error).split())  # one line, whatever the wrapped error looked like
        print(f"astrai export-hf: {message}", file=sys.stderr)
        return 1
    print(path)
    return 0
