"""The training loops. One per family, each readable top to bottom.

`train_offline` serves `seq`, `sft` and `dpo`: batches -> strategy loss -> engine backward/step ->
metrics -> publish a checkpoint every N steps and at the end. Steps count optimizer updates from 1.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch

from astrai.build import Run
from astrai.checkpointing import TrainingCheckpoints, TrainerState
from astrai.engine import all_reduce_sum
from astrai.metrics import MetricsLog

logger = logging.getLogger("astrai.trainer")


def _to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _global_sums(sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum each metric over ranks in one collective."""
    if not sums:
        return {}
    keys = sorted(sums)
    tensor = torch.tensor([sums[key] for key in keys], dtype=torch.float64)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        tensor = tensor.to(device)
        torch.distributed.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist()))


def train_offline(run: Run) -> TrainerState:
    job, strategy, policy = run.job, run.strategy, run.engines["policy"]
    accumulation, world = job.train.grad_accum_steps, run.dist.world_size
    checkpoints = TrainingCheckpoints(run)
    state = checkpoints.resume()  # restores engines, RNG and the data position, or starts fresh
    metrics = MetricsLog(
        run.output_dir, is_main=run.dist.is_main, total_steps=run.total_steps, start_step=state.step,
        tensorboard=job.runtime.tensorboard, progress_bar=job.runtime.progress_bar,
    )
    batches = run.order.micro_batches(state.consumed_samples)
    run_started = time.perf_counter() - state.elapsed_s
    policy.train()
    try:
        for step in range(state.step + 1, run.total_steps + 1):
            step_started = time.perf_counter()
            micro_batches = [strategy.collate([run.dataset[i] for i in next(batches)]) for _ in range(accumulation)]
            # Every micro-batch of the step, on every rank, divides by the same count: the update is the
            # token mean over the whole step, whatever the split into micro-batches and ranks.
            loss_weight = all_reduce_sum(sum(strategy.loss_weight(b) for b in micro_batches), run.dist.device)
            normalizer = max(loss_weight, 1.0) / (world * accumulation)
            lr = policy.lr
            sums: dict[str, float] = defaultdict(float)
            for batch in micro_batches:
                output = strategy.compute_loss(policy, _to_device(batch, run.dist.device), normalizer)
                policy.backward(output.loss)
                policy.step()
                for key, value in output.sums.items():
                    sums[key] += value
                sums["tokens"] += float(batch["attention_mask"].sum())
            state.step, state.policy_version = step, step
            state.consumed_samples += run.samples_per_step
            state.epoch = run.order.epoch_of(state.consumed_samples)
            totals = _global_sums(sums, run.dist.device)
            step_seconds = time.perf_counter() - step_started
            state.elapsed_s = time.perf_counter() - run_started
            weight = max(totals.pop("weight", 1.0), 1.0)
            tokens = totals.pop("tokens")
            record = {key: value / weight for key, value in totals.items()}
            record.update(lr=lr, grad_norm=policy.grad_norm, tokens=int(tokens), tokens_per_s=tokens / step_seconds,
                          elapsed_s=state.elapsed_s, epoch=state.epoch, samples=state.consumed_samples)
            if step % job.train.log_every_steps == 0 or step == run.total_steps:
                metrics.log(step, record)
            metrics.advance()
            if checkpoints.due(step, run.total_steps):
                checkpoints.save(state, metrics)
    finally:
        metrics.close()
    return state


TRAIN_LOOPS = {"offline": train_offline}
