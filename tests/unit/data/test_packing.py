"""Padding-free packing (`data.packing`, `data.document_mask`): a packed micro-batch gives the same logits,
loss and gradients as the padded run of the same rows (fp32, CPU, within 1e-5), and counts the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.config import load_job
from astrai.data.packing import (
    SEGMENT_ATTENTION,
    PackingError,
    check_packing_attention,
    document_positions,
    model_inputs,
    pack_sequences,
)
from astrai.models.segment_attention import use_segment_attention
from astrai.models.tokenizer import build_tokenizer
from astrai.strategies.dpo import DpoStrategy
from astrai.strategies.language_modeling import SeqStrategy, SftStrategy

JOB = """\
output_dir: {folder}/out
model: {{init: {{model_type: llama}}}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {folder}/rows.jsonl}}
train: {{train_type: {train_type}, micro_batch_size: 3, max_steps: 1}}
"""


def tiny_model(vocab_size: int, attention: str = "sdpa") -> LlamaForCausalLM:
    """A 2-layer fp32 Llama; attention "segment": sdpa switched to astrai's one-row-at-a-time sdpa."""
    segment = attention == "segment"
    attention = "sdpa" if segment else attention
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attn_implementation=attention,
    )
    model = LlamaForCausalLM(config).float()
    if segment:
        assert use_segment_attention(model) and model.config._attn_implementation == SEGMENT_ATTENTION
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("char", ["abcdefghijklmnopqrstuvwxyz0123456789 \n"])


def strategy(cls, tmp_path, tokenizer, train_type: str, *overrides: str):
    path = tmp_path / f"{train_type}.yaml"
    path.write_text(JOB.format(folder=tmp_path, train_type=train_type))
    return cls(load_job(path, list(overrides), check_paths=False), tokenizer)


def loss_and_gradients(model, strategy_object, batch: dict, normalizer: float):
    model.zero_grad()
    output = strategy_object.compute_loss(model, batch, normalizer)
    output.loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output, gradients


def assert_same(padded, packed):
    (padded_output, padded_gradients), (packed_output, packed_gradients) = padded, packed
    assert float(packed_output.loss.detach()) == pytest.approx(float(padded_output.loss.detach()), abs=1e-5)
    assert padded_gradients.keys() == packed_gradients.keys()
    for name, gradient in padded_gradients.items():
        torch.testing.assert_close(packed_gradients[name], gradient, atol=1e-5, rtol=0, msg=name)
    for key, value in padded_output.sums.items():
        assert packed_output.sums[key] == pytest.approx(value, abs=1e-4), key


@pytest.mark.parametrize("attention", ["sdpa", "eager", "segment"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_row_logits_equal_each_row_alone(attention, mode):
    """transformers keeps packed rows apart from position_ids alone (attention_mask None, no cache), in
    eval mode too, where a model would otherwise make a cache and skip the packed-row detection."""
    model = getattr(tiny_model(40, attention), mode)()
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16]]
    batch = pack_sequences(rows, [[1] * len(row) for row in rows])
    with torch.no_grad():
        packed = model(**model_inputs(batch, model)).logits[0]
        start = 0
        for row in rows:
            alone = model(input_ids=torch.tensor([row])).logits[0]
            torch.testing.assert_close(packed[start : start + len(row)], alone, atol=1e-5, rtol=0)
            start += len(row)


def test_segment_attention_reads_the_row_boundaries():
    """The one-row-at-a-time sdpa takes its rows from cu_seq_lens: told the packed row is one row, it lets the
    rows attend to each other (so the equality above is its own work, not transformers' mask)."""
    model = tiny_model(40, "segment").eval()
    rows = [[3, 4, 5, 6, 7], [8, 9, 10]]
    inputs = model_inputs(pack_sequences(rows, [[1] * 5, [1] * 3]), model)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 5, 8]
    with torch.no_grad():
        apart = model(**inputs).logits[0, 5:]
        inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = torch.tensor([0, 8], dtype=torch.int32)
        together = model(**inputs).logits[0, 5:]
        alone = model(input_ids=torch.tensor([rows[1]])).logits[0]
    torch.testing.assert_close(apart, alone, atol=1e-5, rtol=0)
    assert (together - alone).abs().max() > 1e-3


def test_an_attention_that_cannot_keep_rows_apart_is_refused():
    model = tiny_model(40)
    check_packing_attention(model, "data.packing")
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(PackingError, match=r"data.packing: true needs .*'paged\|sdpa'"):
        check_packing_attention(model, "data.packing")


def test_pack_sequences_drops_the_loss_of_each_first_token():
    batch = pack_sequences([[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1]])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1]]  # 4 is never predicted by 3
    assert batch["sequence_lengths"].tolist() == [3, 2]


SFT_ROWS = [
    {"input_ids": [3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1]},
    {"input_ids": [9, 10, 11], "loss_mask": [0, 1, 1]},
    {"input_ids": [12, 13, 14, 15, 16, 17, 18, 19, 20], "loss_mask": [0, 0, 0, 0, 1, 1, 1, 1, 1]},
]


@pytest.mark.parametrize("attention", ["sdpa", "segment"])
def test_sft_packed_loss_and_gradients_equal_padded(tmp_path, tokenizer, attention):
    model = tiny_model(len(tokenizer), attention).train()
    padded = strategy(SftStrategy, tmp_path, tokenizer, "sft")
    packed = strategy(SftStrategy, tmp_path, tokenizer, "sft", "data.packing=true")
    padded_batch, packed_batch = padded.collate(SFT_ROWS), packed.collate(SFT_ROWS)
    assert packed_batch["input_ids"].shape == (1, 18) and padded_batch["input_ids"].shape == (3, 9)
    # the global token normaliser counts the same loss tokens, and the metrics the same real tokens
    assert packed.loss_weight(packed_batch) == padded.loss_weight(padded_batch) == 10
    assert packed_batch["attention_mask"].sum() == padded_batch["attention_mask"].sum()
    normalizer = 7.0
    assert_same(
        loss_and_gradients(model, padded, padded_batch, normalizer),
        loss_and_gradients(model, packed, packed_batch, normalizer),
    )


def test_seq_document_mask_equals_each_document_alone(tmp_path, tokenizer):
    """A block of EOS-separated documents with data.document_mask: the loss and gradients of the documents
    run as padded rows of their own; without the mask the block is trained as before (documents attend)."""
    eos = tokenizer.eos_token_id
    documents = [[13, 4, 5, eos], [6, 7, eos], [8, 9, 10, 11, eos]]
    block = [token for document in documents for token in document][:11]  # the last document cut by the block
    assert len(block) == 11
    model = tiny_model(len(tokenizer)).train()
    masked = strategy(SeqStrategy, tmp_path, tokenizer, "seq", "data.document_mask=true")
    plain = strategy(SeqStrategy, tmp_path, tokenizer, "seq")
    masked_batch = masked.collate([{"input_ids": block, "loss_mask": [1] * len(block)}])
    assert masked_batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]
    pieces = [documents[0], documents[1], block[7:]]
    alone = plain.collate([{"input_ids": piece, "loss_mask": [1] * len(piece)} for piece in pieces])
    assert masked.loss_weight(masked_batch) == plain.loss_weight(alone) == 3 + 2 + 3
    normalizer = 5.0
    assert_same(
        loss_and_gradients(model, plain, alone, normalizer),
        loss_and_gradients(model, masked, masked_batch, normalizer),
    )
    unmasked = plain.collate([{"input_ids": block, "loss_mask": [1] * len(block)}])
    assert "position_ids" not in unmasked and plain.loss_weight(unmasked) == 10  # today's behaviour


def test_document_positions_of_a_block():
    positions, starts = document_positions(torch.tensor([[5, 0, 6, 7, 0, 0, 8]]), eos_token_id=0)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert starts.tolist() == [[False, False, True, False, False, True, True]]


DPO_ROWS = [
    {
        "chosen_ids": [5, 6, 7, 8],
        "chosen_mask": [0, 0, 0, 1],
        "rejected_ids": [5, 6, 9, 10, 11],
        "rejected_mask": [0, 0, 1, 1, 1],
        "reference_chosen_logps": -2.0,
        "reference_rejected_logps": -3.0,
    },
    {
        "chosen_ids": [7, 8, 12, 13],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_ids": [7, 8, 14, 15, 16, 17],
        "rejected_mask": [0, 0, 1, 1, 1, 1],
        "reference_chosen_logps": -1.5,
        "reference_rejected_logps": -2.5,
    },
]


@pytest.mark.parametrize(("loss", "attention"), [("sigmoid", "sdpa"), ("ipo", "sdpa"), ("simpo", "segment")])
def test_dpo_packed_loss_and_gradients_equal_padded(tmp_path, tokenizer, loss, attention):
    model = tiny_model(len(tokenizer), attention).train()
    rows = [dict(row) for row in DPO_ROWS]
    if loss == "simpo":
        rows = [{k: v for k, v in row.items() if not k.startswith("reference")} for row in rows]
    padded = strategy(DpoStrategy, tmp_path, tokenizer, "dpo", f"dpo.loss={loss}")
    packed = strategy(DpoStrategy, tmp_path, tokenizer, "dpo", f"dpo.loss={loss}", "data.packing=true")
    padded_batch, packed_batch = padded.collate(rows), packed.collate(rows)
    assert packed_batch["input_ids"].shape == (1, 19)
    assert packed.loss_weight(packed_batch) == padded.loss_weight(padded_batch) == 2
    assert_same(
        loss_and_gradients(model, padded, padded_batch, 2.0),
        loss_and_gradients(model, packed, packed_batch, 2.0),
    )
