"""One owner of the data position (`astrai.data.stream.DataStream`): what a run draws is what it saves, and a restored
stream draws the very next prompts an uninterrupted one would. Pure on a hand-made order, then through a real
grpo run on a one-rank DeepSpeed group: train, checkpoint, resume."""

from __future__ import annotations

import json

import datasets

from astrai.config import load_job
from astrai.data.sharded_order import ShardedOrder
from astrai.data.stream import DataStream
from astrai.resume.training_checkpoints import TrainingCheckpoints
from astrai.training.build import build_run
from astrai.training.loops import train_online
from tests.conftest import REPO


def streams(dataset, rows_per_draw: int, world: int) -> list[DataStream]:
    return [
        DataStream(dataset, ShardedOrder(len(dataset), rows_per_draw, world, rank, seed=3)) for rank in range(world)
    ]


def test_a_restored_stream_draws_what_an_uninterrupted_one_draws_next():
    dataset = datasets.Dataset.from_dict({"id": list(range(21))})  # 21 = 3 draws of 6 per epoch, 3 left over
    straight = [stream.batches() for stream in streams(dataset, 3, 2)]
    drawn = [[next(batches) for _ in range(5)] for batches in straight]  # crosses the epoch boundary
    first = streams(dataset, 3, 2)
    for stream, rank in zip(first, drawn):
        batches = stream.batches()
        assert [next(batches), next(batches)] == rank[:2]
        batches = stream.batches()  # a new iterator starts where the position is, not at the start
        assert [next(batches), next(batches)] == rank[2:4]
    saved = [stream.state_dict() for stream in first]
    assert saved[0] == {"consumed_samples": 4 * 6, "epoch": 1} and saved[0] == saved[1]  # every rank's share counted
    restored = streams(dataset, 3, 2)
    for stream, state in zip(restored, saved):
        stream.load_state_dict(json.loads(json.dumps(state)))  # as trainer_state.json carries it
    assert [next(stream.batches()) for stream in restored] == [rank[4] for rank in drawn]
    assert restored[0].consumed_samples == 5 * 6


JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 3}}
rl: {{kl_coef: 0.0}}
reward: {{function: "tests.unit.strategies.test_ppo_engines:digit_count"}}
train: {{train_type: grpo, max_steps: 2, micro_batch_size: 2, lr: 1e-3,
         lr_schedule: constant, warmup_steps: 0, seed: 5}}
checkpoint: {{every_steps: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def test_an_online_run_resumes_on_the_next_prompt(one_rank, tmp_path):
    """A draw is one step's prompts per rank (4), not a micro-batch (2): the order a resume restores is the one
    the loop drew from, so the resumed run's first prompts are those an uninterrupted run takes at step 3."""
    prompts = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines(keepends=True)[:10]
    (tmp_path / "prompts.jsonl").write_text("".join(prompts))
    config = tmp_path / "grpo.yaml"
    config.write_text(JOB.format(output_dir=tmp_path / "out", data=tmp_path / "prompts.jsonl"))
    run = build_run(load_job(config), one_rank, str(config))
    assert run.data.samples_per_draw == 4
    train_online(run)
    state = json.loads((tmp_path / "out/checkpoints/step_00000002/trainer_state.json").read_text())
    assert state["consumed_samples"] == 2 * 4 and state["epoch"] == 1  # 10 prompts: 2 draws of 4 per epoch
    uninterrupted = DataStream(run.dataset, run.data.order).batches()
    expected = [next(uninterrupted) for _ in range(3)][-1]

    resumed = build_run(load_job(config, ["train.max_steps=3"]), one_rank, str(config))
    TrainingCheckpoints(resumed).resume()
    assert resumed.data.consumed_samples == 8
    assert next(resumed.data.batches()) == expected
