"""`data.packing`'s token-balanced order: the global order under the seed, steps of whole rows within the token
budget, the same number of micro-batches on every rank, balanced tokens, and a resume on the same next row
(in the order alone, and through the real loop and its checkpoint on one DeepSpeed rank)."""

from __future__ import annotations

import json
import random

import datasets
import pytest

from astrai.config import load_job
from astrai.data.packing import PackingError
from astrai.data.sharded_order import ShardedOrder
from astrai.data.stream import DataStream
from astrai.data.token_order import TokenBalancedOrder
from astrai.training.build import build_run
from astrai.training.loops import TRAIN_LOOPS
from tests.conftest import REPO

random.seed(0)
LENGTHS = [random.choice([5, 8, 13, 40, 90, 200]) for _ in range(57)]
BUDGET = 256


def orders(world: int, accumulation: int = 2, seed: int = 3) -> list[TokenBalancedOrder]:
    return [TokenBalancedOrder(LENGTHS, BUDGET, world, rank, accumulation, seed) for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_steps_take_the_global_order_in_whole_rows_within_the_budget(world):
    ranks = orders(world)
    streams = [rank.steps(0) for rank in ranks]
    consumed, taken_rows = 0, []
    reference = ranks[0]
    for _ in range(12):  # past the first epoch (57 rows)
        per_rank = [next(stream) for stream in streams]
        assert len({taken for _, taken in per_rank}) == 1  # every rank agrees on the rows consumed
        taken = per_rank[0][1]
        micro_batches = [micro for own, _ in per_rank for micro in own]
        assert all(len(own) == 2 for own, _ in per_rank)  # A micro-batches on every rank
        assert all(micro for micro in micro_batches)  # none empty
        assert all(sum(LENGTHS[i] for i in micro) <= BUDGET for micro in micro_batches)
        # the ranks' micro-batches hold exactly the next `taken` rows of the stream, each once
        expected = [reference.row_at(position) for position in range(consumed, consumed + taken)]
        assert sorted(i for micro in micro_batches for i in micro) == sorted(expected)
        # the next row would not have fit: the step is as full as the order allows
        loads = [sum(LENGTHS[i] for i in micro) for micro in micro_batches]
        assert min(loads) + LENGTHS[reference.row_at(consumed + taken)] > BUDGET
        # balanced: the fullest and emptiest micro-batch differ by at most one row
        assert max(loads) - min(loads) <= max(LENGTHS[i] for i in expected)
        consumed += taken
        taken_rows.extend(expected)
    stream = [row for epoch in range(consumed // 57 + 1) for row in reference.epoch_order(epoch)]
    assert consumed > 57 and taken_rows == stream[:consumed]  # epoch after epoch, each in its seeded order


def test_each_accumulation_step_deals_neighbours_in_size_to_the_ranks():
    ranks = orders(2, accumulation=3)
    dealt, _ = ranks[0].global_step(0)
    loads = [sum(LENGTHS[i] for i in micro) for micro in dealt]
    assert loads == sorted(loads, reverse=True)  # a x W + r: the W largest first, then the next W, ...
    own = [next(rank.steps(0))[0] for rank in ranks]
    assert own[0][1] == dealt[2] and own[1][1] == dealt[3]


def test_the_permutation_is_shardedorders_under_the_seed():
    assert orders(1)[0].epoch_order(4) == ShardedOrder(57, 1, 1, 0, seed=3).epoch_order(4)


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 3), (1, 2)])
def test_a_resume_lands_on_the_same_next_row_on_any_world_size(before, after):
    first = orders(before)[0]
    consumed = 0
    for _ in range(5):
        consumed += first.global_step(consumed)[1]
    resumed = orders(after)
    rows_next = sorted(i for own, _ in (next(rank.steps(consumed)) for rank in resumed) for micro in own for i in micro)
    taken = resumed[0].global_step(consumed)[1]
    assert rows_next == sorted(first.row_at(p) for p in range(consumed, consumed + taken))
    assert first.row_at(consumed) in rows_next


@pytest.mark.parametrize("epochs", [1.0, 2.5])
def test_train_epochs_count_the_steps_packing_takes(epochs):
    order = orders(2)[0]
    consumed, steps = 0, 0
    while consumed < epochs * 57:
        consumed += order.global_step(consumed)[1]
        steps += 1
    assert order.steps_for_epochs(epochs) == steps
    assert (steps - 1) * BUDGET * 4 < epochs * sum(LENGTHS) * 2  # micro-batches at least half full on average


def test_the_data_stream_draws_packed_steps_and_keeps_the_position():
    """DataStream.steps (the offline loop's draw) over the token-balanced order: each step moves the position by
    the rows it took; a stream restored from the saved position draws the same next step."""
    dataset = datasets.Dataset.from_dict({"input_ids": [[1] * length for length in LENGTHS]})
    stream = DataStream(dataset, orders(1)[0])
    steps = stream.steps(2)
    first = next(steps)
    taken = orders(1)[0].global_step(0)[1]
    assert stream.consumed_samples == taken and sum(len(micro) for micro in first) == taken
    saved = stream.state_dict()
    following = next(steps)
    restored = DataStream(dataset, orders(1)[0])
    restored.load_state_dict(saved)
    assert next(restored.steps(2)) == following


def test_a_row_over_the_budget_is_refused_named():
    with pytest.raises(PackingError, match=r"data row 2 has 300 tokens, more than train.micro_batch_tokens 256"):
        TokenBalancedOrder([5, 8, 300], 256, 1, 0, 1, seed=0)


def test_shardedorder_steps_group_its_micro_batches():
    order = ShardedOrder(20, 2, 2, 1, seed=0)
    batches = order.micro_batches(8)
    own, taken = next(order.steps(8, accumulation=3))
    assert own == [next(batches) for _ in range(3)] and taken == 12


JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 256, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 96, packing: true}}
train: {{train_type: sft, max_steps: 4, micro_batch_tokens: 200, grad_accum_steps: 2, lr: 0.005, seed: 7}}
deepspeed: {{zero_stage: 0}}
checkpoint: {{every_steps: 2, keep_last: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def test_a_packed_sft_resume_continues_on_the_same_rows(one_rank, tmp_path):
    """4 packed steps straight, and a resume from its step-2 checkpoint: the same samples count, tokens and
    losses at steps 3 and 4 (the same rows, in the same micro-batches)."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join((REPO / "data/arithmetic/sft.jsonl").read_text().splitlines(keepends=True)[:48]))
    records = {}
    for name, overrides in (
        ("straight", []),
        ("resumed", [f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000002'}"]),
    ):
        config = tmp_path / f"{name}.yaml"
        config.write_text(JOB.format(output_dir=tmp_path / name, data=data))
        run = build_run(load_job(config, overrides), one_rank, str(config))
        assert isinstance(run.data.order, TokenBalancedOrder)
        TRAIN_LOOPS["offline"](run)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        records[name] = {record["step"]: record for record in map(json.loads, lines)}
    straight, resumed = records["straight"], records["resumed"]
    assert straight[2]["samples"] > 2 * 2  # more than one row per micro-batch: rows are packed
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step]["samples"] == straight[step]["samples"]
        assert resumed[step]["tokens"] == straight[step]["tokens"]
        assert resumed[step]["loss"] == pytest.approx(straight[step]["loss"], abs=1e-6)
