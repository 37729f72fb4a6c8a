"""The trainer's side of checkpoints: what goes into one, and how a run resumes from it.

`astrai/checkpoint/` publishes and verifies directories and knows nothing of training; this module
decides the content: one DeepSpeed folder per engine (`policy/`, online_ppo's `critic/`), the trainer
state (step, data position, per-rank RNG) and the resolved job.
"""

from __future__ import annotations

import json
import logging
import os
import random
import stat
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy
import torch

from astrai.checkpoint import (
    CheckpointError,
    CheckpointPublisher,
    FileDigest,
    StreamedFiles,
    find_latest,
    parse_step_dir_name,
    read_manifest,
    require_parts,
    step_dir_name,
    verify_checkpoint,
)
from astrai.checkpoint.errors import CheckpointVerifyError
from astrai.checkpoint.read_check import ReadCheck, checking_reads
from astrai.checkpoint.verify import list_files, scan_pickles
from astrai.config import dump_job, parse_yaml
from astrai.engine import CheckpointDamagedError, UnsafeCheckpointError, all_gather_objects, barrier
from astrai.models.lora import check_same_base, lora_checkpoint_meta
from astrai.models.tokenizer import TOKENIZER_DIR, check_saved_tokenizer
from astrai.observability.metrics import METRICS_FILE, trim_metrics
from astrai.resume.rng_state import capture_rng, decode_rng, restore_rng
from astrai.resume.topology import (
    continue_position,
    current_topology,
    describe_change,
    is_portable,
    load_portable_part,
    recorded_topology,
    resume_source,
)

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
    rng: list = field(
        default_factory=list
    )  # one RNG snapshot per rank (astrai/resume/rng_state.py: JSON, never a pickle)
    strategy: dict = field(default_factory=dict)  # the strategy's own state (online_ppo: the KL controller)


def read_checkpoint_bytes(path: Path) -> bytes:
    """A checkpoint file's bytes; a FIFO, socket or device in its place is refused (CheckpointDamagedError)
    instead of blocking the resume forever: opened non-blocking, its type checked on the open descriptor."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise CheckpointDamagedError(f"{path}: cannot open: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise CheckpointDamagedError(f"{path}: not a regular file (a FIFO, socket or device): refused")
        return handle.read()


def _field_type_ok(value, expected) -> bool:
    """`value` (decoded JSON) fits the TrainerState annotation `expected` (int, float, list or dict)."""
    origin = typing.get_origin(expected) or expected
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, origin)


def read_trainer_state(path: Path) -> TrainerState:
    """trainer_state.json, every field checked against TrainerState's types and every RNG entry decoded
    (old pickled ones converted). A file that is not such a state is damage (CheckpointDamagedError naming
    the file and the key: a resume falls back to the previous checkpoint); a pickle naming code is refused
    (UnsafeCheckpointError)."""
    try:
        document = json.loads(read_checkpoint_bytes(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointDamagedError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(document, dict):
        raise CheckpointDamagedError(f"{path}: expected a JSON object, got {type(document).__name__}")
    types = typing.get_type_hints(TrainerState)
    known = {item.name for item in fields(TrainerState)}
    for key, value in document.items():
        if key in known and not _field_type_ok(value, types[key]):
            expected = getattr(types[key], "__name__", types[key])
            detail = f"{key} is {value!r} ({type(value).__name__}), expected {expected}"
            raise CheckpointDamagedError(f"{path}: {detail}")
        if key in known and isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise CheckpointDamagedError(f"{path}: {key} is {value}, expected a count >= 0")
    ignored = sorted(set(document) - known)
    if ignored:
        logger.warning("%s: ignoring keys this AstrAI does not know: %s", path, ", ".join(ignored))
    state = TrainerState(**{key: value for key, value in document.items() if key in known})
    try:
        state.rng = [decode_rng(entry, path, rank) for rank, entry in enumerate(state.rng)]
    except (UnsafeCheckpointError, CheckpointDamagedError):
        raise
    except CheckpointError as error:  # an entry that is not an RNG state: damage, as any invalid field
        raise CheckpointDamagedError(str(error)) from None
    return state


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
        return int(parse_yaml(read_checkpoint_bytes(path / "job.yaml").decode())["train"]["micro_batch_size"])
    except CheckpointDamagedError:
        if os.path.lexists(path / "job.yaml"):
            raise  # a FIFO or device in its place: refused rather than read
        return None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def carry_over(
    state: TrainerState,
    *,
    rank: int,
    world_size: int,
    seed: int,
    samples_per_micro_step: int,
    micro_batch_size: int,
    saved_micro_batch: int | None,
) -> None:
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
        restore_rng(state.rng[rank], rank=rank)
    consumed = state.consumed_samples
    state.consumed_samples = continue_position(consumed, samples_per_micro_step)
    if rank != 0:
        return
    if changed:
        logger.warning(
            "data position: continuing from global sample count %d (rule: the global sample count carries over, "
            "rounded up to this run's global micro-batch of %d samples = %d per rank x world size %d; world size %d "
            "-> %d, train.micro_batch_size %s -> %d, %d samples consumed)",
            state.consumed_samples,
            samples_per_micro_step,
            samples_per_micro_step // world_size,
            world_size,
            state.world_size,
            world_size,
            "unknown" if saved_micro_batch is None else saved_micro_batch,
            micro_batch_size,
            consumed,
        )
    if reseeded:
        why = (
            f"world size changed ({state.world_size} -> {world_size})"
            if world_changed
            else f"{len(state.rng)} RNG states saved for {world_size} ranks"
        )
        logger.warning(
            "RNG reseeded per rank from (seed, step, rank): %s (rule: per-rank RNG state cannot carry over; python "
            "random, numpy and torch of rank r seeded with seed*7919 + step*31 + r = %d + r)",
            why,
            base,
        )
    elif changed:
        logger.warning(
            "RNG: each rank's saved state restored (rule: the world size is unchanged, so rank r continues its own "
            "stream)"
        )


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
            path,
            TOKENIZER_DIR,
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
                "(%s lr for step %d: %.4g, where the checkpoint's schedule gave %.4g)",
                saved_total,
                run.total_steps,
                run.total_steps,
                name,
                step + 1,
                after,
                before,
            )
        elif before != after:
            logger.warning(
                "LR schedule: %s lr for step %d is %.4g from this job's schedule (the checkpoint's gave %.4g)",
                name,
                step + 1,
                after,
                before,
            )


def is_plain_deepspeed_dir(path: Path) -> bool:
    """A folder written by DeepSpeed's own `save_checkpoint` (a `latest` file or tag folders of shards)."""
    return (path / "latest").is_file() or any(path.glob("*/*model_states.pt"))


class TrainingCheckpoints:
    def __init__(self, run, before_rename: Callable[[], None] = lambda: None):
        # `before_rename`: called just before a checkpoint's publishing rename; the loops pass the launcher
        # watch's `leave_if_orphaned`, so an orphaned rank never publishes, and resume/ imports no launch/.
        self.run = run
        self.before_rename = before_rename
        self.directory = run.output_dir / "checkpoints"
        config = run.job.checkpoint
        self.publisher = CheckpointPublisher(
            self.directory,
            parts=sorted(run.engines),
            hash_algorithm=config.hash,
            keep_last=config.keep_last,
            keep_best=(config.keep_best.metric, config.keep_best.mode) if config.keep_best else None,
            timeout_s=config.save_timeout_s,
        )

        self.eval_figures: tuple[int, dict] | None = None  # (step, eval/<name> figures): set by astrai/eval/

    def due(self, step: int, total_steps: int) -> bool:
        every = self.run.job.checkpoint.every_steps
        return step == total_steps or (every is not None and step % every == 0)

    def save(self, state: TrainerState, metrics, *, final: bool) -> Path:
        """Publish checkpoint `state.step`; with checkpoint.async_save (not for the final one) return once the
        shards are written, leaving hashing, fsync and the publishing rename to a background thread."""
        run = self.run
        state.world_size = run.dist.world_size
        state.rng = all_gather_objects(capture_rng())
        vars(state).update(run.data.state_dict())  # the data position: its one owner is run.data

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
            **lora_checkpoint_meta(run.engines),  # a LoRA run's base model, which its adapter-only parts need
        }
        if self.eval_figures is not None and self.eval_figures[0] == state.step:
            meta["eval"] = self.eval_figures[1]  # what checkpoint.keep_best ranks checkpoints by
        if background:
            metrics.flush()  # durable before the checkpoint it describes can appear (the rename comes later)
            self.publisher.publish_async(state.step, write, meta=meta, pre_publish=self.before_rename)
            return self.directory / step_dir_name(state.step)

        # The metric log is made durable just before the rename that publishes the checkpoint it describes.
        def pre_publish() -> None:
            self.before_rename()  # a rank whose launcher died in the last second never publishes
            metrics.flush()

        report = self.publisher.publish(state.step, write, meta=meta, pre_publish=pre_publish)
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
            state = self._load_or_fall_back(path)
        if run.dist.is_main:
            dropped = trim_metrics(run.output_dir / METRICS_FILE, state.step)
            if dropped:
                logger.info("trimmed %d metric records past step %d from %s", dropped, state.step, METRICS_FILE)
        barrier()
        return state

    def _load_or_fall_back(self, path: Path) -> TrainerState:
        """Load `path`; when it is damaged (found by the pre-load check or while loading, on any rank) and
        the job resumes `auto`, load the newest older checkpoint instead, with one warning naming both.
        Every rank takes the same decision (rank 0's check and every rank's load outcome are gathered).
        Damage: a file missing, of the wrong size or digest, unreadable, an invalid trainer_state.json.
        Job errors (a pickle naming code, a model of other shapes, another train type) never fall back."""
        run, first_damage, candidate = self.run, None, path
        while candidate is not None:
            state, damage = self._attempt(candidate)
            if damage is None:
                if first_damage is not None and run.dist.is_main:
                    logger.warning(
                        "checkpoint %s is damaged (%s): resumed from the previous valid checkpoint %s instead",
                        first_damage[0],
                        first_damage[1],
                        candidate,
                    )
                return state
            if run.job.checkpoint.resume != "auto":
                raise CheckpointError(f"cannot resume from {candidate}: {damage}")
            first_damage = first_damage or (candidate, damage)
            step = parse_step_dir_name(candidate.name)
            older = find_latest(self.directory, before=step) if step is not None and run.dist.is_main else None
            candidate = all_gather_objects(older)[0]  # rank 0's listing decides for every rank
            if candidate is not None and run.dist.is_main:
                logger.info("trying the previous checkpoint %s", candidate)
        raise CheckpointError(
            f"no valid checkpoint to resume from: {first_damage[0]} is damaged ({first_damage[1]}) and no older "
            "published checkpoint loads (set checkpoint.resume: never to start afresh)"
        )

    def _attempt(self, path: Path) -> tuple[TrainerState | None, str | None]:
        """(state, None) once `path` has loaded on every rank; (None, what is damaged) when rank 0's check
        or any rank's load found damage. Any other error on any rank raises CheckpointError on every rank."""
        run = self.run
        problem = self._check_before_loading(path) if run.dist.is_main else None
        problem = all_gather_objects(problem)[0]
        if problem is not None and problem[0] == "unsafe":
            raise UnsafeCheckpointError(problem[1])  # a crafted file: refused, never skipped for an older checkpoint
        if problem is not None:
            return None, problem[1]
        state, outcome, own_error, check = None, None, None, None
        try:
            check = self._read_check(path)
            with checking_reads(check):
                state = self._load(path)
        except (CheckpointDamagedError, OSError) as error:
            outcome = ("damaged", " ".join(str(error).split()))
        except Exception as error:  # a job error: reported to every rank, none may be left waiting in the gather below
            own_error = error
            text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
            outcome = ("failed", " ".join(text.split()))
        outcomes = all_gather_objects(outcome)
        failed = [(rank, item[1]) for rank, item in enumerate(outcomes) if item and item[0] == "failed"]
        if failed:
            rank, text = failed[0]
            if own_error is not None and rank == run.dist.rank:
                raise own_error  # its own class (TokenizerError, CheckpointShapeError, ...) and message
            raise CheckpointError(f"rank {rank}: {text}") from own_error
        damaged = [item[1] for item in outcomes if item]
        if not damaged and check is not None and run.dist.is_main:
            logger.info("%s: %d files (%d bytes) matched the manifest as they loaded", path, check.files, check.bytes)
        return (None, damaged[0]) if damaged else (state, None)

    def hashed_while_loading(self, manifest) -> list[str]:
        """The files of a checkpoint whose digests are compared as they load (checkpoint.verify_on_load): the
        torch files DeepSpeed's own load reads. None of them for a portable checkpoint or a topology change:
        those files are read by a conversion or as safetensors, so rank 0 hashes every file before loading."""
        if not self.run.job.checkpoint.verify_on_load:
            return []
        if is_portable(manifest) or describe_change(recorded_topology(manifest), current_topology(self.run)):
            return []
        return sorted(path for path in manifest.files if path.endswith(".pt"))

    def _read_check(self, path: Path) -> ReadCheck | None:
        """What this rank compares while it loads `path` (read_check.py), or None."""
        manifest = read_manifest(path)
        later = self.hashed_while_loading(manifest) if manifest is not None else []
        return ReadCheck(path, manifest, later) if later else None

    def _check_before_loading(self, path: Path) -> tuple[str, str] | None:
        """Rank 0's check of `path`, for every rank: against its manifest, the sizes, file types and step
        (`verify --quick`, ~0 s); with checkpoint.verify_on_load (the default) the digests of every file
        the ranks' load does not hash as it reads (`hashed_while_loading`: all but DeepSpeed's torch files);
        then each pickle's opcodes (a torch file's zip directory and data.pkl only, not its tensors): one
        that does not parse (a truncated shard) is damage, one naming code is refused
        (UnsafeCheckpointError, raised). Returns None, or ("damaged" | "unsafe", what is wrong)."""
        digests = self.run.job.checkpoint.verify_on_load
        try:
            manifest = read_manifest(path)
            if manifest is not None:
                later = self.hashed_while_loading(manifest)
                report = verify_checkpoint(path, digests=digests, hash_later=later)
                checked = "verified" if report.digests_checked else "checked the sizes of"
                logger.info(
                    "%s %s: %d files, %d bytes in %.2f s%s",
                    checked,
                    path,
                    report.files,
                    report.bytes,
                    report.seconds,
                    f" ({len(later)} torch files are hashed as they load)" if later else "",
                )
            if manifest is None or not digests:  # a full verify scanned the pickles already
                scan_pickles(path, manifest.files if manifest is not None else list_files(path))
        except CheckpointError as error:
            unsafe = isinstance(error, CheckpointVerifyError) and error.reason == "unsafe pickle"
            return ("unsafe" if unsafe else "damaged", " ".join(str(error).split()))
        return None

    def _load(self, path: Path) -> TrainerState:
        run = self.run
        manifest = read_manifest(path)
        check_same_job(run, path, manifest)
        if manifest is not None:
            check_same_base(manifest.meta.get("lora"), lora_checkpoint_meta(run.engines).get("lora"), path)
        required = run.strategy.parts_to_resume(path)
        plain_deepspeed = manifest is None and is_plain_deepspeed_dir(path) and len(required) == 1
        if not plain_deepspeed:
            require_parts(path, required)  # names the missing part before any training step
        if manifest is None:
            logger.warning("%s has no manifest (a legacy or plain DeepSpeed checkpoint): loading it unverified", path)
        state_file = path / STATE_FILE
        # Read (and its RNG states decoded) before any shard: a bad or unsafe file is refused first.
        saved = read_trainer_state(state_file) if os.path.lexists(state_file) else None
        # A different world size, ZeRO stage or precision: DeepSpeed's shards cannot load as they are.
        portable = resume_source(run, path, manifest)
        for name in required:
            if portable is not None:
                load_portable_part(run.engines[name], portable / name)
            else:
                run.engines[name].load(path if plain_deepspeed else path / name)
        if saved is not None:
            state = saved
        else:  # plain DeepSpeed checkpoint: the step is all it knows
            step = run.engines["policy"].global_steps
            state = TrainerState(step=step, consumed_samples=step * run.samples_per_step, policy_version=step)
            logger.warning(
                "no %s in %s: continuing from step %d, data position derived from it", STATE_FILE, path, step
            )
        carry_over(
            state,
            rank=run.dist.rank,
            world_size=run.dist.world_size,
            seed=run.job.train.seed,
            samples_per_micro_step=run.data.samples_per_draw,
            micro_batch_size=run.job.train.micro_batch_size,
            saved_micro_batch=saved_micro_batch_size(path),
        )
        run.data.load_state_dict({"consumed_samples": state.consumed_samples})
        state.epoch = run.data.epoch
        continue_schedule(run, path, state.step)  # the path actually loaded (a fallback may have chosen an older one)
        logger.info("resumed from %s at step %d (%d samples consumed)", path, state.step, state.consumed_samples)
        return state
