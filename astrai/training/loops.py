"""The training loops. One per family, each readable top to bottom.

`train_offline` serves `seq`, `sft`, `dpo` and `rm`: batches -> strategy loss -> engine backward/step ->
metrics -> publish a checkpoint every N steps and at the end. Steps count optimizer updates from 1.

`train_online` serves `grpo` and `online_ppo`: prompts -> rollout -> frozen targets -> replay epochs
over minibatches -> engine steps (the policy, and online_ppo's critic beside it) -> metrics ->
checkpoint. A step is one rollout; `policy_version` counts the policy's optimizer updates
(rl.epochs_per_rollout x minibatches per step); critic updates never change it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from astrai.engine import Engine, all_reduce_sum, all_reduce_sums
from astrai.errors import AstraiError
from astrai.eval.evaluator import Evaluator
from astrai.launch.launcher_watch import leave_if_orphaned
from astrai.observability.metrics import MetricsLog
from astrai.resume.training_checkpoints import TrainerState, TrainingCheckpoints
from astrai.training.run_parts import Run
from astrai.training.step_metrics import offline_record, online_record

logger = logging.getLogger("astrai.trainer")


class NonFiniteError(AstraiError, RuntimeError):
    """A non-finite loss or gradient norm stopped the run (`train.on_nonfinite: stop`, or an update that
    could not be skipped); nothing of the step was published."""


def is_finite(loss: torch.Tensor) -> bool:
    return bool(torch.isfinite(loss.detach()).all())


def _gradients_finite(engine: Engine) -> bool:
    """Every gradient this rank holds in `.grad` is finite (ZeRO-0: all of them, already all-reduced)."""
    return all(bool(torch.isfinite(p.grad).all()) for p in engine.module.parameters() if p.grad is not None)


def finish_update(engine: Engine, run: Run, nonfinite_loss: bool, what: str, step: int) -> bool:
    """Instead of `engine.step()` for the micro-batch that ends an optimizer step: every rank says whether
    one of its losses of the step was non-finite (one all-reduce), and all decide alike, before any update:
    `train.on_nonfinite: stop` raises NonFiniteError, `skip_step` discards the step (`Engine.skip_update`).
    A gradient norm found non-finite only after an update was applied (weights may be NaN) always stops,
    before that step could be published; one DeepSpeed skipped itself (an fp16 overflow) is only counted.
    Returns True when the update was applied."""
    mode = run.job.train.on_nonfinite
    if mode == "skip_step" and engine.zero_stage == 0 and not nonfinite_loss:
        nonfinite_loss = not _gradients_finite(engine)  # ZeRO-0 applies any gradient: look before the update
    ranks = int(all_reduce_sum(float(nonfinite_loss), run.dist.device))
    checkpoints = run.output_dir / "checkpoints"
    newest = f"nothing of step {step} was published; the newest checkpoint in {checkpoints} is still the last good one"
    if ranks and mode == "stop":
        raise NonFiniteError(
            f"step {step}: non-finite {what} loss or gradient on {ranks} of {run.dist.world_size} ranks: "
            "stopped before the update "
            f"(train.on_nonfinite: stop; skip_step would skip such steps); {newest}"
        )
    if ranks:
        engine.skip_update()
        logger.warning(
            "step %d: non-finite %s loss or gradient on %d ranks: update skipped "
            "(train.on_nonfinite: skip_step; %d skipped so far)",
            step,
            what,
            ranks,
            engine.skipped_steps,
        )
        return False
    skipped_before = engine.skipped_steps
    engine.step()
    norm = engine.grad_norm
    if norm is not None and not math.isfinite(norm) and engine.skipped_steps == skipped_before:
        raise NonFiniteError(
            f"step {step}: non-finite {what} gradient norm ({norm}) after the update: stopped "
            f"(train.on_nonfinite: {mode}); {newest}"
        )
    return engine.skipped_steps == skipped_before


def _to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _global_sums(sums: dict[str, float], run: Run) -> dict[str, float]:
    """Sum each metric over ranks in one collective (keys sorted: every rank sends the same order). The ranks of
    a sequence-parallel group each sum their whole micro-batches (models/token_forward.py): divided by its size."""
    if not sums:
        return {}
    keys = sorted(sums)
    group = run.dist.sequence_parallel_size
    return {
        key: value / group for key, value in zip(keys, all_reduce_sums([sums[key] for key in keys], run.dist.device))
    }


def _add(sums: dict[str, float], output) -> None:
    for key, value in output.sums.items():
        sums[key] += value


def _close_step(run: Run, session: Session, record: dict) -> None:
    """End of every step of either loop: eval when due, log (every log_every_steps, the last, and eval steps),
    then publish a checkpoint when due."""
    state = session.state
    session.evaluator.after_step(state.step, record, session.checkpoints)  # timed apart from the step's figures
    if state.step % run.job.train.log_every_steps == 0 or state.step == run.total_steps or "eval_s" in record:
        session.metrics.log(state.step, record)
    session.metrics.advance()
    if session.checkpoints.due(state.step, run.total_steps):
        session.checkpoints.save(state, session.metrics, final=state.step == run.total_steps)


@dataclass
class Session:
    """What both loops hold from set-up to tear-down: the trainer state (resumed or fresh), the metrics log,
    the checkpoints, the evaluator, and when the run began (resumed runs carry their elapsed time on)."""

    state: TrainerState
    metrics: MetricsLog
    checkpoints: TrainingCheckpoints
    evaluator: Evaluator
    started: float

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def training_session(run: Run) -> Iterator[Session]:
    """Set-up and tear-down shared by the loops: resume (engines, RNG, data position, policy version, the
    strategy's own state such as an adaptive KL coefficient) or start fresh, open the metrics log, put the
    trainable engines in train() mode, run `eval.at_start`; at the end, finish a background save in flight
    (or say why not) and close the log, however the loop ended."""
    checkpoints = TrainingCheckpoints(run, before_rename=leave_if_orphaned)
    state = checkpoints.resume()
    run.strategy.load_state_dict(state.strategy)
    metrics = MetricsLog(
        run.output_dir,
        is_main=run.dist.is_main,
        total_steps=run.total_steps,
        start_step=state.step,
        job=run.job,
        progress_bar=run.job.runtime.progress_bar,
    )
    try:
        started = time.perf_counter() - state.elapsed_s  # eval.at_start counts in the run's elapsed time
        for engine in run.engines.values():
            engine.train()
        evaluator = Evaluator(run, state.step)  # eval.every_steps, the last step, eval.at_start (astrai/eval/)
        evaluator.at_start(state.step, metrics)
        yield Session(state, metrics, checkpoints, evaluator, started)
    finally:
        checkpoints.close()
        metrics.close()


def offline_update(run: Run, micro_batches: list[dict]) -> dict[str, float]:
    """One optimizer step of the offline loop over this rank's collated micro-batches: the strategy loss,
    engine backward/step per micro-batch. Returns this rank's metric sums (with `tokens`), not yet reduced.
    (A function of its own so benchmarks/step_overhead.py times the trainer's own step, not a copy.)"""
    strategy, policy = run.strategy, run.engines["policy"]
    # Every micro-batch of the step, on every rank, divides by the same count: the update is the
    # token mean over the whole step, whatever the split into micro-batches and ranks. With sequence
    # parallelism each rank of a group counts the group's whole micro-batches, so the world's sum is sp times
    # the step's units and the divisor is units / (data-parallel ranks x accumulation): what DeepSpeed's
    # gradient sum over the group and mean over the data-parallel ranks needs.
    loss_weight = all_reduce_sum(sum(strategy.loss_weight(b) for b in micro_batches), run.dist.device)
    normalizer = max(loss_weight, 1.0) / (run.dist.world_size * len(micro_batches))
    sums: dict[str, float] = defaultdict(float)
    nonfinite = False
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        policy.mark_micro_batch(last)
        output = strategy.compute_loss(policy, _to_device(batch, run.dist.device), normalizer)
        nonfinite |= not is_finite(output.loss)
        policy.backward(output.loss)
        if last:
            finish_update(policy, run, nonfinite, "policy", policy.global_steps + 1)
        else:
            policy.step()
        _add(sums, output)
        sums["tokens"] += float(batch["attention_mask"].sum())
    return sums


def train_offline(run: Run) -> TrainerState:
    """`seq`, `sft`, `dpo`, `rm`: one optimizer step per loop turn, over `grad_accum_steps` micro-batches per rank."""
    strategy, policy = run.strategy, run.engines["policy"]
    with training_session(run) as session:
        state = session.state
        steps = run.data.steps(run.job.train.grad_accum_steps)  # from the resumed position (data.packing: by tokens)
        for step in range(state.step + 1, run.total_steps + 1):
            step_started = time.perf_counter()
            micro_batches = [strategy.collate(rows) for rows in next(steps)]
            lr = policy.lr
            sums = offline_update(run, micro_batches)
            state.step, state.policy_version = step, step
            step_seconds = time.perf_counter() - step_started
            state.elapsed_s = session.elapsed_s()
            record, tokens = offline_record(_global_sums(sums, run))
            record.update(
                lr=lr,
                grad_norm=policy.grad_norm,
                tokens=int(tokens),
                tokens_per_s=tokens / step_seconds,
                elapsed_s=state.elapsed_s,
                epoch=run.data.epoch,
                samples=run.data.consumed_samples,
            )
            _add_skipped(record, run, policy)
            _close_step(run, session, record)
    return state


def _add_skipped(record: dict, run: Run, policy: Engine) -> None:
    """`skipped_steps`: optimizer steps skipped so far (train.on_nonfinite: skip_step, or DeepSpeed's fp16 overflow)."""
    if run.job.train.on_nonfinite == "skip_step" or policy.skipped_steps:
        record["skipped_steps"] = policy.skipped_steps


def train_online(run: Run) -> TrainerState:
    """`grpo`, `online_ppo`: one rollout per loop turn, read as its phases (sample, score, update, record)."""
    strategy, policy = run.strategy, run.engines["policy"]
    with training_session(run) as session:
        state = session.state
        prompt_batches = run.data.batches()  # from the resumed position; every prompt drawn (all rounds) advances it
        for step in range(state.step + 1, run.total_steps + 1):
            # 1. Sample: group_size scored responses to each of this rank's prompts, from the current weights
            # (rl.dynamic_sampling: as many rounds of prompts as it takes to fill the step with informative groups).
            rollout_started = time.perf_counter()
            sample = strategy.sample(policy, prompt_batches, step=step, policy_version=state.policy_version)
            # 2. Score: rewards, reference log-probs, values, advantages, returns; frozen for every epoch below.
            targets = strategy.frozen_targets(sample.rollout)
            rollout_seconds = time.perf_counter() - rollout_started
            # 3. Update: replay epochs over minibatches, one optimizer step of each trained engine per minibatch.
            train_started = time.perf_counter()
            lrs = {part: run.engines[part].lr for part in strategy.engine_parts}
            sums, policy_updates = online_update(run, targets, step)
            state.policy_version += policy_updates
            train_seconds = time.perf_counter() - train_started
            # 4. Record: the step's global metrics, then eval and checkpoint when due.
            state.step, state.elapsed_s, state.strategy = step, session.elapsed_s(), strategy.state_dict()
            global_sums = _global_sums({**sums, **sample.rollout.metric_sums(), **targets.metric_sums()}, run)
            record = online_record(global_sums)
            record.update(sample.metrics)  # already global: dynamic sampling's rounds and groups
            record.update(
                lr=lrs["policy"],
                grad_norm=policy.grad_norm,
                rollout_s=rollout_seconds,
                train_s=train_seconds,
                policy_version=state.policy_version,
                elapsed_s=state.elapsed_s,
                epoch=run.data.epoch,
                samples=run.data.consumed_samples,
            )
            _add_engine_figures(record, run, lrs)
            _add_skipped(record, run, policy)
            _close_step(run, session, record)
    return state


def online_update(run: Run, targets, step: int) -> tuple[dict[str, float], int]:
    """The update phase of one online step: rl.epochs_per_rollout epochs over the strategy's minibatches, each
    one optimizer step of every engine part the strategy trains this step (not the policy in a critic warmup
    step). Returns this rank's metric sums (not yet reduced) and the policy updates applied (the versions)."""
    strategy = run.strategy
    training = {part: run.engines[part] for part in strategy.engine_parts if strategy.trains_part(part, step)}
    sums: dict[str, float] = defaultdict(float)
    policy_updates = 0
    for epoch in range(run.job.rl.epochs_per_rollout):
        for micro_batches in strategy.minibatches(targets, step=step, epoch=epoch):
            applied = minibatch_update(run, training, micro_batches, step, sums)
            policy_updates += applied.get("policy", False)  # a skipped update (skip_step) changed no weight
    return sums, policy_updates


def minibatch_update(run: Run, training: dict[str, Engine], micro_batches: list[dict], step: int, sums) -> dict:
    """One optimizer step of each engine in `training` over one minibatch's micro-batches (grad_accum_steps of
    them per rank, or rl.packing's token cut, as many on every rank). Adds this rank's metric sums to `sums`;
    returns {part: whether its update was applied}."""
    strategy = run.strategy
    # As offline: one divisor for every micro-batch and rank of the optimizer step, so the update is the mean
    # over the minibatch's loss units whatever the split. DeepSpeed divides every loss by grad_accum_steps
    # whatever the count of micro-batches, so the normaliser does too.
    weights = [strategy.loss_weight(batch) for batch in micro_batches]
    world, accumulation = run.dist.world_size, run.job.train.grad_accum_steps
    normalizer = max(all_reduce_sum(sum(weights), run.dist.device), 1.0) / (world * accumulation)
    nonfinite, applied = dict.fromkeys(training, False), {}
    for index, (batch, weight) in enumerate(zip(micro_batches, weights)):
        last = index == len(micro_batches) - 1
        for part, engine in training.items():
            engine.mark_micro_batch(last)
            output = strategy.part_loss(part, engine, batch, normalizer)
            nonfinite[part] |= not is_finite(output.loss)
            engine.backward(output.loss)
            if last:
                applied[part] = finish_update(engine, run, nonfinite[part], part, step)
            else:
                engine.step()
            _add(sums, output)
        sums["tokens"] += float(batch["response_mask"].sum())
        sums["weight"] += float(weight)
    return applied


def _add_engine_figures(record: dict, run: Run, lrs: dict[str, float]) -> None:
    """With more engines than the policy: each engine's own norm (`critic_grad_norm`, ...) and every other LR."""
    if len(lrs) > 1:
        for part, lr in lrs.items():
            record[f"{part}_grad_norm"] = run.engines[part].grad_norm
            if part != "policy":
                record[f"{part}_lr"] = lr


TRAIN_LOOPS = {"offline": train_offline, "online": train_online}
