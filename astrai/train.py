"""Entry point: `deepspeed astrai/train.py --config configs/<job>.yaml [--set key.path=value ...]`.

Without the launcher (`python astrai/train.py --config ...`) it runs as a single rank.
Exit codes: 0 done, 1 the run failed (data, model, checkpoint), 2 the job file is wrong.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script, Python puts astrai/ itself first on sys.path, where our `config`, `data`, ...
    # would shadow any top-level module of the same name; put the repository root there instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("astrai")

# online_ppo shorthands: `--ppo_gamma 0.99` is `--set rl.gamma=0.99` (applied after every --set).
SHORTHANDS = {"ppo_gamma": "rl.gamma", "ppo_gae_lambda": "rl.gae_lambda", "ppo_vf_coef": "rl.vf_coef"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrai/train.py", description="Train a model from one job YAML.")
    parser.add_argument("--config", required=True, help="job YAML (see docs/guides/config.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a key (value parsed as YAML); repeatable")
    for option, key in SHORTHANDS.items():
        parser.add_argument(f"--{option}", type=float, default=None, metavar="X", help=f"online_ppo: the same as --set {key}=X")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    args.set = args.set + [f"{key}={getattr(args, option)!r}" for option, key in SHORTHANDS.items() if getattr(args, option) is not None]
    return args


def load_and_check(config_path: str, overrides: list[str]):
    """Everything that can be wrong with the job file, found before any rank does work."""
    from astrai.config import ConfigError, load_job
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
    try:
        strategy.check_job(job, world_size)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    check_job_parts(job, config_path, world_size)
    return job


def check_job_parts(job, config_path: str, world_size: int) -> None:
    """What only the libraries behind a job can judge (DeepSpeed's config parser, the transformers config
    of the model, the reward's Python module), judged before any rank starts: ConfigError naming file and key."""
    from astrai.build import engine_config
    from astrai.config import ConfigError
    from astrai.config.schema import known_log_level
    from astrai.engine.ds_config import DeepSpeedConfigError, check_ds_config
    from astrai.models.policy import check_model_config
    from astrai.rollout.rewards import RewardError, load_function

    level = job.runtime.environment.get("ASTR_LOG_LEVEL", os.environ.get("ASTR_LOG_LEVEL"))
    try:
        if level:
            known_log_level(level)
    except ValueError as error:
        raise ConfigError(f"{config_path}: ASTR_LOG_LEVEL (runtime.environment or the shell): {error}") from None
    sources = [f"template {job.deepspeed.config}"] * bool(job.deepspeed.config)
    sources += ["deepspeed.overrides"] * bool(job.deepspeed.overrides)
    try:
        for zero_stage in (None, job.critic.zero_stage) if job.train.train_type == "online_ppo" else (None,):
            config = engine_config(job, config_path, lr=job.train.lr, max_grad_norm=job.train.max_grad_norm,
                                   world_size=world_size, zero_stage=zero_stage)
            check_ds_config(config, f"the DeepSpeed config ({' + '.join(sources) or 'defaults'})")
    except DeepSpeedConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    problem = check_model_config(job.model)
    if problem:
        raise ConfigError(f"{config_path}: {problem}")
    reward = job.reward
    specs = [reward.function] + [component.function for component in reward.components or []] if reward else []
    for spec in filter(None, specs):
        try:
            load_function(spec)
        except RewardError as error:
            raise ConfigError(f"{config_path}: {error}") from None


def apply_environment(environment: dict) -> None:
    """`runtime.environment`: exported to this job's ranks; values rendered with str(), null as ''."""
    for key, value in environment.items():
        os.environ[str(key)] = "" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from astrai.launcher_watch import watch_launchers

    watch_launchers()  # a rank of DeepSpeed's launcher stops within seconds when that launcher is gone
    from astrai.config import ConfigError

    try:
        job = load_and_check(args.config, args.set)
    except ConfigError as error:
        print(f"astrai: {error}", file=sys.stderr)
        return 2
    apply_environment(job.runtime.environment)

    from astrai.build import build_run
    from astrai.config import dump_job
    from astrai.engine import all_gather_objects, set_log_format, setup_distributed, shutdown_distributed, tune_malloc
    from astrai.engine.distributed import RendezvousError
    from astrai.errors import AstraiError
    from astrai.launcher_watch import at_orphan_exit
    from astrai.run_lock import agree_on_lock, describe_os_error, lock_for_this_rank
    from astrai.preflight import preflight_check, prepare_rank_environment, write_rank_report
    from astrai.trainer import TRAIN_LOOPS

    prepare_rank_environment()  # ranks started by mpirun/srun get torch's RANK, WORLD_SIZE, LOCAL_RANK
    # Before the rendezvous (the launcher's RANK names the rank), so what setup logs (the threads per rank) is shown.
    set_log_format(int(os.environ.get("RANK", "0")), os.environ.get("ASTR_LOG_LEVEL") or job.runtime.log_level)
    lock, refusal = lock_for_this_rank(job.output_dir, args.config)  # before anything is written into output_dir
    at_orphan_exit(lock.release)
    if refusal is None:
        try:
            write_rank_report(job)  # written before the rendezvous, so it exists even if that hangs
        except OSError as error:  # the first write into output_dir: a file there, read-only, full
            print(f"astrai: {describe_os_error(error, job.output_dir)}", file=sys.stderr)
            return 1
    try:
        dist = setup_distributed(job.runtime.dist_timeout_s)
    except RendezvousError as error:
        logger.error("%s", error)
        return 1
    if job.runtime.tune_malloc:
        tune_malloc()
    try:
        agree_on_lock(refusal, all_gather_objects)  # every rank stops here, together, when output_dir is taken
        output_dir = Path(job.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        if dist.is_main:
            (output_dir / "job.yaml").write_text(dump_job(job))
        # One gather of every rank's facts: mismatched versions or missing GPUs stop all ranks together.
        preflight_check(job, dist, write_rank_report(job, dist))
        run = build_run(job, dist, args.config)
        state = TRAIN_LOOPS[run.strategy.loop](run)
        if job.export.on_finish and dist.is_main:
            from astrai.export import export_finished_run

            logger.info("exported the final policy to %s", export_finished_run(job))
        logger.info("done: %d steps, outputs in %s", state.step, output_dir)
        return 0
    except ConfigError as error:  # found only once the ranks are known (e.g. a batch that does not split over them)
        logger.error("%s: %s", args.config, error)
        return 2
    except AstraiError as error:  # data, model, tokenizer, checkpoint, export, rewards, lock, a non-finite loss, ...
        logger.error("%s", error, exc_info=bool(os.environ.get("ASTR_DEBUG")))
        return 1
    except OSError as error:  # output_dir read-only or full mid-run (the checkpoint publisher names its own)
        logger.error("%s", describe_os_error(error, job.output_dir), exc_info=bool(os.environ.get("ASTR_DEBUG")))
        return 1
    finally:
        shutdown_distributed()
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
