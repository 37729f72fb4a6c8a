"""The per-job environment's two trainer knobs, honoured in-process: ASTR_BACKEND (the attention
implementation handed to transformers) and ASTR_LOG_LEVEL (the trainer's log level).

The Docker examples and docs/developer/docker-training.md put them in `runtime.environment`; the
trainer reads them in astrai/models/policy.py and astrai/train.py after exporting the job's values.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from astrai.config import load_job
from astrai.models.policy import attention_implementation, build_policy
from astrai.models.tokenizer import build_tokenizer
from tests.conftest import REPO

JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}}}
train: {{train_type: sft, max_steps: 1}}
"""
# Variables train.main sets in this process (the launcher would have set the rank ones).
SET_BY_MAIN = ("ASTR_LOG_LEVEL", "ASTR_BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_environment(monkeypatch):
    """The test starts without the variables main sets and ends with os.environ exactly as it was:
    main sets RANK, MASTER_PORT, ... itself, and left behind they would send every later subprocess
    launch of the suite to this process's (destroyed) rendezvous port."""
    saved = dict(os.environ)
    for name in SET_BY_MAIN:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def write_job(folder, extra: str = "") -> str:
    path = folder / "job.yaml"
    path.write_text(JOB.format(output_dir=folder / "out", data=REPO / "data/arithmetic/sft.jsonl") + extra)
    return str(path)


@pytest.mark.parametrize(
    "variable, configured, chosen",
    [("eager", None, "eager"), ("sdpa", "eager", "sdpa"), (None, "eager", "eager"), ("", "eager", "eager")],
)
def test_astr_backend_picks_the_attention_implementation_handed_to_transformers(
    tmp_path, clean_environment, variable, configured, chosen
):
    if variable is not None:
        clean_environment.setenv("ASTR_BACKEND", variable)
    sets = [] if configured is None else [f"model.attn_implementation={configured}"]
    job = load_job(write_job(tmp_path), sets)
    assert attention_implementation(job.model.attn_implementation) == chosen
    model = build_policy(job.model, build_tokenizer("char", ["0123456789+-= \n"]), seed=0)
    assert model.config._attn_implementation == chosen  # what transformers' attention layers dispatch on
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model(input_ids=ids).logits.shape == (1, 4, model.config.vocab_size)  # and the model runs with it


def run_main_until_preflight(job: str, capsys) -> tuple[int, int, str]:
    """astrai/train.py's main, in this process, up to its preflight (which fails: infra.gpus_per_node: 1
    on a CPU host), so it sets the log level and stops before building anything; (status, level, stderr)."""
    from astrai.train import main

    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()
    try:
        code = main(["--config", job])
        chosen = root.level
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
        torch.set_num_threads(threads)
    return code, chosen, capsys.readouterr().err


def test_astr_log_level_in_the_job_environment_sets_the_trainer_log_level(tmp_path, clean_environment, capsys):
    runtime = "runtime: {log_level: WARNING, environment: {ASTR_LOG_LEVEL: DEBUG}}\ninfra: {gpus_per_node: 1}\n"
    code, level, err = run_main_until_preflight(write_job(tmp_path, runtime), capsys)
    assert code == 1 and "preflight failed" in err and "has 0 GPUs, infra.gpus_per_node says 1" in err
    assert level == logging.DEBUG
    assert (
        "INFO astrai.preflight: preflight: 1 ranks on 1 nodes" in err
    )  # INFO lines shown, though the job says WARNING

    clean_environment.delenv("ASTR_LOG_LEVEL", raising=False)
    (tmp_path / "second").mkdir()
    code, level, err = run_main_until_preflight(
        write_job(tmp_path / "second", runtime.replace("ASTR_LOG_LEVEL: DEBUG", "ASTR_OTHER: x")), capsys
    )
    assert code == 1 and "preflight failed" in err
    assert level == logging.WARNING and "preflight: 1 ranks" not in err  # without it, runtime.log_level rules
