"""When an eval runs, what it reports, how it stays out of the run's way, and the checks of `eval:` and
`checkpoint.keep_best` before any rank starts. The loops call `Evaluator` in two lines; the work is in
`offline.py` (the offline loop's train types, through `Strategy.eval_sums` / `eval_metrics`) and `rollout_eval.py`
(grpo, online_ppo: generation and rewards).

An eval runs every `eval.every_steps` steps, at the last step of the run, and with `eval.at_start` before the
first step of a fresh run (logged as step 0). It is sharded over all ranks, takes no gradients, runs the engines
in eval mode and restores every RNG it could draw from (`isolation.py`): a run with eval follows exactly the
trajectory of the same run without it. Its time is logged as `eval_s` and kept out of the step's tokens/s,
rollout_s and train_s. Its figures go into the step's metrics record as `eval/<name>` and, when the step
publishes a checkpoint, into that checkpoint's manifest (`meta.eval`), where `checkpoint.keep_best` finds them.
"""

from __future__ import annotations

import time

from astrai.config import ConfigError
from astrai.engine import all_reduce_sums
from astrai.eval.isolation import evaluating
from astrai.eval.offline import evaluate_offline
from astrai.eval.rollout_eval import (
    SAMPLES_FILE,
    append_records,
    online_eval_sums,
    online_figures,
    online_metric_names,
    samples_per_prompt,
)


def eval_metric_names(job) -> list[str]:
    """Every `eval/<name>` the job's eval reports (empty without an `eval:` section)."""
    from astrai.strategies import strategy_class

    if job.eval is None:
        return []
    strategy = strategy_class(job.train.train_type)
    names = online_metric_names(job) if strategy.loop == "online" else list(strategy.eval_metric_names)
    return [f"eval/{name}" for name in names]


def check_eval_job(job) -> None:
    """eval.pass_k and `checkpoint.keep_best` against the job, before any rank starts: ConfigError naming the fix."""
    from astrai.strategies import strategy_class

    if job.eval is not None and strategy_class(job.train.train_type).loop == "online":
        if samples_per_prompt(job) < job.eval.pass_k:
            raise ConfigError(
                f"eval.pass_k {job.eval.pass_k} > the {samples_per_prompt(job)} answers sampled per eval prompt "
                "(eval.samples_per_prompt, else rollout.group_size): pass@k needs at least k"
            )
    best = job.checkpoint.keep_best
    if best is None:
        return
    valid = eval_metric_names(job)
    if not valid:
        raise ConfigError("checkpoint.keep_best ranks checkpoints by an eval metric: add an `eval:` section")
    if best.metric not in valid:
        raise ConfigError(
            f"checkpoint.keep_best.metric {best.metric!r} is not one this job's eval reports ({', '.join(valid)})"
        )
    every_checkpoint, every_eval = job.checkpoint.every_steps, job.eval.every_steps
    if every_checkpoint is not None and (every_eval is None or every_checkpoint % every_eval):
        raise ConfigError(
            f"checkpoint.keep_best compares checkpoints by the eval of their step: checkpoint.every_steps "
            f"({every_checkpoint}) must be a multiple of eval.every_steps ({every_eval})"
        )


class Evaluator:
    """The loops' handle on evaluation; does nothing for a job without an `eval:` section."""

    def __init__(self, run, start_step: int):
        self.run, self.settings = run, run.job.eval
        self.samples_path = run.output_dir / SAMPLES_FILE
        if self.settings is not None and run.dist.is_main and self.samples_path.exists():
            from astrai.observability.metrics import trim_metrics

            trim_metrics(self.samples_path, start_step)  # a resume drops what the interrupted run wrote after it

    def due(self, step: int) -> bool:
        every = self.settings.every_steps if self.settings is not None else None
        return self.settings is not None and (step == self.run.total_steps or (every is not None and step % every == 0))

    def evaluate(self, step: int) -> dict[str, float]:
        """`eval/<name>` figures of the current weights at `step` (every rank, the same), plus `eval_s`."""
        run, started = self.run, time.perf_counter()
        with evaluating(run.engines.values(), run.dist.device):
            if run.strategy.loop == "online":
                sums, records = online_eval_sums(run, step)
                names = sorted(sums)
                totals = dict(zip(names, all_reduce_sums([sums[name] for name in names], run.dist.device)))
                figures = online_figures(totals, self.settings.pass_k)
                if run.dist.is_main:
                    append_records(self.samples_path, records)
            else:
                figures = evaluate_offline(run)
        record = {f"eval/{name}": value for name, value in figures.items()}
        record["eval_s"] = time.perf_counter() - started
        return record

    def at_start(self, step: int, metrics) -> None:
        """`eval.at_start`: evaluate the starting weights of a fresh run, logged as step 0."""
        if self.settings is not None and self.settings.at_start and step == 0:
            metrics.log(0, self.evaluate(0))

    def after_step(self, step: int, record: dict, checkpoints) -> None:
        """When due, evaluate after the step's update: the figures join the step's record and the manifest of a
        checkpoint published at this step."""
        if self.due(step):
            figures = self.evaluate(step)
            record.update(figures)
            checkpoints.eval_figures = (step, {k: v for k, v in figures.items() if k.startswith("eval/")})
