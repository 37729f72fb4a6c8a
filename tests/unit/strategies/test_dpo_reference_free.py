"""`dpo.loss: simpo | orpo` on a real one-rank DeepSpeed group in this process: no reference model is
built (no FrozenEngine comes to exist, the run holds the policy's parameters once, where `sigmoid`
holds them twice), a few real optimizer steps train with finite metrics and a falling loss, and the
keys that only make sense with a reference are refused before any rank starts.
"""

from __future__ import annotations

import gc
import math

import pytest

from astrai.config import ConfigError
from astrai.engine import FrozenEngine
from astrai.launch.job_checks import load_and_check
from astrai.observability.metrics import read_metrics
from astrai.training.build import build_run
from astrai.training.loops import TRAIN_LOOPS
from tests.unit.strategies.dpo_fixtures import preference_folder

STEPS = 8
JOB = """\
output_dir: {output_dir}
model: {{path: {model}}}
data: {{path: {data}, max_seq_len: 48}}
train: {{train_type: dpo, max_steps: {steps}, micro_batch_size: 4, lr: 3e-3, lr_schedule: constant, warmup_steps: 0,
        seed: 3}}
deepspeed: {{zero_stage: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """pairs.jsonl (4 shipped pairs, one micro-batch: every step sees the same pairs, so the loss must fall)
    and a tiny HF model `start` with its char tokenizer."""
    return preference_folder(tmp_path_factory.mktemp("dpo_reference_free"), 4, {"start": 0})


def write_config(folder, name: str) -> str:
    config = folder / f"{name}.yaml"
    text = JOB.format(output_dir=folder / name, model=folder / "start", data=folder / "pairs.jsonl", steps=STEPS)
    config.write_text(text)
    return str(config)


def frozen_engines() -> int:
    gc.collect()
    # type(), not isinstance(): the latter reads __class__, which some torch module proxies answer with a warning
    return sum(issubclass(type(thing), FrozenEngine) for thing in gc.get_objects())


def held_parameters(run) -> int:
    """Elements of every distinct parameter the run's engines and strategy hold (a reference counts too)."""
    modules = [engine.module for engine in run.engines.values()]
    reference = getattr(run.strategy, "reference", None)
    if reference is not None:
        modules.append(reference.module)
    parameters = {id(p): p for module in modules for p in module.parameters()}
    return sum(p.numel() for p in parameters.values())


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_loss_builds_no_reference_and_trains(one_rank, folder, loss):
    config = write_config(folder, loss)
    before = frozen_engines()
    job = load_and_check(config, [f"dpo.loss={loss}", "dpo.beta=2.0", "dpo.simpo_gamma=0.5"])
    run = build_run(job, one_rank, config)
    assert run.strategy.reference is None and run.strategy.checkpoint_meta() == {"reference": None}
    assert set(run.engines) == {"policy"} and frozen_engines() == before  # no reference engine was ever made
    policy_parameters = sum(p.numel() for p in run.engines["policy"].module.parameters())
    assert held_parameters(run) == policy_parameters

    state = TRAIN_LOOPS[run.strategy.loop](run)
    assert state.step == STEPS
    records = read_metrics(folder / loss / "metrics.jsonl")
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    names = {
        "loss",
        "rewards_chosen",
        "rewards_rejected",
        "reward_margin",
        "reward_accuracy",
        "logps_chosen",
        "logps_rejected",
    }
    if loss == "orpo":
        names |= {"nll_loss", "log_odds_ratio", "log_odds_chosen"}
    for record in records:
        assert names <= set(record) and all(math.isfinite(record[name]) for name in names)
    first, last = records[0], records[-1]
    assert last["loss"] < first["loss"]  # the same 4 pairs every step: the optimiser must make progress
    if loss == "orpo":  # the loss is the NLL part minus beta x logsigmoid(log odds), as logged
        for record in records:
            assert record["loss"] == pytest.approx(record["nll_loss"] - 2.0 * record["log_odds_ratio"], rel=1e-5)
    # rewards are beta x the mean token log-prob: the logged log-probs are those averages
    assert first["rewards_chosen"] == pytest.approx(2.0 * first["logps_chosen"], rel=1e-5)


def test_sigmoid_still_builds_its_reference(one_rank, folder):
    """The control: the same job with DPO's loss makes one FrozenEngine and holds the parameters twice."""
    config = write_config(folder, "sigmoid")
    before = frozen_engines()
    run = build_run(load_and_check(config, []), one_rank, config)
    assert isinstance(run.strategy.reference, FrozenEngine) and frozen_engines() == before + 1
    assert held_parameters(run) == 2 * sum(p.numel() for p in run.engines["policy"].module.parameters())


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
@pytest.mark.parametrize(
    "override, key",
    [
        ("dpo.precompute_reference=true", "dpo.precompute_reference"),
        ("model.reference_path={start}", "model.reference_path"),
        ("dpo.label_smoothing=0.1", "dpo.label_smoothing"),
    ],
)
def test_reference_keys_are_refused(folder, loss, override, key):
    config = write_config(folder, f"refused_{loss}")
    with pytest.raises(ConfigError, match=rf"{config}: .*`{key}`") as error:
        load_and_check(config, [f"dpo.loss={loss}", override.format(start=folder / "start")])
    assert loss in str(error.value) and "\n" not in str(error.value)


def test_label_smoothing_with_ipo_is_refused_before_the_run(folder):
    config = write_config(folder, "refused_ipo")
    with pytest.raises(ConfigError, match="`dpo.label_smoothing` applies to `dpo.loss: sigmoid` only, not 'ipo'"):
        load_and_check(config, ["dpo.loss=ipo", "dpo.label_smoothing=0.1"])
