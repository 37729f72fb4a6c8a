"""Rewards: the arithmetic verifier, function loading and argument passing, every error naming its reward
(a module that calls sys.exit while imported, a function that calls it), weighted components, a local
reward model. The HTTP service is tests/unit/rollout/test_http_reward.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from astrai.config.schema import RewardConfig
from astrai.rollout.rewards import (
    FunctionReward,
    RewardError,
    WeightedReward,
    arithmetic_exact_match,
    build_reward,
    checked_scores,
)

INPUTS = {
    "prompts": ["<p>1+2=", "<p>3+4="],
    "responses": ["3", " 8 "],
    "prompt_ids": [[1, 2], [3, 4]],
    "response_ids": [[5, 9], [6, 9]],
    "messages": [[{"role": "user", "content": "1+2="}]] * 2,
    "rows": [{"prompt": "1+2=", "answer": "3"}, {"prompt": "3+4=", "answer": "7"}],
}
DEVICE = torch.device("cpu")


@pytest.fixture
def user_module():
    """A throwaway importable module `reward_fixtures` holding reward functions good and bad."""
    module = types.ModuleType("reward_fixtures")
    module.lengths = lambda responses: [float(len(r)) for r in responses]
    module.everything = lambda **inputs: [float(sorted(inputs) == sorted(INPUTS))] * len(inputs["responses"])
    module.constant = lambda responses, **_: [0.5] * len(responses)

    def explodes(responses):
        raise ZeroDivisionError("division by zero in the user's code")

    module.explodes = explodes
    module.too_few = lambda responses: [1.0]
    module.nan = lambda responses: [0.0, float("nan")]
    module.inf = lambda responses: [float("inf"), 0.0]
    module.words = lambda responses: ["high", "low"]
    module.exits = lambda responses: sys.exit(4)
    module.not_callable = 3
    sys.modules["reward_fixtures"] = module
    yield module
    del sys.modules["reward_fixtures"]


def combined(*specs, weights=None):
    weights = weights or [1.0] * len(specs)
    return WeightedReward([(FunctionReward(spec), weight) for spec, weight in zip(specs, weights)])


def test_arithmetic_exact_match_reads_the_answer_from_the_row():
    rows = [{"answer": "19"}, {"answer": "19"}, {"answer": "19"}, {"answer": "-4"}, {"answer": 7}]
    assert arithmetic_exact_match(["19", " 19\n", "19 or 20", "-4", "7"], rows) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert arithmetic_exact_match(["1", "91"], [{"answer": "19"}] * 2) == [0.0, 0.0]
    with pytest.raises(KeyError, match="no 'answer' field"):
        arithmetic_exact_match(["3"], [{"prompt": "1+2="}])


def test_functions_get_the_arguments_they_name(user_module):
    assert combined("reward_fixtures:lengths")(INPUTS).total.tolist() == [1.0, 3.0]
    assert combined("reward_fixtures:everything")(INPUTS).total.tolist() == [1.0, 1.0]  # **kwargs: all six
    scores = combined("astrai.rollout.rewards:arithmetic_exact_match")(INPUTS)
    assert scores.total.tolist() == [1.0, 0.0] and scores.components == {}


def test_weighted_components_and_their_names(user_module):
    scores = combined("reward_fixtures:lengths", "reward_fixtures:constant", weights=[2.0, -1.0])(INPUTS)
    assert scores.total.tolist() == [2 * 1.0 - 0.5, 2 * 3.0 - 0.5]
    assert scores.components["lengths"].tolist() == [1.0, 3.0] and scores.components["constant"].tolist() == [0.5, 0.5]
    with pytest.raises(RewardError, match="names must differ"):
        combined("reward_fixtures:constant", "reward_fixtures:constant")
    config = RewardConfig(
        components=[
            {"function": "reward_fixtures:lengths", "weight": 0.5},
            {"function": "reward_fixtures:lengths", "name": "again"},
        ]
    )
    reward = build_reward(config, DEVICE)
    assert reward.names == ["lengths", "again"] and reward(INPUTS).total.tolist() == [1.5, 4.5]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("explodes", "reward 'explodes' raised ZeroDivisionError: division by zero in the user's code"),
        ("too_few", "reward 'too_few' returned 1 values for 2 responses"),
        ("nan", r"reward 'nan' returned a non-finite value \(nan\) for response 1"),
        ("inf", r"reward 'inf' returned a non-finite value \(inf\) for response 0"),
        ("words", "reward 'words' must return a sequence of floats"),
        ("exits", r"reward 'exits' exited with sys.exit\(4\)"),
    ],
)
def test_a_broken_reward_function_is_named(user_module, function, message):
    reward = combined("reward_fixtures:constant", f"reward_fixtures:{function}")
    with pytest.raises(RewardError, match=message) as caught:
        reward(INPUTS)
    if function in ("explodes", "exits"):
        assert isinstance(caught.value.__cause__, (ZeroDivisionError, SystemExit))  # the user's traceback is kept


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "must look like 'package.module:function'"),
        ("surely_not_a_module_xyz:f", "cannot import 'surely_not_a_module_xyz'"),
        ("reward_fixtures:missing", "has no callable 'missing'"),
        ("reward_fixtures:not_callable", "has no callable 'not_callable'"),
    ],
)
def test_unloadable_functions_fail_at_build_time(user_module, spec, message):
    with pytest.raises(RewardError, match=message):
        FunctionReward(spec)


EXITING_MODULES = {
    # name: (module text, the line that exits, how the call reads in the error)
    "exits_with_a_message": ('import sys\n\nsys.exit("no GPU here")\n', 3, "sys.exit('no GPU here')"),
    "exits_with_a_code": (
        "import sys\n\n\ndef score(responses):\n    return [0.0]\n\n\nsys.exit(3)\n",
        8,
        "sys.exit(3)",
    ),
    "raises_system_exit": ("raise SystemExit\n", 1, "sys.exit()"),
    # a library exits on the module's behalf: argparse at import, reading the launcher's arguments
    "parses_arguments": (
        "import argparse\n\nOPTIONS = argparse.ArgumentParser().parse_args(['--local_rank=0'])\n",
        3,
        "sys.exit(2)",
    ),
}


@pytest.mark.parametrize("name", sorted(EXITING_MODULES))
def test_a_reward_module_that_exits_while_imported_is_named(name, tmp_path, monkeypatch, capsys):
    """sys.exit at import time is a SystemExit, not an Exception: before, it ended the process with the
    module's own words (or nothing) and no word of which module; now it is a RewardError naming file and line."""
    text, line, call = EXITING_MODULES[name]
    module = f"reward_{name}_{tmp_path.name}"  # a fresh name per test: nothing cached in sys.modules
    (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as caught:
        FunctionReward(f"{module}:score")
    message = str(caught.value)
    assert message == (
        f"reward.function: {tmp_path / module}.py:{line}: the module exited while being imported, with {call} "
        f"(importing {module!r} for '{module}:score'); a reward module must not exit"
    )
    assert module not in sys.modules and caught.value.__cause__ is None  # one line, the SystemExit not chained
    capsys.readouterr()  # argparse wrote its usage to stderr: the module's own words, shown, not the error


def test_checked_scores_accepts_tensors_and_arrays():
    assert checked_scores("r", torch.tensor([[1.0], [2.0]]), 2).tolist() == [1.0, 2.0]
    assert checked_scores("r", (0, 1), 2).dtype == torch.float32


# ----------------------------------------------------------------------------- reward model


def test_local_reward_model_scores_each_response_alone(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tests.unit.rollout_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward = build_reward(RewardConfig(model_path=str(tmp_path / "rm"), batch_size=2), DEVICE)
    inputs = dict(
        INPUTS, responses=["3", "a much longer reply", "7"], messages=[INPUTS["messages"][0]] * 3, prompts=["p"] * 3
    )
    batched = reward(inputs).total
    alone = [
        reward({**inputs, "responses": [text], "messages": inputs["messages"][:1]}).total.item()
        for text in inputs["responses"]
    ]
    assert batched.shape == (3,) and torch.isfinite(batched).all()
    assert batched.tolist() == pytest.approx(alone, abs=1e-5)  # padding in a batch does not change a score
    with pytest.raises(RewardError, match="does not exist"):
        build_reward(RewardConfig(model_path=str(tmp_path / "nowhere")), DEVICE)


def test_reward_config_takes_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of `reward.function`"):
        RewardConfig(function="a:b", url="http://x")
    with pytest.raises(ValueError, match="exactly one of `function`, `model_path` or `url`"):
        RewardConfig(components=[{"weight": 2.0}])
