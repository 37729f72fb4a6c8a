"""`model.init` under ZeRO-3 with `model.zero3_init` (astrai/engine/zero3_init.py), on 2 real gloo ranks:
the policy, the reference and the critic hold only their partition from construction on, and gathered they
equal the whole build of the same seed bit for bit (every parameter and buffer), with the same RNG state
left behind, so ZeRO-0 and ZeRO-3 runs of one job start from one model. One launch, about 15 s."""

from __future__ import annotations

import json

import pytest

from tests.conftest import launch_ranks

WORKER = "tests/integration/zero3_init_worker.py"
EXPECTED = {"qwen2_tied/policy", "qwen2_tied/reference", "qwen2_tied/critic", "llama_untied/policy", "gpt2/policy"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero3_init")
    finished = launch_ranks([WORKER, str(folder)], ranks=2, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_every_model_is_partitioned_from_construction(results):
    for rank_results in results:
        assert set(rank_results) == EXPECTED
        for name, result in rank_results.items():
            assert result["partitioned"], name
            # Each rank holds half of the elements (ZeRO pads each partition up to a multiple of the world size).
            assert result["numel"] / 2 <= result["local_numel"] <= result["numel"] / 2 + 200, (name, result)


def test_partitioned_weights_equal_the_whole_build_bit_for_bit(results):
    for rank, rank_results in enumerate(results):
        for name, result in rank_results.items():
            assert result["problems"] == [], (rank, name, result["problems"])
            assert result["same_rng"], (rank, name)
