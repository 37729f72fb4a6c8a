"""Ulysses sequence parallelism's single-process parts: what a job may ask (sizes, heads, train types, attention),
the packed row the cuts are made from, and DeepSpeed's tiled MLP. The 2-rank equality with data parallelism is
tests/integration/test_sequence_parallel_ranks.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

from astrai.config import ConfigError, load_job
from astrai.engine import check_heads, tile_mlps
from astrai.launch.job_checks import check_sequence_parallel
from astrai.models.token_forward import packed_row
from tests.conftest import REPO

QUICKSTART = str(REPO / "configs/quickstart.yaml")


def test_heads_must_split_over_the_group():
    check_heads(LlamaConfig(num_attention_heads=8, num_key_value_heads=2), 4)  # kv heads repeated to 4 ranks
    check_heads(LlamaConfig(num_attention_heads=8, num_key_value_heads=8), 8)
    with pytest.raises(ConfigError, match="does not divide the model's 14 attention heads"):
        check_heads(LlamaConfig(num_attention_heads=14, num_key_value_heads=2, hidden_size=896), 8)
    with pytest.raises(ConfigError, match="neither divides the model's 6 key/value heads"):
        check_heads(LlamaConfig(num_attention_heads=12, num_key_value_heads=6, hidden_size=96), 4)
    with pytest.raises(ConfigError, match="sliding-window"):
        check_heads(MistralConfig(num_attention_heads=8, num_key_value_heads=2, sliding_window=4096), 2)


def test_the_job_names_what_cannot_be_cut(tmp_path):
    job = load_job(QUICKSTART, [f"output_dir={tmp_path}", "parallel.sequence_parallel_size=2"])
    check_sequence_parallel(job, world_size=2)  # the quickstart's 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="parallel.sequence_parallel_size: 2 does not divide the world size 3"):
        check_sequence_parallel(job, world_size=3)
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        check_sequence_parallel(
            load_job(QUICKSTART, [f"output_dir={tmp_path}", "parallel.sequence_parallel_size=8"]), 8
        )
    with pytest.raises(ConfigError, match="attn_implementation: eager"):
        load_job(
            QUICKSTART,
            [f"output_dir={tmp_path}", "parallel.sequence_parallel_size=2", "model.attn_implementation=eager"],
        )
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel_size: 2` with `rl.share_prefix`: use one"):
        load_job(
            str(REPO / "configs/quickstart_grpo.yaml"), [f"output_dir={tmp_path}", "parallel.sequence_parallel_size=2"]
        )
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        load_job(QUICKSTART, [f"output_dir={tmp_path}", "parallel.sequence_parallel_size=0"])


def test_a_padded_batch_packs_into_one_row_and_back():
    # Row 0 right-padded, row 1 left-padded (an online prompt): positions count from each row's first token.
    input_ids = torch.tensor([[5, 6, 7, 0], [0, 8, 9, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    labels = torch.tensor([[6, 7, -100, -100], [-100, 9, 4, -100]])
    row = packed_row({"input_ids": input_ids, "attention_mask": mask}, labels, size=4)
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 4, 0, 0]  # 6 tokens, padded to a multiple of 4
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # the padding is a document of its own
    assert row.labels.tolist() == [6, 7, -100, 9, 4, -100, -100, -100]
    assert row.cut_length == 2
    statistic = torch.arange(8, dtype=torch.float32, requires_grad=True)
    unpacked = row.unpack(statistic)
    assert unpacked.tolist() == [[0, 1, 2, 0], [0, 3, 4, 5]]
    unpacked.sum().backward()
    assert statistic.grad.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]  # the padding takes no gradient


def test_packed_rows_keep_their_document_positions():
    input_ids = torch.tensor([[1, 2, 3, 4, 5]])
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    row = packed_row({"input_ids": input_ids, "position_ids": positions, "attention_mask": None}, input_ids, size=2)
    assert row.position_ids.tolist() == [0, 1, 0, 1, 2, 0]
    assert row.unpack(torch.arange(6.0)).tolist() == [[0, 1, 2, 3, 4]]


def test_tiled_mlp_gives_the_plain_losses_and_gradients():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50, max_position_embeddings=256,
    )  # fmt: skip
    plain, tiled = LlamaForCausalLM(config), LlamaForCausalLM(config)
    tiled.load_state_dict(plain.state_dict())
    assert tile_mlps(tiled) == 2
    ids = torch.randint(0, 50, (1, 100))  # 100 tokens of width 16: 7 tiles
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, tiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_checkpoint_offload_keeps_the_numbers_and_moves_the_saved_tensors(tmp_path):
    from astrai.models.activation_offload import offload_saved_activations

    job = load_job(QUICKSTART, [f"output_dir={tmp_path}", "model.gradient_checkpointing=offload"])
    assert job.model.gradient_checkpointing == "offload"
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50,
    )  # fmt: skip
    plain, offloaded = LlamaForCausalLM(config), LlamaForCausalLM(config)
    offloaded.load_state_dict(plain.state_dict())
    for model in (plain, offloaded):
        model.gradient_checkpointing_enable()
        model.train()
    offload_saved_activations(offloaded)
    packed = []
    original = torch.autograd.graph.save_on_cpu.__init__

    def counting(self, *args, **kwargs):  # the real context, counted: it is entered once per forward
        packed.append(1)
        original(self, *args, **kwargs)

    ids = torch.randint(0, 50, (2, 20))
    torch.autograd.graph.save_on_cpu.__init__ = counting
    try:
        losses = [model(input_ids=ids, labels=ids).loss for model in (plain, offloaded)]
        with torch.no_grad():
            offloaded(input_ids=ids)  # nothing is saved without gradient: no context
    finally:
        torch.autograd.graph.save_on_cpu.__init__ = original
    assert len(packed) == 1
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0])
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_tiled_mlp_refuses_a_model_without_a_gated_mlp():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ConfigError, match="parallel.tiled_mlp: GPT2LMHeadModel has no gated MLP"):
        tile_mlps(model)


def test_a_wrong_checkpointing_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model.gradient_checkpointing: 'yes_please': use true, false or offload"):
        load_job(QUICKSTART, [f"output_dir={tmp_path}", "model.gradient_checkpointing=yes_please"])
    with pytest.raises(ConfigError, match="parallel.tiled_mlp"):
        load_job(QUICKSTART, [f"output_dir={tmp_path}", "parallel.tiled_mlp=sometimes"])
