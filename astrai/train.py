"""Entry point: `deepspeed astrai/train.py --config configs/<job>.yaml [--set key.path=value ...]`.

Without the launcher (`python astrai/train.py --config ...`) it runs as a single rank.
Exit codes: 0 done, 1 the run failed (data, model, checkpoint), 2 the job file is wrong.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    import _script_path  # noqa: F401  (run as a script: astrai/_script_path.py puts the repository root first)

import argparse
import logging
from pathlib import Path

from astrai.launch.job_checks import load_and_check

logger = logging.getLogger("astrai")

# online_ppo shorthands: `--ppo_gamma 0.99` is `--set rl.gamma=0.99` (applied after every --set).
SHORTHANDS = {"ppo_gamma": "rl.gamma", "ppo_gae_lambda": "rl.gae_lambda", "ppo_vf_coef": "rl.vf_coef"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrai/train.py", description="Train a model from one job YAML.")
    parser.add_argument("--config", required=True, help="job YAML (see docs/guides/config.md)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a key (value parsed as YAML); repeatable",
    )
    for option, key in SHORTHANDS.items():
        parser.add_argument(
            f"--{option}", type=float, default=None, metavar="X", help=f"online_ppo: the same as --set {key}=X"
        )
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    args.set = args.set + [
        f"{key}={getattr(args, option)!r}" for option, key in SHORTHANDS.items() if getattr(args, option) is not None
    ]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from astrai.versions import VersionError, check_versions

    try:
        check_versions()  # before any rank works: a torch, deepspeed or transformers below pyproject.toml's floor
    except VersionError as error:
        print(f"astrai: {error}", file=sys.stderr)
        return 1
    from astrai.launch.launcher_watch import watch_launchers

    watch_launchers()  # a rank of DeepSpeed's launcher stops within seconds when that launcher is gone
    from astrai.config import ConfigError

    try:
        job = load_and_check(args.config, args.set)
    except ConfigError as error:
        print(f"astrai: {error}", file=sys.stderr)
        return 2

    from astrai.config import dump_job
    from astrai.engine import module_parameters, release_malloc, tune_malloc, tunes_malloc
    from astrai.errors import AstraiError
    from astrai.launch.output_lock import describe_os_error
    from astrai.launch.rank_start import RankStart
    from astrai.training.build import build_run
    from astrai.training.loops import TRAIN_LOOPS

    start = RankStart(job, args.config)
    if (code := start.open()) is not None:
        return code
    dist = start.dist
    if job.runtime.tune_malloc is True:
        tune_malloc()
    elif job.runtime.tune_malloc == "auto":  # from the start: a large model's build leaves the heap as it found it
        release_malloc(log=False)
    try:
        start.agree_on_lock()  # every rank stops here, together, when output_dir is taken
        output_dir = Path(job.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        if dist.is_main:
            (output_dir / "job.yaml").write_text(dump_job(job))
        # One gather of every rank's facts: mismatched versions or missing GPUs stop all ranks together.
        start.preflight()
        run = build_run(job, dist, args.config)
        if job.runtime.tune_malloc == "auto":  # a small model keeps its step's buffers, once its size is known
            parameters = module_parameters(run.engines["policy"].module)
            logger.info("runtime.tune_malloc: auto, for %.0fM policy parameters", parameters / 1e6)
            if tunes_malloc("auto", parameters):
                tune_malloc()
            else:
                release_malloc()
        state = TRAIN_LOOPS[run.strategy.loop](run)
        if job.export.on_finish and dist.is_main:
            from astrai.export.hf import export_finished_run

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
        start.close()


if __name__ == "__main__":
    sys.exit(main())
