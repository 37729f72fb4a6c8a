"""Resume on a different topology: world size, ZeRO stage or precision changed since the checkpoint.

DeepSpeed's shard files only load into the world size and ZeRO stage that wrote them. A checkpoint's
manifest records that topology (`meta`: `world_size`, `zero_stage` and `precision` per engine);
when the resuming run differs, the checkpoint is converted once into the portable form
(`astrai/resume/portable.py`: full fp32 weights and Adam moments per engine, no partitions), published
through the checkpoint publisher next to the original:

```
<checkpoints>/step_00000500/             the original, never modified
<checkpoints>/portable/step_00000500/    its portable form: same parts, trainer_state.json, job.yaml;
                                         manifest meta "layout": "portable" and "source" (which original)
```
`find_latest` never takes `portable/` for a checkpoint (not a `step_<N>` name); a later resume
reuses the portable copy when its manifest names the same original (hash of the original's
manifest.json) and it verifies. A crash during conversion leaves a hidden staging folder inside
`portable/` (removed at the next attempt) and the original untouched. Every engine part of the
checkpoint converts (`policy`, `critic`, ...), whatever the train type.

What cannot carry over exactly (see docs/guides/checkpoints.md, "Resuming on a different topology"):
the data position continues from the global sample count, rounded up to the new global micro-batch
(micro_batch_size x world size) when it is not a multiple; per-rank RNG (Python's `random`, numpy,
torch) is reseeded from (seed, step, rank) when the world size changed. Both rules are logged once, by
rank 0, at every resume where the world size or train.micro_batch_size changed (checkpointing.carry_over).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import sys
from pathlib import Path

from astrai.checkpoint import CheckpointError, CheckpointPublisher, find_latest, read_manifest, verify_checkpoint
from astrai.checkpoint.layout import DERIVED_DIRS
from astrai.checkpoint.manifest import MANIFEST_NAME

logger = logging.getLogger("astrai.topology")

PORTABLE_DIR = DERIVED_DIRS[0]  # "portable"; retention removes a portable form with its checkpoint
LAYOUT = "portable"
SCRATCH = ".convert-scratch"  # inside the staging folder: removed before the publish, or with the staging folder


def portable_path(checkpoint: Path) -> Path:
    """Where the portable form of `<checkpoints>/step_<N>` goes: `<checkpoints>/portable/step_<N>`."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / PORTABLE_DIR / checkpoint.name


def is_portable(manifest) -> bool:
    return manifest is not None and manifest.meta.get("layout") == LAYOUT


def recorded_topology(manifest) -> dict:
    """{"world_size": W, "zero_stage": {part: S}, "precision": {part: P}} as the checkpoint's manifest records it."""
    meta = manifest.meta
    return {
        "world_size": meta.get("world_size", manifest.world_size),
        "zero_stage": meta.get("zero_stage") or {},
        "precision": meta.get("precision") or {},
    }


def describe_change(recorded: dict, current: dict) -> str | None:
    """What differs between two topologies (parts absent from either side are not compared), or None."""
    changes = []
    if recorded["world_size"] != current["world_size"]:
        changes.append(f"world size {recorded['world_size']} -> {current['world_size']}")
    for field, label in (("zero_stage", "ZeRO-"), ("precision", "")):
        for part in sorted(set(recorded[field]) & set(current[field])):
            before, after = recorded[field][part], current[field][part]
            if before != after:
                changes.append(f"{part} {label}{before} -> {label}{after}")
    return "; ".join(changes) or None


def continue_position(consumed_samples: int, samples_per_micro_step: int) -> int:
    """The data position rule: continue from the global sample count, rounded up to a multiple of
    this run's global micro-batch (micro_batch_size x world size, the unit of the sample order)."""
    aligned = -(-consumed_samples // samples_per_micro_step) * samples_per_micro_step
    if aligned != consumed_samples:
        logger.warning(
            "data position: %d samples consumed is not a multiple of this run's global micro-batch of %d: "
            "continuing from sample %d (%d samples skipped)",
            consumed_samples,
            samples_per_micro_step,
            aligned,
            aligned - consumed_samples,
        )
    return aligned


def _manifest_digest(checkpoint: Path) -> str:
    return hashlib.sha256((Path(checkpoint) / MANIFEST_NAME).read_bytes()).hexdigest()


def engine_parts(checkpoint: Path, manifest) -> list[str]:
    """The parts holding a DeepSpeed engine (those with a ZeRO stage recorded, else with a tag folder)."""
    from astrai.engine import DS_TAG

    recorded = set(manifest.meta.get("zero_stage") or {})
    return [part for part in manifest.parts if part in recorded or (Path(checkpoint) / part / DS_TAG).is_dir()]


def reusable(destination: Path, digest: str, *, digests: bool) -> bool:
    """True when `destination` is a published portable form of the checkpoint whose manifest hashes to `digest`."""
    if not destination.is_dir():
        return False
    try:
        manifest = read_manifest(destination)
        if not is_portable(manifest) or manifest.meta.get("source", {}).get("manifest_sha256") != digest:
            logger.warning("%s is not the portable form of this checkpoint: converting again", destination)
            return False
        verify_checkpoint(destination, digests=digests)
    except CheckpointError as error:
        logger.warning("cannot reuse %s (%s): converting again", destination, error)
        return False
    return True


def _write_portable(checkpoint: Path, staging: Path, parts: list[str]) -> None:
    """Rank 0's write: each engine part converted, every other file or folder copied as it is."""
    from astrai.engine import DS_TAG
    from astrai.resume.portable import write_portable_part

    for entry in sorted(checkpoint.iterdir()):
        if entry.name in parts or entry.name == MANIFEST_NAME:
            continue
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, staging / entry.name)
    for part in parts:
        write_portable_part(checkpoint / part, staging / part, staging / SCRATCH / part, DS_TAG)
    shutil.rmtree(staging / SCRATCH, ignore_errors=True)


def convert(
    checkpoint: Path,
    *,
    is_main: bool = True,
    verify: bool = False,
    timeout_s: float = 600.0,
    target: dict | None = None,
) -> Path:
    """Publish the portable form of `checkpoint` (or reuse a valid one) and return its path.

    Every rank calls it (the publisher's phases are collective); rank 0 reads and writes, the
    others only hash their share. `verify`: check the digests of a portable copy before reusing it
    (its sizes are always checked). `target` (e.g. {"world_size": 8}) is only recorded.
    """
    from astrai.engine import all_gather_objects

    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise CheckpointError(f"{checkpoint} has no manifest: its topology is unknown, so it cannot be converted")
    if is_portable(manifest):
        return checkpoint
    destination, digest = portable_path(checkpoint), _manifest_digest(checkpoint)
    publisher = CheckpointPublisher(
        destination.parent, parts=manifest.parts, hash_algorithm=manifest.hash_algorithm, timeout_s=timeout_s
    )
    publisher.cleanup_stale()  # a conversion that crashed left only a hidden staging folder
    # Rank 0 decides for all: ranks that saw the folder differently would not call publish together.
    if all_gather_objects(reusable(destination, digest, digests=verify) if is_main else None)[0]:
        logger.info("reusing the portable form %s of %s", destination, checkpoint)
        return destination
    parts = engine_parts(checkpoint, manifest)
    source = {"checkpoint": str(checkpoint), "manifest_sha256": digest, **recorded_topology(manifest)}
    meta = {key: value for key, value in manifest.meta.items() if key not in ("world_size", "zero_stage", "precision")}
    meta.update(layout=LAYOUT, source=source, **({"target": target} if target else {}))

    def write(staging: Path) -> None:
        if is_main:
            _write_portable(checkpoint, staging, parts)

    report = publisher.publish(manifest.step, write, meta=meta)
    logger.info("converted %s (%s) into %s in %.1f s", checkpoint, ", ".join(parts), report.path, report.seconds)
    return report.path


def current_topology(run) -> dict:
    engines = run.engines
    return {
        "world_size": run.dist.world_size,
        "zero_stage": {name: engine.zero_stage for name, engine in engines.items()},
        "precision": {name: engine.precision for name, engine in engines.items()},
    }


def resume_source(run, path: Path, manifest) -> Path | None:
    """The hook of `TrainingCheckpoints._load`: None to load the checkpoint's DeepSpeed files as
    they are, or the portable form to load instead (converted now if the topology changed)."""
    if manifest is None:  # legacy or plain DeepSpeed: no record of the topology that wrote it
        return None
    if is_portable(manifest):
        logger.info("%s is a portable checkpoint: it loads on any topology", path)
        return Path(path)
    change = describe_change(recorded_topology(manifest), current_topology(run))
    if change is None:
        return None
    logger.warning("resuming on a different topology (%s): converting %s once to its portable form", change, path)
    config = run.job.checkpoint
    return convert(path, is_main=run.dist.is_main, verify=config.verify_on_load, timeout_s=config.save_timeout_s)


def load_portable_part(engine, folder: Path) -> None:
    """Load one engine from a portable part folder (every rank)."""
    from astrai.resume.portable import PortableError, PortablePart

    try:
        engine.load_full_state(PortablePart(folder))
    except (PortableError, ValueError, KeyError) as error:
        raise CheckpointError(f"cannot load {folder} into this engine: {error}") from error


def _resolve(argument: str) -> Path:
    """A checkpoint directory, or a run's output_dir / checkpoints folder (its newest checkpoint)."""
    path = Path(argument)
    if (path / MANIFEST_NAME).is_file():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    latest = find_latest(folder)
    if latest is None:
        raise CheckpointError(f"{argument}: no checkpoint found (a step_<N> folder with a manifest, or an output_dir)")
    return latest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m astrai convert",
        description="Write a checkpoint's portable form (full fp32 weights and Adam moments per engine) into "
        "<checkpoints>/portable/step_<N>/, so a resume on another world size or ZeRO stage loads it without "
        "converting. The portable form loads on any topology: --world-size and --zero-stage are only checked and "
        "recorded.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint folder (step_<N>), or a run's output_dir for its newest checkpoint"
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="the world size you will resume on (recorded only)"
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="the ZeRO stage you will resume with (recorded only)",
    )
    return parser


def convert_main(argv: list[str]) -> int:
    """`python -m astrai convert <checkpoint> [--world-size N] [--zero-stage S]`: 0 done, 1 failed, 2 usage."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")  # exits with status 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    target = {
        key: value
        for key, value in (("world_size", args.world_size), ("zero_stage", args.zero_stage))
        if value is not None
    }
    try:
        checkpoint = _resolve(args.checkpoint)
        verify_checkpoint(checkpoint, digests=False)  # the listing and sizes: a damaged original is not converted
        print(convert(checkpoint, target=target or None))
    except (CheckpointError, OSError, ValueError) as error:
        print(f"astrai convert: {error}", file=sys.stderr)
        return 1
    return 0
