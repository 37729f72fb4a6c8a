"""Host-side parsers of the Docker wrappers (scripts/docker/train_runtime.py, serve_runtime.py), in process.

They must run on hosts with python3 + PyYAML only, so they mirror parts of astrai/config; the tests
below also hold those copies to the originals (infra key names, YAML 1.2 scalars, rendering, parts). The
container keys of infra: and the serve: section are the wrappers' alone to check (the trainer accepts them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts" / "docker"))

import serve_runtime  # noqa: E402
import train_runtime  # noqa: E402
from lib.job_yaml import JobFileError, load_job_file, read_env_file  # noqa: E402

JOB_SECTIONS = """\
output_dir: /output/demo
train: {train_type: sft, max_steps: 1}
"""


def write_job(folder: Path, text: str, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(JOB_SECTIONS + text)
    return path


def exports(job_file: Path) -> dict:
    return train_runtime.infra_variables(load_job_file(job_file), job_file)


def test_full_infra_section_becomes_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    job = write_job(
        tmp_path,
        """\
infra:
  job_name: sft-gpu4-7
  data: datasets/chat          # relative: from the job file's folder
  model: ~/models/base
  checkpoint_dir: /mnt/ckpt
  gpu: {devices: [4, 5, 6, 7], count: 2}
  image: astrai:dev
  shm_size: 32g
  master_port: 29600          # multi-node keys: accepted, left to `astrai launch`
""",
    )
    assert exports(job) == {
        "TRAIN_CONFIG_FILE": str(job),
        "TRAIN_JOB_NAME": "sft-gpu4-7",
        "TRAIN_DATA": str(tmp_path / "datasets" / "chat"),
        "TRAIN_MODEL": str(tmp_path / "home" / "models" / "base"),
        "TRAIN_CHECKPOINT_DIR": "/mnt/ckpt",
        "TRAIN_IMAGE": "astrai:dev",
        "TRAIN_SHM_SIZE": "32g",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "TRAIN_GPU_COUNT": "2",
    }


def test_devices_all_unsets_and_a_list_sets_the_count(tmp_path):
    every = exports(write_job(tmp_path, "infra: {gpu: {devices: all}}\n"))
    assert every["CUDA_VISIBLE_DEVICES"] is None and "TRAIN_GPU_COUNT" not in every
    assert train_runtime.shell_lines(every).splitlines()[-1] == "unset CUDA_VISIBLE_DEVICES"
    listed = exports(write_job(tmp_path, "infra: {gpu: {devices: [0, 2]}}\n"))
    assert (listed["CUDA_VISIBLE_DEVICES"], listed["TRAIN_GPU_COUNT"]) == ("0,2", "2")
    counted = exports(write_job(tmp_path, "infra: {gpu: {count: 3}}\n"))
    assert counted["TRAIN_GPU_COUNT"] == "3" and "CUDA_VISIBLE_DEVICES" not in counted


def test_missing_keys_fall_back_to_the_env_file(tmp_path):
    """Keys the YAML leaves out are not exported, so compose takes .env.train's; plan resolves them the same way."""
    job = write_job(tmp_path, "infra: {data: /yaml/data}\n")
    assert exports(job) == {"TRAIN_CONFIG_FILE": str(job), "TRAIN_DATA": "/yaml/data"}
    assert exports(write_job(tmp_path, "")) == {"TRAIN_CONFIG_FILE": str(tmp_path / "job.yaml")}
    env_file = tmp_path / ".env.train"
    env_file.write_text(
        "# host settings\nTRAIN_IMAGE=astrai:env\nexport TRAIN_JOB_NAME='from env'\nTRAIN_CHECKPOINT_DIR=/env/ckpt # "
        "inline\n\nTRAIN_DATA=/env/data\n"
    )
    values = read_env_file(env_file)
    assert values == {
        "TRAIN_IMAGE": "astrai:env",
        "TRAIN_JOB_NAME": "from env",
        "TRAIN_CHECKPOINT_DIR": "/env/ckpt",
        "TRAIN_DATA": "/env/data",
    }
    settings = train_runtime.plan(load_job_file(job), job, {}, values, launch=True)
    assert (settings["image"], settings["job_name"], settings["project"]) == (
        "astrai:env",
        "from env",
        "astrai-from-env",
    )
    assert settings["checkpoint_dir"] == "/env/ckpt"
    shell_first = train_runtime.plan(load_job_file(job), job, {"TRAIN_IMAGE": "astrai:shell"}, values, launch=False)
    assert shell_first["image"] == "astrai:shell"  # the shell beats the env file, as in compose
    bare = train_runtime.plan(load_job_file(job), job, {}, {}, launch=True)
    assert (bare["image"], bare["job_name"]) == ("astrai:latest", "job")
    assert bare["checkpoint_dir"] == str(REPO / "runs" / "docker")  # the compose file's default
    every = write_job(tmp_path, "infra: {gpu: {devices: all}}\n", "all.yaml")  # can unset the shell's, not the file's
    with pytest.raises(JobFileError, match="infra.gpu.devices: `all`, but the env file sets CUDA_VISIBLE_DEVICES=0,1"):
        train_runtime.plan(load_job_file(every), every, {}, {"CUDA_VISIBLE_DEVICES": "0,1"}, launch=False)


BAD_SECTIONS = {
    "infra: [1, 2]\n": "infra: expected a mapping",
    "infra: {gpus: 2}\n": "infra.gpus: unknown key",
    "infra: {gpu: 4}\n": "infra.gpu: expected a mapping",
    "infra: {gpu: {device: all}}\n": "infra.gpu.device: unknown key",
    "infra: {gpu: {devices: some}}\n": "infra.gpu.devices: expected `all` or a list",
    "infra: {gpu: {devices: [0, 0]}}\n": "infra.gpu.devices: expected",
    "infra: {gpu: {devices: [true]}}\n": "infra.gpu.devices: expected",
    "infra: {gpu: {devices: []}}\n": "infra.gpu.devices: expected",
    "infra: {gpu: {count: 0}}\n": "infra.gpu.count: expected a positive integer",
    "infra: {gpu: {devices: [0, 1], count: 4}}\n": "infra.gpu.count: 4 ranks but infra.gpu.devices lists only 2",
    "infra: {job_name: my job}\n": "infra.job_name: 'my job' must be",
    "infra: {data: 5}\n": "infra.data: expected a non-empty string",
    "infra: {shm_size: lots}\n": "infra.shm_size: expected a size",
    "infra: {data: '/srv/a:b'}\n": "infra.data: '/srv/a:b' contains ':'",
    "runtime: 3\n": "runtime: expected a mapping",
    "runtime: {environment: [A]}\n": "runtime.environment: expected a mapping",
    "runtime: {environment: {A: [1]}}\n": "runtime.environment.A: expected a string, number, bool or null",
    "runtime: {environment: {1BAD: x}}\n": "runtime.environment.1BAD: not a valid environment variable name",
    "runtime: {environment: {CUDA_VISIBLE_DEVICES: '0'}}\n": "choose the job's GPUs with infra.gpu.devices",
}


@pytest.mark.parametrize("text", list(BAD_SECTIONS))
def test_bad_sections_fail_fast_with_the_key_named(tmp_path, text):
    job = write_job(tmp_path, text)
    with pytest.raises(JobFileError, match=BAD_SECTIONS[text].replace("(", r"\(").replace("[", r"\[")):
        train_runtime.main(["exports", str(job)])


def test_not_a_job_file(tmp_path):
    for text, message in (("- a list\n", "must be a mapping of sections"), ("a: [\n", "not valid YAML")):
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(JobFileError, match=message):
            load_job_file(tmp_path / "bad.yaml")
    with pytest.raises(JobFileError, match="does not exist"):
        load_job_file(tmp_path / "absent.yaml")


ENVIRONMENT = """\
runtime:
  environment:
    NCCL_P2P_DISABLE: 1
    FLAG: true
    OFF: false
    EMPTY: null
    RATIO: 0.5
    LR: 2e-5
    SWITCH: on
    NAME: "two words and 'quotes' and $HOME; rm -rf /"
"""


def test_environment_renders_like_the_trainer(tmp_path, monkeypatch):
    """Same text as astrai/launch/environment.py apply_environment gives each rank, and safe to eval in bash."""
    from astrai.config.loader import parse_yaml
    from astrai.launch.environment import apply_environment

    job = write_job(tmp_path, ENVIRONMENT)
    rendered = train_runtime.job_environment(load_job_file(job), job)
    assert rendered == {
        "NCCL_P2P_DISABLE": "1",
        "FLAG": "True",
        "OFF": "False",
        "EMPTY": "",
        "RATIO": "0.5",
        "LR": "2e-05",
        "SWITCH": "on",
        "NAME": "two words and 'quotes' and $HOME; rm -rf /",
    }
    environment = parse_yaml(job.read_text())["runtime"]["environment"]
    for name in environment:
        monkeypatch.delenv(name, raising=False)
    apply_environment(environment)
    assert {name: os.environ[name] for name in environment} == rendered

    shell = train_runtime.main(["environment", str(job)])
    printed = subprocess.run(
        ["bash", "-c", 'eval "$0"; for name in ${!1}; do printf "%s=%s\\n" "$name" "${!name}"; done', shell, "NAMES"],
        env={"NAMES": " ".join(rendered), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed.splitlines() == [f"{name}={value}" for name, value in rendered.items()]


def test_host_copies_match_astrai():
    """Keys and required parts mirrored for hosts without AstrAI agree with the originals."""
    from astrai.config.schema import InfraConfig
    from astrai.strategies import REGISTRY

    assert set(train_runtime.HOST_KEYS + train_runtime.MULTI_NODE_KEYS) == set(InfraConfig.model_fields)
    for name, strategy in REGISTRY.items():
        assert train_runtime.REQUIRED_PARTS.get(name, ("policy",)) == tuple(strategy.required_parts), name


TRAINER_SECTIONS = "model: {init: {model_type: llama}}\ntokenizer: {build: {}}\ndata: {path: rows.jsonl}\n"
WRAPPER_VALUES = {  # values of the wrappers' keys that only the wrappers judge: the trainer takes them as given
    "infra: {gpu: {devices: some}}\n": "infra.gpu.devices: expected `all` or a list",
    "infra: {gpu: {count: 0}}\n": "infra.gpu.count: expected a positive integer",
    "infra: {shm_size: lots}\n": "infra.shm_size: expected a size",
    "infra: {image: 5}\n": "infra.image: expected a non-empty string",
    "serve: {port: 70000}\n": "serve.port: expected a port number",
    "serve: {extra_args: --x}\n": "serve.extra_args: expected a list",
    "serve: {models: x}\n": "serve.models: unknown key",
}


@pytest.mark.parametrize("text", WRAPPER_VALUES)
def test_wrapper_sections_are_checked_by_the_wrappers(tmp_path, text):
    """infra's container keys and serve: are the wrappers' own: train.sh refuses a wrong one on the host (serve.sh
    too), with the key named, while the trainer's schema accepts it as given."""
    from astrai.config.loader import load_job

    job = write_job(tmp_path, text)
    with pytest.raises(JobFileError, match=WRAPPER_VALUES[text]):
        train_runtime.main(["exports", str(job)])
    trainer_job = write_job(tmp_path, TRAINER_SECTIONS + text, "trainer.yaml")
    load_job(trainer_job, check_paths=False)


def test_trainer_still_refuses_an_unknown_infra_key(tmp_path):
    from astrai.config.loader import ConfigError, load_job

    trainer_job = write_job(tmp_path, TRAINER_SECTIONS + "infra:\n  gpus: 2\n", "trainer.yaml")
    with pytest.raises(ConfigError, match=r"trainer.yaml:7: infra.gpus: unknown key"):
        load_job(trainer_job, check_paths=False)


def test_launch_plan_finds_the_checkpoint_to_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = write_job(tmp_path, f"infra: {{checkpoint_dir: {ckpt}}}\n")
    document = load_job_file(job)

    def launch(**changes) -> dict:
        merged = {**document, **changes}
        return train_runtime.plan(merged, job, {}, {}, launch=True)

    fresh = launch()
    assert (fresh["resume_dir"], fresh["resume_parts"], fresh["checkpoint_dir"]) == ("", "policy", str(ckpt))
    (ckpt / "demo" / "checkpoints" / ".step_00000003.staging-ab").mkdir(parents=True)
    assert launch()["resume_dir"] == ""  # staging folders are never resumed from
    (ckpt / "demo" / "checkpoints" / "step_00000002").mkdir()
    found = launch(train={"train_type": "online_ppo"})
    assert (found["resume_dir"], found["resume_latest"], found["resume_parts"]) == (
        str(ckpt / "demo" / "checkpoints"),
        "1",
        "policy,critic",
    )
    assert launch(checkpoint={"resume": "never"})["resume_dir"] == ""
    chosen = launch(checkpoint={"resume": "/output/demo/checkpoints/step_00000002"})
    assert (chosen["resume_dir"], chosen["resume_latest"]) == (
        str(ckpt / "demo" / "checkpoints" / "step_00000002"),
        "0",
    )
    with pytest.raises(JobFileError, match="checkpoint.resume: '/output/demo/absent' is .* not a directory"):
        launch(checkpoint={"resume": "/output/demo/absent"})
    with pytest.raises(JobFileError, match=r"checkpoint.resume: 'runs/x' is not under a mounted folder"):
        launch(checkpoint={"resume": "runs/x"})
    with pytest.raises(JobFileError, match="checkpoint.resume: '/models/x' is under /models, where nothing is mounted"):
        launch(checkpoint={"resume": "/models/x"})
    with pytest.raises(JobFileError, match="output_dir: 'runs/demo' is not under /output"):
        launch(output_dir="runs/demo")
    with pytest.raises(JobFileError, match="export.hf_dir: '/tmp/hf' is not under /output"):
        launch(export={"hf_dir": "/tmp/hf"})


def test_serve_section(tmp_path):
    model = tmp_path / "hf"
    job = write_job(
        tmp_path,
        """\
infra: {job_name: demo, gpu: {devices: [1]}, shm_size: 8g}
serve:
  model_dir: hf
  port: 9000
  extra_args: [--max-model-len, 4096, --chat-template, "{{ a b }}"]
""",
    )
    document = load_job_file(job)
    variables = serve_runtime.serve_variables(document, job)
    assert variables == {
        "TRAIN_JOB_NAME": "demo",
        "TRAIN_SHM_SIZE": "8g",
        "CUDA_VISIBLE_DEVICES": "1",
        "SERVE_MODEL_DIR": str(model),
        "SERVE_PORT": "9000",
        "SERVE_EXTRA_ARGS": "--max-model-len 4096 --chat-template '{{ a b }}'",
    }
    split = subprocess.run(
        ["sh", "-c", 'eval "set -- $0"; printf "%s\\n" "$@"', variables["SERVE_EXTRA_ARGS"]],
        capture_output=True,
        text=True,
    )
    assert split.stdout.splitlines() == ["--max-model-len", "4096", "--chat-template", "{{ a b }}"]
    with pytest.raises(JobFileError, match="serve.model_dir: .* is not a Hugging Face model folder"):
        serve_runtime.plan(document, job, {}, {})
    model.mkdir()
    (model / "config.json").write_text("{}")
    settings = serve_runtime.plan(document, job, {}, {"SERVE_IMAGE": "vllm/vllm-openai:v1"})
    assert settings == {
        "project": "astrai-serve-demo",
        "model_dir": str(model),
        "model_name": "demo",
        "port": "9000",
        "image": "vllm/vllm-openai:v1",
    }
    everything = serve_runtime.serve_variables(
        load_job_file(write_job(tmp_path, "infra: {gpu: {devices: all}}\n")), job
    )
    assert everything == {"CUDA_VISIBLE_DEVICES": None}
    for text, message in (
        ("serve: {port: 70000}\n", "serve.port: expected a port number"),
        ("serve: {extra_args: --x}\n", "serve.extra_args: expected a list"),
        ("serve: {models: x}\n", "serve.models: unknown key"),
        ("", "serve.model_dir: no model to serve"),
    ):
        bad = write_job(tmp_path, text, "bad.yaml")
        with pytest.raises(JobFileError, match=message):
            serve_runtime.plan(load_job_file(bad), bad, {}, {})


def test_runtimes_need_only_python_and_pyyaml(tmp_path):
    """Importing them pulls in neither astrai nor pydantic nor torch; without PyYAML they say so."""
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import train_runtime, serve_runtime; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'astrai', 'pydantic', 'torch'}); print(heavy)"
    )
    imported = subprocess.run(
        [sys.executable, "-c", probe, str(REPO / "scripts" / "docker")], capture_output=True, text=True, cwd=tmp_path
    )
    assert imported.stdout.strip() == "[]", imported.stderr
    job = write_job(tmp_path, "")
    no_yaml = subprocess.run(  # -S: no site-packages, hence no PyYAML
        [sys.executable, "-S", str(REPO / "scripts" / "docker" / "train_runtime.py"), "exports", str(job)],
        capture_output=True,
        text=True,
    )
    assert no_yaml.returncode == 2 and "PyYAML is not installed" in no_yaml.stderr and "Traceback" not in no_yaml.stderr
