#!/usr/bin/env python3
"""Job YAML -> shell, for scripts/serve.sh: the `serve:` section (plus infra's GPUs, shm size, job name).

  exports JOB_YAML               `export SERVE_*=...` for each serve: key the YAML sets, and the GPU choice
                                 of infra.gpu.devices exactly as train.sh exports it (`all`: unset).
  plan JOB_YAML [--env-file F]   `plan_*=...`: compose project, the model folder (checked to be a Hugging
                                 Face export), port, served model name.

The server container reserves every GPU; CUDA_VISIBLE_DEVICES does the only filtering, as for the trainer.
python3 + PyYAML only (see lib/job_yaml.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from lib.job_yaml import JobFileError, load_job_file, read_env_file, run_cli
from lib.serve_section import DEFAULT_IMAGE, DEFAULT_PORT, serve_section_variables
from train_runtime import COMPOSE_DIR, check_devices_all, compose_project, infra_variables, shell_lines

SHARED_INFRA = ("TRAIN_JOB_NAME", "TRAIN_SHM_SIZE", "CUDA_VISIBLE_DEVICES")  # what the server takes from infra:


def serve_variables(document: dict, job_file: Path) -> dict[str, str | None]:
    """Variable -> value for each serve: key the YAML sets, plus infra's GPUs, shm size and job name."""
    infra = infra_variables(document, job_file)
    variables = {name: infra[name] for name in SHARED_INFRA if name in infra}
    variables.update(serve_section_variables(document, job_file))
    return variables


def plan(document: dict, job_file: Path, environ: dict, env_file: dict) -> dict[str, str]:
    """Project, model folder, port and name the server will use: the YAML's, else the shell's, else the env file's."""
    variables = serve_variables(document, job_file)
    check_devices_all(variables, env_file, job_file)

    def effective(name: str) -> str | None:
        return variables[name] if name in variables else environ.get(name) or env_file.get(name) or None

    model_dir = effective("SERVE_MODEL_DIR")
    if model_dir is None:
        raise JobFileError(f"{job_file}: serve.model_dir: no model to serve (set it, or SERVE_MODEL_DIR in .env.train)")
    model_dir = str((COMPOSE_DIR / Path(model_dir).expanduser()).resolve())
    if not (Path(model_dir) / "config.json").is_file():
        raise JobFileError(
            f"{job_file}: serve.model_dir: {model_dir} is not a Hugging Face model folder (no config.json); "
            "write one with `python -m astrai export-hf <checkpoint> <folder>` or export.on_finish"
        )
    job_name = effective("TRAIN_JOB_NAME") or job_file.stem
    return {
        "project": compose_project(job_name).replace("astrai-", "astrai-serve-", 1),
        "model_dir": model_dir,
        "model_name": effective("SERVE_MODEL_NAME") or job_name,
        "port": effective("SERVE_PORT") or str(DEFAULT_PORT),
        "image": effective("SERVE_IMAGE") or DEFAULT_IMAGE,
    }


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(prog="serve_runtime.py", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("exports", "plan"))
    parser.add_argument("job_file", type=Path, help="the job YAML")
    parser.add_argument("--env-file", type=Path, default=None, help="the .env.train compose falls back to")
    args = parser.parse_args(argv)
    document = load_job_file(args.job_file)
    if args.command == "exports":
        return shell_lines(serve_variables(document, args.job_file))
    env_file = read_env_file(args.env_file) if args.env_file else {}
    settings = plan(document, args.job_file, dict(os.environ), env_file)
    return "".join(f"plan_{name}={shlex.quote(value)}\n" for name, value in settings.items())


if __name__ == "__main__":
    run_cli(main)
