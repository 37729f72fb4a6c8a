"""The trainer's side of checkpoints: what goes into one, and how a run resumes from it.

`astrai/checkpoint/` publishes and verifies directories and knows nothing of training; this module
decides the content: one DeepSpeed folder per engine (`policy/`, online_ppo's `critic/`), the trainer
state (step, data position, per-rank RNG) and the resolved job.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy
import torch

from astrai.checkpoint import (
    CheckpointError, CheckpointPublisher, FileDigest, StreamedFiles, find_latest, read_manifest, require_parts, step_dir_name,
    verify_checkpoint,
)
from astrai.config import dump_job, parse_yaml
from astrai.engine import all_gather_objects, barrier
from astrai.metrics import METRICS_FILE, trim_metrics
from astrai.models.tokenizer import TOKENIZER_DIR, check_saved_tokenizer
from astrai.topology import continue_position, load_portable_part, resume_source

logger = logging.getLogger("astrai.checkpointing")

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0
    consumed_samples: int = 0
    epoch: int = 0
    policy_version: int = 0
    elapsed_s: float = 0.0
    world_size: int = 1
    rng: list[str] = field(default_factory=list)  # one encoded RNG snapshot per rank
    strategy: dict = field(default_factory=dict)  # the strategy's own state (online_ppo: the KL controller)


def capture_rng() -> str:
    snapshot = {"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        snapshot["cuda"] = torch.cuda.get_rng_state()
    return base64.b64encode(pickle.dumps(snapshot)).decode()


def restore_rng(encoded: str) -> None:
    snapshot = pickle.loads(base64.b64decode(encoded))
    random.setstate(snapshot["python"])
    numpy.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch"])
    if "cuda" in snapshot and torch.cuda.is_available():
        torch.cuda.set_rng_state(snapshot["cuda"])


def reseed_rng(seed: int, step: int, rank: int) -> int:
    """Per-rank RNG where the saved per-rank states cannot carry over (another world size): Python's
    `random`, numpy and torch (every device) all from seed x 7919 + step x 31 + rank, so a rerun of the
    same resume draws the same numbers and no two ranks share a stream. Returns that value."""
    value = seed * 7919 + step * 31 + rank
    random.seed(value)
    numpy.random.seed(value % 2**32)  # numpy takes 32-bit seeds only
    torch.manual_seed(value)
    return value


def saved_micro_batch_size(path: Path) -> int | None:
    """train.micro_batch_size of the job that wrote the checkpoint (its job.yaml), or None when unknown."""
    try:
        return int(parse_yaml((path / "job.yaml").read_text())["train"]["micro_batch_size"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def carry_over(state: TrainerState, *, rank: int, world_size: int, seed: int, samples_per_micro_step: int, micro_batch_size: int, saved_micro_batch: int | None) -> None:
    """`micro_batch_size`, `saved_micro_batch`: train.micro_batch_size of this job and of the one that saved.

    Restore what the checkpoint holds exactly for this topology, and apply the stated rules to what it
    cannot: the data position and the per-rank RNG. When the world size or the micro-batch changed,
    rank 0 logs each rule once with the values it used (docs/guides/checkpoints.md)."""
    world_changed = state.world_size != world_size
    changed = world_changed or (saved_micro_batch is not None and saved_micro_batch != micro_batch_size)
    reseeded = world_changed or len(state.rng) != world_size
    if reseeded:
        base = reseed_rng(seed, state.step, rank) - rank
    else:
        restore_rng(state.rng[rank])
    consumed = state.consumed_samples
    state.consumed_samples = continue_position(consumed, samples_per_micro_step)
    if rank != 0:
        return
    if changed:
        logger.warning(
            "data position: continuing from global sample count %d (rule: the global sample count carries over, rounded up to "
            "this run's global micro-batch of %d samples = %d per rank x world size %d; world size %d -> %d, "
            "train.micro_batch_size %s -> %d, %d samples consumed)", state.consumed_samples, samples_per_micro_step,
            samples_per_micro_step // world_size, world_size, state.world_size, world_size,
            "unknown" if saved_micro_batch is None else saved_micro_batch, micro_batch_size, consumed,
        )
    if reseeded:
        why = f"world size changed ({state.world_size} -> {world_size})" if world_changed else f"{len(state.rng)} RNG states saved for {world_size} ranks"
        logger.warning(
            "RNG reseeded per rank from (seed, step, rank): %s (rule: per-rank RNG state cannot carry over; python random, "
            "numpy and torch of rank r seeded with seed*7919 + step*31 + r = %d + r)", why, base,
        )
    elif changed:
        logger.warning("RNG: each rank's saved state restored (rule: the world size is unchanged, so rank r continues its own stream)")


def saved_job_value(path: Path, section: str, key: str):
    """`section.key` of the job that wrote the checkpoint (its job.yaml), or None when unknown."""
    try:
        return parse_yaml((path / "job.yaml").read_text())[section][key]
    except (OSError, ValueError, TypeError, KeyError):
        return None


def check_same_job(run, path: Path, manifest) -> None:
    """A resume continues the job that wrote the checkpoint: refuse another train type (its optimizer
    moments and data position belong to another objective) and another tokenizer (token ids would
    change meaning), before anything is loaded."""
    if manifest is not None:
        saved_type = manifest.meta.get("train_type")
    else:  # legacy: its job.yaml says
        saved_type = saved_job_value(path, "train", "train_type")
    train_type = run.job.train.train_type
    if saved_type is not None and saved_type != train_type:
        raise CheckpointError(
            f"{path} is a {saved_type} checkpoint and this job is {train_type}: a resume continues the same "
            f"train type. To start {train_type} from its weights, set model.init_from_checkpoint: {path} "
            "(with a new output_dir)"
        )
    context = f"resuming from {path} (a different tokenizer cannot resume)"
    if not check_saved_tokenizer(run.tokenizer, path / TOKENIZER_DIR, context):
        logger.warning(
            "%s has no %s/ (written by an earlier version): this job's tokenizer cannot be compared with its own",
            path, TOKENIZER_DIR,
        )


def continue_schedule(run, path: Path, step: int) -> None:
    """Each engine's LR at the resumed position, from this job's schedule. DeepSpeed restores the
    optimizer's lr as the checkpoint's schedule left it (after a decay to its end: often 0); the job's
    schedule (over its own total: train.max_steps may have grown) only takes over one update later.
    Setting it now makes the step after the resume follow this job's schedule, without a jump."""
    manifest = read_manifest(path)
    saved_total = manifest.meta.get("total_steps") if manifest is not None else None
    for name, engine in run.engines.items():
        before, after = engine.continue_schedule()
        if run.dist.rank != 0:
            continue
        if saved_total not in (None, run.total_steps) and name == "policy":
            logger.warning(
                "LR schedule: the checkpoint's run spanned %d steps, this job %d: the schedule continues over %d steps "
                "(%s lr for step %d: %.4g, where the checkpoint's schedule gave %.4g)", saved_total, run.total_steps,
                run.total_steps, name, step + 1, after, before,
            )
        elif before != after:
            logger.warning(
                "LR schedule: %s lr for step %d is %.4g from this job's schedule (the checkpoint's gave %.4g)",
                name, step + 1, after, before,
            )


def is_plain_deepspeed_dir(path: Path) -> bool:
    """A folder written by DeepSpeed's own `save_checkpoint` (a `latest` file or tag folders of shards)."""
    return (path / "latest").is_file() or any(path.glob("*/*model_states.pt"))


class TrainingCheckpoints:
    def __init__(self, run):
        self.run = run
        self.directory = run.output_dir / "checkpoints"
        config = run.job.checkpoint
        self.publisher = CheckpointPublisher(
            self.directory, parts=sorted(run.engines), hash_algorithm=config.hash, keep_last=config.keep_last, timeout_s=config.save_timeout_s
        )

    def due(self, step: int, total_steps: int) -> bool:
        every = self.run.job.checkpoint.every_steps
        return step == total_steps or (every is not None and step % every == 0)

    def save(self, state: TrainerState, metrics, *, final: bool) -> Path:
        """Publish checkpoint `state.step`; with checkpoint.async_save (not for the final one) return once the
        shards are written, leaving hashing, fsync and the publishing rename to a background thread."""
        run = self.run
        state.world_size = run.dist.world_size
        state.rng = all_gather_objects(capture_rng())

        background = run.job.checkpoint.async_save and not final
        # DeepSpeed's shards go out in one pass: sent to the disk while serialised and, unless the hashing
        # is left to the background save (async), hashed on their way out rather than read back later.
        streamed = StreamedFiles(None if background else self.publisher.hash_algorithm)

        def write(staging: Path) -> dict[str, FileDigest]:
            for name, engine in run.engines.items():
                engine.save(staging / name, open_file=streamed.open)
            if run.dist.is_main:
                (staging / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
                (staging / "job.yaml").write_text(dump_job(run.job))
                # Self-contained: the ids this checkpoint trained on mean this tokenizer's tokens.
                run.tokenizer.save_pretrained(staging / TOKENIZER_DIR)
            return streamed.digests_under(staging)

        meta = {
            "train_type": run.job.train.train_type,
            "zero_stage": {name: engine.zero_stage for name, engine in run.engines.items()},
            "precision": {name: engine.precision for name, engine in run.engines.items()},
            "world_size": run.dist.world_size,
            "total_steps": run.total_steps,  # the schedule's length; a resume with another one says so
            **run.strategy.checkpoint_meta(),
        }
        if background:
            metrics.flush()  # durable before the checkpoint it describes can appear (the rename comes later)
            self.publisher.publish_async(state.step, write, meta=meta)
            return self.directory / step_dir_name(state.step)
        # The metric log is made durable just before the rename that publishes the checkpoint it describes.
        report = self.publisher.publish(state.step, write, meta=meta, pre_publish=metrics.flush)
        return report.path

    def close(self) -> None:
        """End of a loop, which may be failing: let a background save finish (every rank's thread goes on
        whatever the training collectives do) and log its error rather than hide the loop's own."""
        step = self.publisher.pending_step
        try:
            self.publisher.wait()
        except CheckpointError as error:
            logger.error("the background save of step %s did not publish: %s", step, error)

    def locate(self) -> Path | None:
        """The checkpoint this run resumes from, or None for a fresh start."""
        choice = self.run.job.checkpoint.resume
        if choice == "never":
            return None
        if choice == "auto":
            return find_latest(self.directory)
        path = Path(choice)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume: {choice!r} is not a directory")
        return path

    def resume(self) -> TrainerState:
        run = self.run
        self.publisher.cleanup_stale()  # every rank calls; rank 0 removes leftovers of a crash
        path = self.locate()
        state = TrainerState(world_size=run.dist.world_size)
        if path is not None:
            state = self._load(path)
            continue_schedule(run, path, state.step)
        if run.dist.is_main:
            dropped = trim_metrics(run.output_dir / METRICS_FILE, state.step)
            if dropped:
                logger.info("trimmed %d metric records past step %d from %s", dropped, state.step, METRICS_FILE)
        barrier()
        return state

    def _load(self, path: Path) -> TrainerState:
        run = self.run
        manifest = read_manifest(path)
        check_same_job(run, path, manifest)
        required = run.strategy.parts_to_resume(path)
        plain_deepspeed = manifest is None and is_plain_deepspeed_dir(path) and len(required) == 1
        if not plain_deepspeed:
            require_parts(path, required)  # names the missing part before any training step
        if manifest is None:
            logger.warning("%s has no manifest (a legacy or plain DeepSpeed checkpoint): loading it unverified", path)
        elif run.job.checkpoint.verify_on_load:
            report = verify_checkpoint(path)
            logger.info("verified %s: %d files, %d bytes in %.2f s", path, report.files, report.bytes, report.seconds)
        # A different world size, ZeRO stage or precision: DeepSpeed's shards cannot load as they are.
        portable = resume_source(run, path, manifest)
        for name in required:
            if portable is not None:
                load_portable_part(run.engines[name], portable / name)
            else:
                run.engines[name].load(path if plain_deepspeed else path / name)
        state_file = path / STATE_FILE
        if state_file.is_file():
            state = TrainerState(**json.loads(state_file.read_text()))
        else:  # plain DeepSpeed checkpoint: the step is all it knows
            step = run.engines["policy"].global_steps
            state = TrainerState(step=step, consumed_samples=step * run.samples_per_step, policy_version=step)
            logger.warning("no %s in %s: continuing from step %d, data position derived from it", STATE_FILE, path, step)
        order = getattr(run.strategy, "order", run.order)
        carry_over(
            state, rank=run.dist.rank, world_size=run.dist.world_size, seed=run.job.train.seed, samples_per_micro_step=order.samples_per_micro_step,
            micro_batch_size=run.job.train.micro_batch_size, saved_micro_batch=saved_micro_batch_size(path),
        )
        state.epoch = run.order.epoch_of(state.consumed_samples)
        logger.info("resumed from %s at step %d (%d samples consumed)", path, state.step, state.consumed_samples)
        return state
