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

from lib.job_yaml import (
    JobFileError,
    check_known_keys,
    host_path,
    load_job_file,
    read_env_file,
    run_cli,
    section,
    text_value,
)
from train_runtime import COMPOSE_DIR, check_devices_all, compose_project, infra_variables, shell_lines

SERVE_KEYS = ("model_dir", "image", "port", "served_model_name", "extra_args")
DEFAULT_IMAGE = "vllm/vllm-openai:latest"
DEFAULT_PORT = 8000
SHARED_INFRA = ("TRAIN_JOB_NAME", "TRAIN_SHM_SIZE", "CUDA_VISIBLE_DEVICES")  # what the server takes from infra:


def serve_variables(document: dict, job_file: Path) -> dict[str, str | None]:
    """Variable -> value for each serve: key the YAML sets, plus infra's GPUs, shm size and job name."""
    infra = infra_variables(document, job_file)
    variables = {name: infra[name] for name in SHARED_INFRA if name in infra}
    serve = section(document, "serve", job_file)
    check_known_keys(serve, SERVE_KEYS, "serve", job_file)
    model_dir = text_value(serve, "model_dir", "serve", job_file)
    if model_dir is not None:
        variables["SERVE_MODEL_DIR"] = host_path(model_dir, job_file)
    image = text_value(serve, "image", "serve", job_file)
    if image is not None:
        variables["SERVE_IMAGE"] = image
    port = serve.get("port")
    if port is not None:
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise JobFileError(f"{job_file}: serve.port: expected a port number (1-65535), got {port!r}")
        variables["SERVE_PORT"] = str(port)
    name = text_value(serve, "served_model_name", "serve", job_file)
    if name is not None:
        variables["SERVE_MODEL_NAME"] = name
    extra_args = serve.get("extra_args")
    if extra_args is not None:
        scalars = isinstance(extra_args, list) and all(
            isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in extra_args
        )
        if not scalars:
            raise JobFileError(
                f"{job_file}: serve.extra_args: expected a list of arguments like ['--max-model-len', 4096], got "
                f"{extra_args!r}"
            )
        # One string, quoted for the server's `sh -c 'eval set -- ...'`, so each argument arrives intact.
        variables["SERVE_EXTRA_ARGS"] = shlex.join(str(argument) for argument in extra_args)
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
