"""The training loops. One per family, each readable top to bottom.

`train_offline` serves `seq`, `sft` and `dpo`: batches -> strategy loss -> engine backward/step ->
metrics -> publish a checkpoint every N steps and at the end. Steps count optimizer updates from 1.

`train_online` serves `grpo` and `online_ppo`: prompts -> rollout -> frozen targets -> replay epochs
over minibatches -> engine steps (the policy, and online_ppo's critic beside it) -> metrics ->
checkpoint. A step is one rollout; `policy_version` counts the policy's optimizer updates
(rl.epochs_per_rollout x minibatches per step); critic updates never change it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

import torch

from astrai.engine import Engine, all_reduce_sum, all_reduce_sums
from astrai.errors import AstraiError
from astrai.eval.evaluator import Evaluator
from astrai.metrics import MetricsLog
from astrai.resume.checkpointing import TrainerState, TrainingCheckpoints
from astrai.run import Run
from astrai.step_metrics import offline_record, online_record

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


def _global_sums(sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum each metric over ranks in one collective (keys sorted: every rank sends the same order)."""
    if not sums:
        return {}
    keys = sorted(sums)
    return dict(zip(keys, all_reduce_sums([sums[key] for key in keys], device)))


def _add(sums: dict[str, float], output) -> None:
    for key, value in output.sums.items():
        sums[key] += value


def _close_step(
    run: Run, state: TrainerState, record: dict, metrics: MetricsLog, checkpoints: TrainingCheckpoints
) -> None:
    """End of every step of either loop: log (every log_every_steps and the last), then publish when due."""
    if state.step % run.job.train.log_every_steps == 0 or state.step == run.total_steps or "eval_s" in record:
        metrics.log(state.step, record)
    metrics.advance()
    if checkpoints.due(state.step, run.total_steps):
        checkpoints.save(state, metrics, final=state.step == run.total_steps)


def offline_update(run: Run, micro_batches: list[dict]) -> dict[str, float]:
    """One optimizer step of the offline loop over this rank's collated micro-batches: the strategy loss,
    engine backward/step per micro-batch. Returns this rank's metric sums (with `tokens`), not yet reduced.
    (A function of its own so benchmarks/step_overhead.py times the trainer's own step, not a copy.)"""
    strategy, policy = run.strategy, run.engines["policy"]
    # Every micro-batch of the step, on every rank, divides by the same count: the update is the
    # token mean over the whole step, whatever the split into micro-batches and ranks.
    loss_weight = all_reduce_sum(sum(strategy.loss_weight(b) for b in micro_batches), run.dist.device)
    normalizer = max(loss_weight, 1.0) / (run.dist.world_size * len(micro_batches))
    sums: dict[str, float] = defaultdict(float)
    nonfinite = False
    for index, batch in enumerate(micro_batches):
        output = strategy.compute_loss(policy, _to_device(batch, run.dist.device), normalizer)
        nonfinite |= not is_finite(output.loss)
        policy.backward(output.loss)
        if index < len(micro_batches) - 1:
            policy.step()
        else:
            finish_update(policy, run, nonfinite, "policy", policy.global_steps + 1)
        _add(sums, output)
        sums["tokens"] += float(batch["attention_mask"].sum())
    return sums


def train_offline(run: Run) -> TrainerState:
    job, strategy, policy = run.job, run.strategy, run.engines["policy"]
    accumulation = job.train.grad_accum_steps
    checkpoints = TrainingCheckpoints(run)
    state = checkpoints.resume()  # restores engines, RNG and the data position, or starts fresh
    metrics = MetricsLog(
        run.output_dir,
        is_main=run.dist.is_main,
        total_steps=run.total_steps,
        start_step=state.step,
        job=job,
        progress_bar=job.runtime.progress_bar,
    )
    steps = run.data.steps(accumulation)  # from the resumed position; token-balanced with data.packing
    run_started = time.perf_counter() - state.elapsed_s
    policy.train()
    evaluator = Evaluator(run, state.step)  # eval.every_steps, the last step, eval.at_start (astrai/eval/)
    evaluator.at_start(state.step, metrics)
    try:
        for step in range(state.step + 1, run.total_steps + 1):
            step_started = time.perf_counter()
            micro_batches = [strategy.collate(rows) for rows in next(steps)]
            lr = policy.lr
            sums = offline_update(run, micro_batches)
            state.step, state.policy_version = step, step
            totals = _global_sums(sums, run.dist.device)
            step_seconds = time.perf_counter() - step_started
            state.elapsed_s = time.perf_counter() - run_started
            record, tokens = offline_record(totals)
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
            evaluator.after_step(step, record, checkpoints)  # timed apart: not in tokens_per_s
            _close_step(run, state, record, metrics, checkpoints)
    finally:
        checkpoints.close()  # a background save in flight finishes (or says why not)
        metrics.close()
    return state


def _add_skipped(record: dict, run: Run, policy: Engine) -> None:
    """`skipped_steps`: optimizer steps skipped so far (train.on_nonfinite: skip_step, or DeepSpeed's fp16 overflow)."""
    if run.job.train.on_nonfinite == "skip_step" or policy.skipped_steps:
        record["skipped_steps"] = policy.skipped_steps


def train_online(run: Run) -> TrainerState:
    job, strategy, policy = run.job, run.strategy, run.engines["policy"]
    # Every engine the strategy declares (online_ppo adds a critic: its own optimizer and clipping), by name.
    parts = {part: run.engines[part] for part in strategy.engine_parts}
    accumulation, world, device = job.train.grad_accum_steps, run.dist.world_size, run.dist.device
    checkpoints = TrainingCheckpoints(run)
    state = checkpoints.resume()  # restores the engines, the policy version and the prompt position
    strategy.load_state_dict(state.strategy)  # e.g. the adaptive KL coefficient
    metrics = MetricsLog(
        run.output_dir,
        is_main=run.dist.is_main,
        total_steps=run.total_steps,
        start_step=state.step,
        job=job,
        progress_bar=job.runtime.progress_bar,
    )
    prompt_batches = run.data.batches()  # from the resumed position; every prompt drawn (all rounds) advances it
    run_started = time.perf_counter() - state.elapsed_s
    for engine in run.engines.values():
        engine.train()
    evaluator = Evaluator(run, state.step)  # eval.every_steps, the last step, eval.at_start (astrai/eval/)
    evaluator.at_start(state.step, metrics)
    try:
        for step in range(state.step + 1, run.total_steps + 1):
            # 1. Rollout: group_size scored responses to each of this rank's prompts, from the current weights
            # (rl.dynamic_sampling: as many rounds of prompts as it takes to fill the step with informative groups).
            rollout_started = time.perf_counter()
            sample = strategy.sample(policy, prompt_batches, step=step, policy_version=state.policy_version)
            rollout = sample.rollout
            # 2. Frozen targets: rewards, reference log-probs, values, advantages, returns; fixed for every epoch below.
            targets = strategy.frozen_targets(rollout)
            rollout_seconds = time.perf_counter() - rollout_started
            # 3. Replay: each minibatch is one optimizer step of `accumulation` micro-batches per rank (rl.packing:
            # its token cut, as many on every rank), for every engine part the strategy trains this step (not the
            # policy in a critic warmup step). Only policy steps count as versions. DeepSpeed divides every loss
            # by `accumulation` whatever the count, so the normaliser does too.
            train_started = time.perf_counter()
            training = {part: engine for part, engine in parts.items() if strategy.trains_part(part, step)}
            lrs, sums = {part: engine.lr for part, engine in parts.items()}, defaultdict(float)
            for epoch in range(job.rl.epochs_per_rollout):
                for micro_batches in strategy.minibatches(targets, step=step, epoch=epoch):
                    # As offline: one divisor for every micro-batch and rank of the optimizer step, so the
                    # update is the mean over the minibatch's loss units whatever the split.
                    weights = [strategy.loss_weight(batch) for batch in micro_batches]
                    normalizer = max(all_reduce_sum(sum(weights), device), 1.0) / (world * accumulation)
                    nonfinite, applied = dict.fromkeys(training, False), {"policy": False}
                    for index, (batch, weight) in enumerate(zip(micro_batches, weights)):
                        last = index == len(micro_batches) - 1
                        for part, engine in training.items():
                            if strategy.cuts_by_tokens:  # rl.packing: not A micro-batches, so say where it ends
                                engine.set_accumulation_boundary(last)
                            output = strategy.part_loss(part, engine, batch, normalizer)
                            nonfinite[part] |= not is_finite(output.loss)
                            engine.backward(output.loss)
                            if last:
                                applied[part] = finish_update(engine, run, nonfinite[part], part, step)
                                if strategy.cuts_by_tokens:
                                    engine.set_accumulation_boundary(None)
                            else:
                                engine.step()
                            _add(sums, output)
                        sums["tokens"] += float(batch["response_mask"].sum())
                        sums["weight"] += float(weight)
                    if applied["policy"]:  # a skipped update (train.on_nonfinite: skip_step) changed no weight
                        state.policy_version += 1
            train_seconds = time.perf_counter() - train_started
            # 4. Metrics and checkpoint.
            state.step = step
            state.elapsed_s = time.perf_counter() - run_started
            state.strategy = strategy.state_dict()
            record = online_record(_global_sums({**sums, **rollout.metric_sums(), **targets.metric_sums()}, device))
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
            if len(parts) > 1:  # each engine's own norm (`critic_grad_norm`, ...) and every other engine's LR
                for part, engine in parts.items():
                    record[f"{part}_grad_norm"] = engine.grad_norm
                    if part != "policy":
                        record[f"{part}_lr"] = lrs[part]
            _add_skipped(record, run, policy)
            evaluator.after_step(step, record, checkpoints)  # timed apart: not in rollout_s or train_s
            _close_step(run, state, record, metrics, checkpoints)
    finally:
        checkpoints.close()  # a background save in flight finishes (or says why not)
        metrics.close()
    return state


TRAIN_LOOPS = {"offline": train_offline, "online": train_online}
