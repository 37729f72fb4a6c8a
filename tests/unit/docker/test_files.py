"""docker/docker-compose.yml, docker/Dockerfile, .dockerignore and the examples, checked as files.

`docker compose config` needs an engine that does not run here, so the compose file's structure is
read with PyYAML and held to what the wrappers export and the entrypoint expects.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts" / "docker"))

import train_runtime  # noqa: E402
from lib.job_yaml import read_env_file  # noqa: E402

COMPOSE = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
VARIABLE = re.compile(r"(?<!\$)\$\{([A-Z_]+)(?::-([^}]*))?\}")
VOLUME = re.compile(r"^(\$\{[^}]*\}|[^:]+):([^:]+)(?::(ro|rw))?$")  # host (maybe ${VAR:-default}):target[:mode]


def default_of(text: str, name: str) -> str | None:
    return next((default for found, default in VARIABLE.findall(text) if found == name), None)


def mounts(service: str) -> dict[str, tuple[str, str]]:
    """Container path -> (host side, mode) of a service's volumes."""
    table = {}
    for volume in SERVICES[service]["volumes"]:
        host, target, mode = VOLUME.match(volume).groups()
        table[target] = (host, mode or "rw")
    return table


def test_services_pin_images_and_never_build():
    assert set(SERVICES) == {"trainer", "server"}
    for name, service in SERVICES.items():
        assert "build" not in service, f"{name}: a run must never build; only `scripts/train.sh build` does"
        assert service["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
        ]
        assert "CUDA_VISIBLE_DEVICES" in service["environment"]  # passed through only when set, never as a default
        assert service["ulimits"]["memlock"] == -1 and default_of(service["shm_size"], "TRAIN_SHM_SIZE") == "16g"
    assert (
        SERVICES["trainer"]["image"] == "${TRAIN_IMAGE:-astrai:latest}"
        and SERVICES["trainer"]["pull_policy"] == "never"
    )
    assert SERVICES["server"]["image"] == "${SERVE_IMAGE:-vllm/vllm-openai:latest}"


def test_services_take_exactly_the_intended_environment():
    """Nothing of the host shell reaches a container unless named here (NCCL_* included: a job lists its
    workarounds in runtime.environment, which the entrypoint exports); no env_file hands a file over whole."""
    assert SERVICES["trainer"]["environment"] == [
        "TRAIN_CONFIG=/job/job.yaml",
        "TRAIN_JOB_NAME",
        "TRAIN_GPU_COUNT",
        "CUDA_VISIBLE_DEVICES",
    ]
    assert SERVICES["server"]["environment"] == ["SERVE_MODEL_NAME", "SERVE_EXTRA_ARGS", "CUDA_VISIBLE_DEVICES"]
    for name, service in SERVICES.items():
        assert "env_file" not in service, name


def test_trainer_mounts_match_the_runtime():
    table = mounts("trainer")
    assert table["/job/job.yaml"][1] == "ro" and "TRAIN_CONFIG=/job/job.yaml" in SERVICES["trainer"]["environment"]
    for container_path, variable in train_runtime.CONTAINER_MOUNTS.items():
        host, mode = table[container_path]
        assert VARIABLE.fullmatch(host).group(1) == variable
        assert mode == ("rw" if container_path == train_runtime.CONTAINER_OUTPUT else "ro")
    compose_dir = REPO / "docker"
    output_default = default_of(table["/output"][0], "TRAIN_CHECKPOINT_DIR")
    assert (compose_dir / output_default).resolve() == train_runtime.DEFAULT_CHECKPOINT_DIR
    for container_path in ("/data", "/models"):
        assert (compose_dir / VARIABLE.fullmatch(table[container_path][0]).group(2) / "README.md").is_file()
    assert (compose_dir / default_of(table["/job/job.yaml"][0], "TRAIN_CONFIG_FILE")).is_file()
    assert mounts("server")["/model"][1] == "ro"


def test_entrypoint_is_the_same_everywhere_and_executable():
    entry = SERVICES["trainer"]["entrypoint"]
    assert f"ENTRYPOINT {entry}".replace("'", '"') in DOCKERFILE
    script = REPO / entry[0].replace("/workspace/", "")
    assert script.is_file() and script.stat().st_mode & 0o111
    for stage in ("AS cpu", "AS gpu"):
        assert stage in DOCKERFILE
    assert "DS_BUILD_CPU_ADAM=1" in DOCKERFILE and "--no-build-isolation" in DOCKERFILE


def test_every_compose_variable_is_documented_and_exported():
    text = (REPO / "docker" / "docker-compose.yml").read_text()
    variables = {name for name, _ in VARIABLE.findall(text)}
    guide = (REPO / "docs" / "developer" / "docker-training.md").read_text()
    example = read_env_file(REPO / ".env.train.example")  # commented lines: read the names from the text instead
    template = (REPO / ".env.train.example").read_text()
    for name in variables:
        assert f"`{name}`" in guide, f"{name} is not in docs/developer/docker-training.md"
        assert name == "TRAIN_CONFIG_FILE" or name in template, f"{name} is not in .env.train.example"
    assert not example  # a template only: every line commented


def test_dockerignore_keeps_local_state_out_and_the_project_in():
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]

    def ignored(path: str) -> bool:
        return any(
            fnmatch.fnmatch(path, pattern.removeprefix("**/")) or path.split("/")[0] == pattern for pattern in patterns
        )

    for path in (".venv", "runs", ".git", "__pycache__", ".pytest_cache", ".env.train", "astrai.egg-info"):
        assert ignored(path), path
    project = ("astrai", "scripts", "configs", "ds_configs", "data", "docker", "pyproject.toml", "constraints.txt")
    for path in (*project, "README.md"):
        assert not ignored(path), path


def test_docker_example_configs_plan_cleanly_and_set_no_nccl_workaround():
    """NCCL workarounds are opt-in per job (the guide shows them), never in the Docker examples' defaults."""
    for path in sorted((REPO / "configs").glob("docker_example*.yaml")):
        assert "NCCL_" not in path.read_text(), path
        document = yaml.safe_load(path.read_text())
        settings = train_runtime.plan(document, path, {}, {}, launch=True)
        assert settings["project"].startswith("astrai-") and settings["resume_parts"] == "policy"
