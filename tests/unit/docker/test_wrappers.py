"""scripts/train.sh, scripts/serve.sh and the trainer entrypoint, run for real by bash.

No Docker engine runs here: a fake `docker` first on PATH records each call's arguments and
environment (and a fake `deepspeed` does the same for the entrypoint), so the tests check exactly
what would reach docker compose and the launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.checkpoint import CheckpointPublisher

REPO = Path(__file__).resolve().parents[3]
RECORDER = """#!/usr/bin/env bash
# Fake {name}: records argv (NUL-separated) and the environment of each call, in call order.
n=$(cat "$FAKE_LOG/count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$FAKE_LOG/count"
printf '%s\\0' {name} "$@" > "$FAKE_LOG/$n.args"
env -0 > "$FAKE_LOG/$n.env"
if [ "$1 $2" = "image inspect" ] && [ -n "${{FAKE_NO_IMAGE:-}}" ]; then exit 1; fi
exit 0
"""


class Host:
    """A tmp host: fake binaries, an env file location, and the calls they recorded."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.log = root / "log"
        self.bin.mkdir()
        self.log.mkdir()
        for name in ("docker", "deepspeed"):
            (self.bin / name).write_text(RECORDER.format(name=name))
            (self.bin / name).chmod(0o755)
        self.env_file = root / ".env.train"

    def environment(self, **extra: str) -> dict[str, str]:
        keep = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("TRAIN_", "SERVE_", "CUDA_", "ASTRAI_"))
        }
        keep.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            FAKE_LOG=str(self.log),
            TRAIN_ENV_FILE=str(self.env_file),
            ASTRAI_HOST_PYTHON=sys.executable,
            ASTRAI_VERIFY_PYTHON=sys.executable,
        )
        keep.update(extra)
        return keep

    def run(self, command: list[str], **extra: str) -> subprocess.CompletedProcess:
        for old in self.log.iterdir():
            old.unlink()
        environment = {k: v for k, v in self.environment(**extra).items() if v is not None}
        return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=60, cwd=self.root)

    def calls(self) -> list[tuple[list[str], dict[str, str]]]:
        count = int((self.log / "count").read_text()) if (self.log / "count").exists() else 0
        found = []
        for index in range(count):
            argv = (self.log / f"{index}.args").read_bytes().decode().split("\0")[:-1]
            pairs = (self.log / f"{index}.env").read_bytes().decode().split("\0")[:-1]
            found.append((argv, dict(pair.split("=", 1) for pair in pairs)))
        return found


@pytest.fixture
def host(tmp_path) -> Host:
    return Host(tmp_path)


def write_job(host: Host, infra: str, train_type: str = "sft", extra: str = "") -> Path:
    job = host.root / "job.yaml"
    job.write_text(
        f"output_dir: /output/demo\ntrain: {{train_type: {train_type}, max_steps: 1}}\n{extra}"
        f"infra:\n  job_name: demo\n  checkpoint_dir: ckpt\n{infra}"
    )
    return job


def train(host: Host, *arguments: str, **extra: str) -> subprocess.CompletedProcess:
    return host.run(["bash", str(REPO / "scripts" / "train.sh"), *arguments], **extra)


def only_compose(host: Host) -> tuple[list[str], dict[str, str]]:
    (compose,) = [(argv, env) for argv, env in host.calls() if argv[1] == "compose"]
    return compose


def test_only_build_builds(host):
    job = write_job(host, "  gpu: {devices: [2, 3]}\n")
    built = train(host, "build", str(job))
    assert built.returncode == 0, built.stderr
    ((argv, _),) = host.calls()
    assert argv == [
        "docker",
        "build",
        "-f",
        str(REPO / "docker" / "Dockerfile"),
        "--target",
        "gpu",
        "-t",
        "astrai:latest",
        str(REPO),
    ]

    for command, expected_tail in (("run", ["run", "--rm", "trainer"]), ("up", ["up", "-d", "trainer"])):
        launched = train(host, command, str(job))
        assert launched.returncode == 0, launched.stderr
        calls = host.calls()
        assert [argv[1:3] for argv, _ in calls] == [["image", "inspect"], ["compose", "-f"]]
        argv, env = calls[-1]
        assert argv[-len(expected_tail) :] == expected_tail and "--build" not in argv and "build" not in argv
        assert argv[2:6] == ["-f", str(REPO / "docker" / "docker-compose.yml"), "-p", "astrai-demo"]
        assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["TRAIN_GPU_COUNT"] == "2"
        assert env["TRAIN_CONFIG_FILE"] == str(job) and env["TRAIN_CHECKPOINT_DIR"] == str(host.root / "ckpt")
    assert (host.root / "ckpt").is_dir()  # made by the wrapper, so the docker daemon does not make it as root


def test_empty_cuda_visible_devices_is_stripped_and_all_leaves_it_unset(host):
    job = write_job(host, "")  # no gpu: the host's value would pass, but never an empty one
    assert train(host, "up", str(job), CUDA_VISIBLE_DEVICES="").returncode == 0
    assert "CUDA_VISIBLE_DEVICES" not in only_compose(host)[1]
    assert train(host, "up", str(job), CUDA_VISIBLE_DEVICES="1").returncode == 0
    assert only_compose(host)[1]["CUDA_VISIBLE_DEVICES"] == "1"
    job = write_job(host, "  gpu: {devices: all}\n")
    assert train(host, "up", str(job), CUDA_VISIBLE_DEVICES="0,1").returncode == 0
    assert "CUDA_VISIBLE_DEVICES" not in only_compose(host)[1]


def test_env_file_fills_what_the_yaml_leaves_out(host):
    job = write_job(host, "  data: /yaml/data\n")
    host.env_file.write_text("TRAIN_DATA=/env/data\nTRAIN_IMAGE=astrai:env\nTRAIN_MODEL=/env/models\n")
    result = train(host, "run", str(job), TRAIN_CONFIG_FILE=str(job))
    assert result.returncode == 0, result.stderr
    (inspect, _), (argv, env) = host.calls()
    assert inspect[-1] == "astrai:env"  # the image compose will use: .env.train's, the YAML names none
    assert argv[6:8] == ["--env-file", str(host.env_file)]
    assert env["TRAIN_DATA"] == "/yaml/data"  # the shell beats --env-file: the YAML wins
    assert "TRAIN_IMAGE" not in env and "TRAIN_MODEL" not in env  # left to .env.train
    assert "no job YAML" in train(host, "logs").stderr  # neither an argument nor TRAIN_CONFIG_FILE


def test_job_from_the_environment_and_the_other_commands(host):
    job = write_job(host, "")
    for command, tail in (("down", ["down"]), ("logs", ["logs", "-f", "trainer"]), ("status", ["ps", "-a", "trainer"])):
        result = train(host, command, TRAIN_CONFIG_FILE=str(job))
        assert result.returncode == 0, result.stderr
        argv, _ = only_compose(host)
        assert argv[-len(tail) :] == tail and "-p" in argv and "astrai-demo" in argv


def publish_checkpoint(root: Path, parts: list[str]) -> Path:
    def write(staging: Path) -> None:
        for part in parts:
            (staging / part).mkdir()
            (staging / part / "shard.pt").write_bytes(b"weights")
        (staging / "trainer_state.json").write_text('{"step": 4}')

    return CheckpointPublisher(root, parts=parts).publish(4, write).path


def test_resume_check_blocks_a_checkpoint_missing_a_part(host):
    publish_checkpoint(host.root / "ckpt" / "demo" / "checkpoints", ["policy"])
    job = write_job(host, "", train_type="online_ppo")
    blocked = train(host, "run", str(job))
    assert blocked.returncode == 2
    assert "lacks the part(s) critic" in blocked.stdout and "not launching" in blocked.stderr
    assert not any(argv[1] == "compose" for argv, _ in host.calls())

    assert train(host, "run", str(job), TRAIN_SKIP_RESUME_CHECK="1").returncode == 0
    job = write_job(host, "", train_type="sft")  # the policy is all sft resumes
    resumed = train(host, "up", str(job))
    assert resumed.returncode == 0, resumed.stderr
    assert "OK " in resumed.stdout and only_compose(host)[0][-2:] == ["-d", "trainer"]


def test_resume_check_runs_in_the_image_without_a_host_python(host):
    checkpoint = publish_checkpoint(host.root / "ckpt" / "demo" / "checkpoints", ["policy"])
    job = write_job(host, "", extra=f"checkpoint: {{resume: /output/demo/checkpoints/{checkpoint.name}}}\n")
    assert train(host, "run", str(job), ASTRAI_VERIFY_PYTHON="image").returncode == 0
    (_, _), (verify, _), (_, _) = host.calls()
    mounted = f"/check/{checkpoint.name}"
    assert verify[:6] == ["docker", "run", "--rm", "--entrypoint", "python", "-v"]
    assert verify[6:] == [
        f"{checkpoint}:{mounted}:ro",
        "astrai:latest",
        "-m",
        "astrai",
        "verify",
        "--quick",
        "--require-parts",
        "policy",
        mounted,
    ]


def test_clear_errors_before_any_container(host, tmp_path):
    job = write_job(host, "  gpu: {devices: [0, 0]}\n")
    bad = train(host, "run", str(job))
    assert bad.returncode == 2 and "infra.gpu.devices" in bad.stderr and not host.calls()
    assert "is not on this host: build it" in train(host, "run", str(write_job(host, "")), FAKE_NO_IMAGE="1").stderr
    missing = train(host, "run", str(job), ASTRAI_HOST_PYTHON="/nonexistent/python3")
    assert missing.returncode == 2 and "/nonexistent/python3 not found" in missing.stderr
    no_yaml = host.bin / "python-without-site-packages"
    no_yaml.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    no_yaml.chmod(0o755)
    result = train(host, "run", str(job), ASTRAI_HOST_PYTHON=str(no_yaml))
    assert result.returncode == 2 and "PyYAML is not installed" in result.stderr
    assert train(host, "bogus").returncode == 2 and train(host, "--help").returncode == 0


def model_folder(host) -> Path:
    """A folder the serve wrapper takes for a Hugging Face model (it has a config.json)."""
    model = host.root / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_serve_up_uses_the_serve_section_and_infra_gpus(host):
    model = model_folder(host)
    job = write_job(host, "  gpu: {devices: [3]}\n", extra="serve: {model_dir: hf, extra_args: [--dtype, bfloat16]}\n")
    result = host.run(["bash", str(REPO / "scripts" / "serve.sh"), "up", str(job)], CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    argv, env = only_compose(host)
    assert argv[-3:] == ["up", "-d", "server"] and "--build" not in argv and "astrai-serve-demo" in argv
    assert (env["SERVE_MODEL_DIR"], env["SERVE_MODEL_NAME"], env["CUDA_VISIBLE_DEVICES"]) == (str(model), "demo", "3")
    assert env["SERVE_EXTRA_ARGS"] == "--dtype bfloat16" and "http://localhost:8000/v1" in result.stdout
    (model / "config.json").unlink()
    failed = host.run(["bash", str(REPO / "scripts" / "serve.sh"), "up", str(job)])
    assert failed.returncode == 2 and "not a Hugging Face model folder" in failed.stderr


def test_serve_run_stays_in_the_foreground_and_never_builds(host):
    model_folder(host)
    job = write_job(host, "  gpu: {devices: all}\n", extra="serve: {model_dir: hf}\n")
    result = host.run(["bash", str(REPO / "scripts" / "serve.sh"), "run", str(job)], CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 0, result.stderr
    argv, env = only_compose(host)
    assert argv[-4:] == ["run", "--rm", "--service-ports", "server"] and "--build" not in argv and "build" not in argv
    assert "CUDA_VISIBLE_DEVICES" not in env  # devices: all


def server_entrypoint() -> list[str]:
    """The server service's entrypoint as the container runs it: compose turns `$$` into `$`."""
    import yaml

    entry = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())["services"]["server"]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"] and "${" not in entry[2].replace(
        "$${", ""
    )  # nothing left for compose to interpolate
    return ["sh", "-c", entry[2].replace("$$", "$"), *entry[3:]]


def test_server_entrypoint_unsets_an_empty_gpu_list_and_passes_extra_args_intact(host, tmp_path):
    """Run by a real sh with a fake python3 (standing in for vLLM's) first on PATH."""
    sys.path.insert(0, str(REPO / "scripts" / "docker"))
    import serve_runtime

    fake = tmp_path / "fake-vllm"
    fake.mkdir()
    (fake / "python3").write_text(RECORDER.format(name="python3"))
    (fake / "python3").chmod(0o755)
    extra_args = ["--max-model-len", 4096, "--chat-template", "{{ messages | join(' ') }}", "it's; $HOME `id` \\n", ""]
    document = {
        "infra": {"job_name": "demo"},
        "serve": {"model_dir": "hf", "extra_args": extra_args, "served_model_name": "my model"},
    }
    variables = serve_runtime.serve_variables(document, tmp_path / "job.yaml")
    served = {
        "SERVE_EXTRA_ARGS": variables["SERVE_EXTRA_ARGS"],
        "SERVE_MODEL_NAME": variables["SERVE_MODEL_NAME"],
        "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
    }
    expected = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/model",
        "--served-model-name",
        "my model",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]

    for gpus, seen in (("", None), ("2,3", "2,3"), (None, None)):
        result = host.run(server_entrypoint(), **served, CUDA_VISIBLE_DEVICES=gpus)
        assert result.returncode == 0, result.stderr
        ((argv, env),) = host.calls()
        assert argv == expected + [str(argument) for argument in extra_args]
        assert env.get("CUDA_VISIBLE_DEVICES") == seen, f"host CUDA_VISIBLE_DEVICES={gpus!r}"
    result = host.run(server_entrypoint(), PATH=served["PATH"])  # no extra args, no name: the defaults
    ((argv, _),) = host.calls()
    assert argv == expected[:6] + ["astrai"] + expected[7:]


def entrypoint(host: Host, job: Path, **extra: str) -> tuple[list[str], dict[str, str]]:
    result = host.run(
        ["bash", str(REPO / "scripts" / "docker" / "train-entrypoint.sh"), "--set", "train.max_steps=2"],
        TRAIN_CONFIG=str(job),
        **extra,
    )
    assert result.returncode == 0, result.stderr
    (call,) = host.calls()
    return call


def test_entrypoint_keeps_ranks_on_the_job_gpus_and_exports_its_environment(host):
    job = write_job(host, "", extra="runtime:\n  environment: {NCCL_P2P_DISABLE: 1, EMPTY: null, NOTE: two words}\n")
    argv, env = entrypoint(host, job, CUDA_VISIBLE_DEVICES="4,5,6,7", TRAIN_GPU_COUNT="2")
    # --include, never --num_gpus: deepspeed ignores CUDA_VISIBLE_DEVICES when --num_gpus is given.
    assert argv == [
        "deepspeed",
        "--include",
        "localhost:4,5",
        "astrai/train.py",
        "--config",
        str(job),
        "--set",
        "train.max_steps=2",
    ]
    assert (env["NCCL_P2P_DISABLE"], env["EMPTY"], env["NOTE"]) == ("1", "", "two words")
    argv, env = entrypoint(host, job, TRAIN_GPU_COUNT="3")
    assert argv[:3] == ["deepspeed", "--num_gpus", "3"]
    argv, env = entrypoint(host, job, CUDA_VISIBLE_DEVICES="")
    assert argv[1] == "astrai/train.py" and "CUDA_VISIBLE_DEVICES" not in env
