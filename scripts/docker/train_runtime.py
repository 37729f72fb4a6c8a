#!/usr/bin/env python3
"""Job YAML -> shell, for scripts/train.sh on the host and the trainer container's entrypoint.

  exports JOB_YAML      `export TRAIN_*=...` for each `infra:` key the YAML sets. train.sh evals them
                        before `docker compose`, whose interpolation lets the shell beat `--env-file`:
                        the YAML overrides .env.train and keys it leaves out fall back to .env.train.
                        `gpu.devices: all` prints `unset CUDA_VISIBLE_DEVICES` (empty would hide every GPU).
  plan [JOB_YAML] [--env-file F] [--launch]
                        `plan_*=...` for train.sh itself: compose project and image; with --launch also
                        the host output folder and the checkpoint a resume would load, with its parts.
                        Without a job (`train.sh build`), only .env.train and the shell name the image.
  environment JOB_YAML  `export KEY=VALUE` for `runtime.environment`; run by the entrypoint inside the
                        container, so the launcher and every rank of this job, and nothing else, see it.

python3 + PyYAML only (see lib/job_yaml.py): hosts run the wrappers without AstrAI installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path, PurePosixPath

from lib.job_yaml import (
    JobFileError,
    check_known_keys,
    export_line,
    host_path,
    load_job_file,
    parse_gpu,
    read_env_file,
    render_env_value,
    run_cli,
    section,
    text_value,
)
from lib.serve_section import serve_section_variables

REPOSITORY = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPOSITORY / "docker"  # compose resolves relative host paths (.env.train values) from here
DEFAULT_IMAGE = "astrai:latest"
DEFAULT_CHECKPOINT_DIR = REPOSITORY / "runs" / "docker"  # the compose file's default for TRAIN_CHECKPOINT_DIR
CONTAINER_OUTPUT = "/output"  # the one writable mount: infra.checkpoint_dir
CONTAINER_MOUNTS = {CONTAINER_OUTPUT: "TRAIN_CHECKPOINT_DIR", "/data": "TRAIN_DATA", "/models": "TRAIN_MODEL"}
# The container keys are the wrappers' own: validated here only (the trainer's schema accepts them as given).
HOST_KEYS = ("job_name", "data", "model", "checkpoint_dir", "gpu", "image", "shm_size")
# Multi-node keys belong to `python -m astrai launch`, which validates them; accepted here, never used.
MULTI_NODE_KEYS = ("nodes", "hostfile", "master_addr", "master_port", "launcher", "gpus_per_node")
PATH_VARIABLES = {"data": "TRAIN_DATA", "model": "TRAIN_MODEL", "checkpoint_dir": "TRAIN_CHECKPOINT_DIR"}
# The parts a resume of each train type loads (Strategy.required_parts); the rest need the policy only.
REQUIRED_PARTS = {"online_ppo": ("policy", "critic")}
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SHM_SIZE = re.compile(r"^[0-9]+(?:\.[0-9]+)?[bkmgBKMG]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STEP_DIR = re.compile(r"^step_[0-9]+$")


def infra_variables(document: dict, job_file: Path) -> dict[str, str | None]:
    """Variable -> value for each `infra:` key the YAML sets (None: unset it); TRAIN_CONFIG_FILE always."""
    infra = section(document, "infra", job_file)
    check_known_keys(infra, HOST_KEYS + MULTI_NODE_KEYS, "infra", job_file)
    variables: dict[str, str | None] = {
        "TRAIN_CONFIG_FILE": mountable(str(job_file.resolve()), "the job file", job_file)
    }
    job_name = text_value(infra, "job_name", "infra", job_file)
    if job_name is not None:
        if not _JOB_NAME.match(job_name):
            raise JobFileError(
                f"{job_file}: infra.job_name: {job_name!r} must be letters, digits, '.', '_' or '-' (it names "
                "containers)"
            )
        variables["TRAIN_JOB_NAME"] = job_name
    for key, variable in PATH_VARIABLES.items():
        value = text_value(infra, key, "infra", job_file)
        if value is not None:
            variables[variable] = mountable(host_path(value, job_file), f"infra.{key}", job_file)
    image = text_value(infra, "image", "infra", job_file)
    if image is not None:
        variables["TRAIN_IMAGE"] = image
    shm_size = infra.get("shm_size")
    if shm_size is not None:
        if isinstance(shm_size, bool) or not _SHM_SIZE.match(str(shm_size)):
            raise JobFileError(f"{job_file}: infra.shm_size: expected a size like 16g or 512m, got {shm_size!r}")
        variables["TRAIN_SHM_SIZE"] = str(shm_size)
    devices, count = parse_gpu(infra, job_file)
    if devices == "all":
        variables["CUDA_VISIBLE_DEVICES"] = None
    elif devices is not None:
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in devices)
    if count is not None or isinstance(devices, list):
        variables["TRAIN_GPU_COUNT"] = str(count if count is not None else len(devices))
    return variables


def mountable(path: str, key: str, job_file: Path) -> str:
    """`path`, unless a ':' would break compose's `host:container[:mode]` volume syntax."""
    if ":" in path:
        raise JobFileError(f"{job_file}: {key}: {path!r} contains ':', which a compose volume cannot mount")
    return path


def job_environment(document: dict, job_file: Path) -> dict[str, str]:
    """`runtime.environment` rendered as the trainer renders it: str() of each value, null as ''."""
    section(document, "runtime", job_file)
    environment = section(document, "runtime.environment", job_file)
    rendered = {}
    for name, value in environment.items():
        where = f"{job_file}: runtime.environment.{name}"
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise JobFileError(f"{where}: not a valid environment variable name")
        if name == "CUDA_VISIBLE_DEVICES":
            raise JobFileError(
                f"{where}: choose the job's GPUs with infra.gpu.devices (the launcher must know them too)"
            )
        if isinstance(value, (dict, list)):
            raise JobFileError(
                f"{where}: expected a string, number, bool or null, got {type(value).__name__} {value!r}"
            )
        rendered[name] = render_env_value(value)
    return rendered


def check_host_sections(document: dict, job_file: Path) -> None:
    """Fail on the host, not in the container: runtime.environment, and serve:, which only the wrappers check."""
    job_environment(document, job_file)
    serve_section_variables(document, job_file)


def shell_lines(variables: dict[str, str | None]) -> str:
    """`export NAME=value` per variable, `unset NAME` for None, one per line."""
    lines = [f"unset {name}" if value is None else export_line(name, value) for name, value in variables.items()]
    return "".join(f"{line}\n" for line in lines)


def compose_project(job_name: str) -> str:
    """Compose project of a job: one per job, so jobs on separate GPU groups of a host never touch each other."""
    return "astrai-" + (re.sub(r"[^a-z0-9_-]+", "-", job_name.lower()).strip("-_") or "job")


def plan(document: dict, job_file: Path | None, environ: dict, env_file: dict, *, launch: bool) -> dict[str, str]:
    """What train.sh needs besides the exports; each value is the YAML's, else the shell's, else the env file's."""
    variables = infra_variables(document, job_file) if job_file else {}
    if job_file:
        check_host_sections(document, job_file)

    def effective(name: str) -> str | None:
        if name in variables:
            return variables[name]
        return environ.get(name) or env_file.get(name) or None

    check_devices_all(variables, env_file, job_file)
    job_name = effective("TRAIN_JOB_NAME") or (job_file.stem if job_file else "astrai")
    result = {
        "job_name": job_name,
        "project": compose_project(job_name),
        "image": effective("TRAIN_IMAGE") or DEFAULT_IMAGE,
    }
    if launch and job_file:
        result.update(launch_plan(document, job_file, effective))
    return result


def check_devices_all(variables: dict, env_file: dict, job_file: Path | None) -> None:
    """`gpu.devices: all` can only unset the shell's CUDA_VISIBLE_DEVICES; one in .env.train would still
    reach compose."""
    if (
        "CUDA_VISIBLE_DEVICES" in variables
        and variables["CUDA_VISIBLE_DEVICES"] is None
        and env_file.get("CUDA_VISIBLE_DEVICES")
    ):
        raise JobFileError(
            f"{job_file}: infra.gpu.devices: `all`, but the env file sets "
            f"CUDA_VISIBLE_DEVICES={env_file['CUDA_VISIBLE_DEVICES']}, which compose would pass on: remove it there, "
            "or list the devices in the job YAML"
        )


def launch_plan(document: dict, job_file: Path, effective) -> dict[str, str]:
    """Host output folder, and the checkpoint (with its required parts) that the trainer would resume from."""
    mounts = {root: effective(variable) for root, variable in CONTAINER_MOUNTS.items()}
    mounts[CONTAINER_OUTPUT] = mounts[CONTAINER_OUTPUT] or str(DEFAULT_CHECKPOINT_DIR)
    mounts = {root: value and str((COMPOSE_DIR / Path(value).expanduser()).resolve()) for root, value in mounts.items()}
    output_dir = document.get("output_dir")
    export_dir = section(document, "export", job_file).get("hf_dir")
    for key, value in (("output_dir", output_dir), ("export.hf_dir", export_dir)):
        if value is not None and not is_under(str(value), CONTAINER_OUTPUT):
            raise JobFileError(
                f"{job_file}: {key}: {value!r} is not under {CONTAINER_OUTPUT}, where the container mounts "
                "infra.checkpoint_dir; anything written elsewhere is lost with the container (use e.g. "
                f"{CONTAINER_OUTPUT}/<job name>)"
            )
    train_type = section(document, "train", job_file).get("train_type")
    result = {
        "checkpoint_dir": mounts[CONTAINER_OUTPUT],
        "train_type": str(train_type),
        "resume_parts": ",".join(REQUIRED_PARTS.get(train_type, ("policy",))),
        "resume_dir": "",
        "resume_latest": "0",
    }
    resume = section(document, "checkpoint", job_file).get("resume") or "auto"
    if resume == "auto" and isinstance(output_dir, str):
        checkpoints = Path(to_host(output_dir, "output_dir", mounts, job_file)) / "checkpoints"
        if checkpoints.is_dir() and any(
            _STEP_DIR.match(child.name) and child.is_dir() for child in checkpoints.iterdir()
        ):
            result.update(resume_dir=str(checkpoints), resume_latest="1")
    elif resume not in ("auto", "never"):
        checkpoint = to_host(str(resume), "checkpoint.resume", mounts, job_file)
        if not Path(checkpoint).is_dir():
            raise JobFileError(
                f"{job_file}: checkpoint.resume: {resume!r} is {checkpoint} on this host, which is not a directory"
            )
        result["resume_dir"] = checkpoint
    return result


def is_under(container_path: str, root: str) -> bool:
    path = PurePosixPath(container_path)
    return path == PurePosixPath(root) or PurePosixPath(root) in path.parents


def to_host(container_path: str, key: str, mounts: dict[str, str | None], job_file: Path) -> str:
    """The host path of a container path under one of the mounts; an error naming `key` otherwise."""
    for root, host in mounts.items():
        if is_under(container_path, root):
            if host is None:
                variable = CONTAINER_MOUNTS[root]
                infra_key = next(name for name, path_variable in PATH_VARIABLES.items() if path_variable == variable)
                raise JobFileError(
                    f"{job_file}: {key}: {container_path!r} is under {root}, where nothing is mounted "
                    f"(set infra.{infra_key}, or {variable} in .env.train)"
                )
            return str(Path(host) / PurePosixPath(container_path).relative_to(root))
    raise JobFileError(
        f"{job_file}: {key}: {container_path!r} is not under a mounted folder ({', '.join(CONTAINER_MOUNTS)})"
    )


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(prog="train_runtime.py", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("exports", "plan", "environment"))
    parser.add_argument("job_file", type=Path, nargs="?", help="the job YAML (optional for plan only)")
    parser.add_argument("--env-file", type=Path, default=None, help="the .env.train compose falls back to")
    parser.add_argument("--launch", action="store_true", help="plan: also the output folder and resume check")
    args = parser.parse_args(argv)
    if args.job_file is None and args.command != "plan":
        raise JobFileError(f"{args.command} needs the job YAML")
    document = load_job_file(args.job_file) if args.job_file else {}
    if args.command == "exports":
        check_host_sections(document, args.job_file)  # validated here too: a bad section fails before any container
        return shell_lines(infra_variables(document, args.job_file))
    if args.command == "environment":
        return shell_lines(job_environment(document, args.job_file))
    env_file = read_env_file(args.env_file) if args.env_file else {}
    settings = plan(document, args.job_file, dict(os.environ), env_file, launch=args.launch)
    return "".join(f"plan_{name}={shlex.quote(value)}\n" for name, value in settings.items())


if __name__ == "__main__":
    run_cli(main)
