"""Everything that can be wrong with a job file, found before any rank does work.

Shared by the entry points that read a job: astrai/train.py (every rank, before the rendezvous),
`python -m astrai launch` (before any node starts) and `python -m astrai plan`. It sits above config,
strategies, engine, models and rollout, whose own checks it runs, and below those entry points, so the
launcher and the planner never import the trainer.
"""

from __future__ import annotations

import os
from pathlib import Path


def load_and_check(config_path: str, overrides: list[str]):
    """Everything that can be wrong with the job file, found before any rank does work."""
    from astrai.config import ConfigError, load_job
    from astrai.eval.evaluator import check_eval_job
    from astrai.strategies import strategy_class

    job = load_job(config_path, overrides)
    try:
        strategy = strategy_class(job.train.train_type)
    except KeyError as error:
        raise ConfigError(f"{config_path}: {error.args[0]}") from None
    output_dir, hf_dir = Path(job.output_dir).resolve(), Path(job.export.hf_dir).resolve()
    if job.export.on_finish and (hf_dir == output_dir or hf_dir in output_dir.parents):  # an export replaces it whole
        raise ConfigError(
            f"{config_path}: `export.hf_dir` {job.export.hf_dir!r} is or contains `output_dir`: the export at the end "
            "would replace the run; use e.g. <output_dir>/hf"
        )
    # The launcher exports WORLD_SIZE before it starts the ranks, so batch splits are checked here too.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # The batch geometry splits over the data-parallel ranks: a sequence-parallel group shares its rows.
    size = job.parallel.sequence_parallel_size
    data_parallel = world_size // size if world_size % size == 0 else world_size
    try:
        strategy.check_job(job, data_parallel)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    check_job_parts(job, config_path, world_size)
    try:
        check_sequence_parallel(job, world_size)
        check_eval_job(job)  # checkpoint.keep_best names a metric the job's eval reports
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    return job


def check_sequence_parallel(job, world_size: int) -> None:
    """`parallel.sequence_parallel_size` against the world size and the model's attention heads (its config only,
    no weights), before any rank starts."""
    from astrai.config import ConfigError
    from astrai.engine import check_heads
    from astrai.launch.memory_plan import model_config

    size = job.parallel.sequence_parallel_size
    if size == 1:
        return
    if world_size % size:
        raise ConfigError(
            f"parallel.sequence_parallel_size: {size} does not divide the world size {world_size} "
            "(ranks = sequence_parallel_size x data-parallel ranks)"
        )
    check_heads(model_config(job, vocab_size=256), size)  # the heads do not depend on the vocabulary


def check_job_parts(job, config_path: str, world_size: int) -> None:
    """What only the libraries behind a job can judge (DeepSpeed's config parser, the transformers config
    of the model, the reward's Python module, the trackers' libraries), judged before any rank starts: ConfigError
    naming file and key."""
    from astrai.config import ConfigError
    from astrai.config.schema import known_log_level
    from astrai.data.sources import DataError, empty_files
    from astrai.engine.ds_config import DeepSpeedConfigError, check_ds_config
    from astrai.models.lora import check_lora_job
    from astrai.models.policy import check_model_config
    from astrai.observability.trackers import missing_tracker
    from astrai.rollout.rewards import RewardError, load_function
    from astrai.strategies import strategy_class
    from astrai.strategies.engine_settings import engine_config

    level = job.runtime.environment.get("ASTR_LOG_LEVEL", os.environ.get("ASTR_LOG_LEVEL"))
    try:
        if level:
            known_log_level(level)
    except ValueError as error:
        raise ConfigError(f"{config_path}: ASTR_LOG_LEVEL (runtime.environment or the shell): {error}") from None
    sources = [f"template {job.deepspeed.config}"] * bool(job.deepspeed.config)
    sources += ["deepspeed.overrides"] * bool(job.deepspeed.overrides)
    engine_parts = strategy_class(job.train.train_type).engine_parts
    try:
        for part in engine_parts:  # each engine with its own settings (the critic's lr, grad norm, ZeRO stage)
            config = engine_config(job, config_path, world_size=world_size, part=part)
            check_ds_config(config, f"the DeepSpeed config ({' + '.join(sources) or 'defaults'})")
    except DeepSpeedConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    for key, path in (("data.path", job.data.path), ("eval.data_path", job.eval.data_path if job.eval else None)):
        try:
            empty = empty_files(path) if path is not None else []
        except DataError as error:
            raise ConfigError(f"{config_path}: {error}") from None
        if empty:  # datasets' own message for one names neither the file nor the reason
            more = f" (and {len(empty) - 1} more empty files)" if len(empty) > 1 else ""
            raise ConfigError(f"{config_path}: {key}: {empty[0]} is empty: it holds no rows{more}")
    backend = job.runtime.environment.get("ASTR_BACKEND", os.environ.get("ASTR_BACKEND"))
    backend = "" if backend is None else str(backend)  # exported as apply_environment does
    problem = check_model_config(job.model, backend) or check_lora_job(job, engine_parts)
    problem = problem or missing_tracker(job.runtime)
    if problem:
        raise ConfigError(f"{config_path}: {problem}")
    reward = job.reward
    specs = [reward.function] + [component.function for component in reward.components or []] if reward else []
    for spec in filter(None, specs):
        try:
            load_function(spec)
        except RewardError as error:
            raise ConfigError(f"{config_path}: {error}") from None
