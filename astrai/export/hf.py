"""Hugging Face export: a checkpoint's weights (read by astrai/export/weights.py) -> a folder `from_pretrained` loads.

`python -m astrai export-hf` (astrai/export/cli.py) and `export.on_finish` at the end of a run call
`export_checkpoint`. `--part critic` writes an online_ppo critic in the layout of `astrai/models/value.py`
(its trunk as a transformers base-model folder, plus value_head.safetensors).

Steps: verify the checkpoint against its manifest -> rebuild the architecture from the checkpoint's
`job.yaml` on the meta device (no second full copy of the weights) -> load the consolidated fp32
weights strictly, cast to the export dtype -> write safetensors shards, config, generation config and
tokenizer into a hidden staging folder -> one rename makes it visible. A crash at any point leaves
either no destination or the previous export, never a half-written folder under the destination name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from astrai import safe_write
from astrai.export.weights import (
    DTYPES,
    ExportError,
    adapted_model,
    build_skeleton,
    check_checkpoint,
    critic_skeleton,
    load_checkpoint_job,
    load_export_tokenizer,
    load_weights,
    lora_record,
    part_weights,
    policy_skeleton,
    prepare_state,
)
from astrai.train_types import train_type_rules

logger = logging.getLogger("astrai.export")

LARGE_MODEL_BYTES = 2**30  # fp32 size above which the progress bar shows even when stderr is not a terminal


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


class AdapterFolder:
    """What `write_export` saves for `--adapter`: PEFT's adapter folder (no shards of the base)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def save_pretrained(self, folder, max_shard_size=None) -> None:
        self.model.save_pretrained(str(folder))


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
    A LoRA run's part is merged into its base (astrai/export/weights.py); `adapter`: PEFT's adapter folder instead."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: unknown dtype {dtype!r} (use one of {', '.join(DTYPES)})")
    checkpoint, destination = Path(checkpoint_dir), Path(destination)
    check_checkpoint(checkpoint, part, verify)
    check_destination(destination, overwrite)  # fail before the slow part
    job = load_checkpoint_job(checkpoint)
    tokenizer = load_export_tokenizer(job, checkpoint, tokenizer_dir)
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
            from astrai.export.reward import export_classifier

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
    if adapter:
        model = AdapterFolder(model)
    elif part == "policy":
        set_generation_config(model, tokenizer, job)
    write_export(model, tokenizer, destination, overwrite, max_shard_size, progress_bar(model, False))
    kind = "PEFT adapter" if adapter else "LoRA merged into its base"
    logger.info("exported %s (%s, %s, %s) to %s", checkpoint, part, kind, dtype, destination)
    return destination


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
