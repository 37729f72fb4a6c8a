"""Job config: YAML 1.2 scalars, overrides, and errors that name file, key and line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from astrai.config import ConfigError, load_job, parse_yaml
from astrai.config.loader import apply_override
from tests.conftest import REPO, child_env

VALID = """\
output_dir: {out}
model:
  init: {{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2}}
tokenizer:
  build: {{kind: char}}
data:
  path: {data}
train:
  train_type: sft
  max_steps: 3
  lr: 2e-5
"""


def write_job(tmp_path, body: str = VALID, **fields) -> str:
    path = tmp_path / "job.yaml"
    values = {"out": str(tmp_path / "out"), "data": str(REPO / "data/arithmetic/sft.jsonl"), **fields}
    path.write_text(body.format(**values))
    return str(path)


def test_yaml12_floats_are_floats_not_strings():
    parsed = parse_yaml("a: 2e-5\nb: 1E3\nc: .5\nd: -1.5e+2\ne: 7\nf: on\ng: true")
    assert parsed == {"a": 2e-5, "b": 1000.0, "c": 0.5, "d": -150.0, "e": 7, "f": "on", "g": True}
    assert isinstance(parsed["a"], float) and isinstance(parsed["b"], float) and isinstance(parsed["e"], int)


def test_valid_job_loads_with_float_lr(tmp_path):
    job = load_job(write_job(tmp_path))
    assert job.train.lr == 2e-5 and isinstance(job.train.lr, float)
    assert job.train.micro_batch_size == 1 and job.checkpoint.resume == "auto"


def test_unknown_key_names_file_key_and_line(tmp_path):
    path = write_job(tmp_path, VALID + "  warmup_stpes: 10\n")
    with pytest.raises(ConfigError) as error:
        load_job(path)
    message = str(error.value)
    assert f"{path}:12: train.warmup_stpes: unknown key" in message


def test_wrong_type_names_the_key_and_line(tmp_path):
    path = write_job(tmp_path, VALID.replace("max_steps: 3", "max_steps: many"))
    with pytest.raises(ConfigError) as error:
        load_job(path)
    assert f"{path}:10: train.max_steps:" in str(error.value)
    assert "integer" in str(error.value)


def test_missing_required_key(tmp_path):
    path = write_job(tmp_path, VALID.replace("  train_type: sft\n", ""))
    with pytest.raises(ConfigError) as error:
        load_job(path)
    assert f"{path}:8: train.train_type: required key is missing" in str(error.value)  # file, the train: line, key


def test_missing_data_file_is_named(tmp_path):
    path = write_job(tmp_path, data=str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(ConfigError) as error:
        load_job(path)
    assert str(error.value) == f"{path}: data.path: no file matches {str(tmp_path / 'nowhere.jsonl')!r}"


def test_missing_job_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_job("/no/such/job.yaml")


def test_hub_name_model_path_is_refused_with_hint(tmp_path):
    body = VALID.replace(
        "  init: {{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, "
        "num_attention_heads: 2}}",
        "  path: meta-llama/Llama-3-8B",
    )
    with pytest.raises(ConfigError, match=r"model\.path: .*hub names cannot be downloaded"):
        load_job(write_job(tmp_path, body))


def test_set_overrides_parse_values_as_yaml(tmp_path):
    job = load_job(
        write_job(tmp_path),
        ["train.lr=1E-3", "train.max_steps=9", "deepspeed.zero_stage=3", "runtime.environment.FOO=bar"],
    )
    assert job.train.lr == 1e-3 and job.train.max_steps == 9 and job.deepspeed.zero_stage == 3
    assert job.runtime.environment == {"FOO": "bar"}


def test_export_goes_under_the_output_dir_unless_given(tmp_path):
    """A run moved with --set output_dir=... must not overwrite the default run's export."""
    assert load_job(write_job(tmp_path)).export.hf_dir == str(tmp_path / "out" / "hf")
    moved = load_job(str(REPO / "configs/quickstart.yaml"), [f"output_dir={tmp_path / 'elsewhere'}"])
    assert moved.export.on_finish and moved.export.hf_dir == str(tmp_path / "elsewhere" / "hf")
    assert load_job(write_job(tmp_path), ["export.hf_dir=/x/hf"]).export.hf_dir == "/x/hf"


def test_export_never_targets_the_output_dir_or_a_folder_holding_it(tmp_path):
    """export.on_finish replaces export.hf_dir whole: pointing it at the run (or above it) fails before any rank
    starts; a checkpoint's job.yaml that does (an older run) still loads, so that it can be exported elsewhere."""
    from astrai.launch.job_checks import load_and_check

    for destination in (tmp_path / "out", tmp_path):
        with pytest.raises(ConfigError, match=r"`export.hf_dir` .* is or contains `output_dir`: the export at the end"):
            load_and_check(write_job(tmp_path), [f"export.hf_dir={destination}", "export.on_finish=true"])
        assert load_job(write_job(tmp_path), [f"export.hf_dir={destination}", "export.on_finish=true"])
    beside = tmp_path / "out-hf"
    assert load_and_check(write_job(tmp_path), [f"export.hf_dir={beside}", "export.on_finish=true"])
    assert load_and_check(write_job(tmp_path), [f"export.hf_dir={tmp_path}", "export.on_finish=false"])


def test_bad_override_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--set train\.max_stepz=3: train\.max_stepz: unknown key"):
        load_job(write_job(tmp_path), ["train.max_stepz=3"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_job(write_job(tmp_path), ["train.max_steps"])
    raw = {"train": {"lr": 1}}
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_override(raw, "train.lr.x=1")


def test_exclusive_choices(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of `train.max_steps` or `train.epochs`"):
        load_job(write_job(tmp_path, VALID + "  epochs: 1\n"))


def test_cli_reports_one_clear_message_without_traceback(tmp_path):
    path = write_job(tmp_path, VALID + "  bogus: 1\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "astrai/train.py"), "--config", path],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert result.returncode == 2
    assert "train.bogus: unknown key" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


def test_every_shipped_config_validates(repo):
    for path in sorted((repo / "configs").glob("*.yaml")):
        load_job(path, check_paths=False)


def test_train_type_registry_names_what_is_available():
    from astrai.strategies import strategy_class

    assert strategy_class("sft").name == "sft" and strategy_class("seq").loop == "offline"
    with pytest.raises(KeyError, match=r"'bogus' is not available in this version \(available: .*seq.*sft"):
        strategy_class("bogus")


def test_a_later_quickstart_says_to_run_the_quickstart_first(tmp_path):
    missing = tmp_path / "runs" / "quickstart" / "hf"
    with pytest.raises(ConfigError) as error:
        load_job(
            str(REPO / "configs/quickstart_grpo.yaml"), [f"model.path={missing}", f"output_dir={tmp_path / 'out'}"]
        )
    message = str(error.value)
    assert f"model.path: local folder {str(missing)!r} does not exist" in message
    assert "run that job first; configs/quickstart.yaml writes runs/quickstart/hf" in message


def test_a_hub_name_is_refused_with_a_clear_message(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"tokenizer\.path: local folder 'meta-llama/Llama-3' does not exist \(hub names cannot be downloaded "
        r"here",
    ):
        load_job(write_job(tmp_path, VALID.replace("  build: {{kind: char}}", "  path: meta-llama/Llama-3")))


def test_tune_malloc_takes_true_false_or_auto_and_names_anything_else(tmp_path):
    assert load_job(write_job(tmp_path)).runtime.tune_malloc == "auto"
    for written, expected in (("auto", "auto"), ("true", True), ("false", False), ("off", False)):
        assert load_job(write_job(tmp_path), [f"runtime.tune_malloc={written}"]).runtime.tune_malloc == expected
    with pytest.raises(ConfigError) as error:
        load_job(write_job(tmp_path), ["runtime.tune_malloc=maybe"])
    message = str(error.value)
    assert "runtime.tune_malloc: expected true, false or auto, not 'maybe'" in message
    assert len(message.strip().splitlines()) == 1, message  # one line, not one per member of the union
