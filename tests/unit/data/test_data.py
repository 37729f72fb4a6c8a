"""Data: chat masks, packing, deterministic sharding, malformed rows named by file and row."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from astrai.data import DataError, tokenize_rows
from astrai.data.collate import collate_token_rows
from astrai.data.render import RowError, chat_ids_and_mask, pack_batch, preference_batch, row_messages, sft_batch
from astrai.data.sharded_order import ShardedOrder
from astrai.data.sources import load_rows
from astrai.models.tokenizer import build_tokenizer

FIELDS = SimpleNamespace(messages_field="messages", prompt_field="prompt", response_field="response")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("char", ["0123456789+-= abcdefghijklmnopqrstuvwxyz\n"])


def test_chat_mask_covers_assistant_tokens_only(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = chat_ids_and_mask(tokenizer, messages)
    assert len(ids) == len(mask)
    trained = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    # Each assistant turn trains its content, its end marker and the newline the template adds.
    assert trained == "3<|im_end|>\n4<|im_end|>\n"
    untrained = tokenizer.decode([token for token, keep in zip(ids, mask) if not keep])
    assert "1+2=" in untrained and "be brief" in untrained and "3" not in untrained.replace("<|im_start|>", "")


def test_prompt_response_rows_become_chats():
    assert row_messages({"prompt": "q", "response": "a"}, 0, FIELDS) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    with pytest.raises(RowError, match="no assistant message"):
        row_messages({"messages": [{"role": "user", "content": "q"}]}, 0, FIELDS)
    with pytest.raises(RowError, match="message 0 must be"):
        row_messages({"messages": [{"role": "robot", "content": "q"}]}, 0, FIELDS)


def test_sft_truncation_and_skip(tokenizer):
    batch = {"messages": [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], None]}
    out = sft_batch(batch, [0, 1], tokenizer=tokenizer, fields=FIELDS, max_len=64, skip_bad=True)
    assert out["bad"] == [False, True] and out["input_ids"][1] == []
    with pytest.raises(RowError):
        sft_batch(batch, [0, 1], tokenizer=tokenizer, fields=FIELDS, max_len=64, skip_bad=False)
    short = sft_batch(batch, [0, 1], tokenizer=tokenizer, fields=FIELDS, max_len=8, skip_bad=True)
    assert short["bad"] == [True, True]  # the answer does not fit in 8 tokens


def test_packing_makes_full_blocks_separated_by_eos(tokenizer):
    texts = ["1+1=2", "22+3=25", "9-4=5"]
    out = pack_batch({"text": texts}, [0, 1, 2], tokenizer=tokenizer, field="text", block_len=6)
    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert out["input_ids"] == [stream[0:6], stream[6:12], stream[12:18]]  # 20 tokens -> 3 blocks, tail dropped
    assert all(mask == [1] * 6 for mask in out["loss_mask"])


def test_sharding_is_disjoint_complete_and_deterministic():
    size, micro, world = 103, 4, 2
    orders = [ShardedOrder(size, micro, world, rank, seed=7) for rank in range(world)]
    per_epoch_steps = orders[0].samples_per_epoch // (micro * world)
    seen = [[], []]
    for rank, order in enumerate(orders):
        iterator = order.micro_batches(0)
        for _ in range(per_epoch_steps):
            seen[rank] += next(iterator)
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0]) | set(seen[1])) == orders[0].samples_per_epoch == 96
    # Same seed, same order; another epoch, another order.
    again = ShardedOrder(size, micro, world, 0, seed=7).micro_batches(0)
    assert [next(again) for _ in range(per_epoch_steps)] == [
        seen[0][i : i + micro] for i in range(0, len(seen[0]), micro)
    ]
    assert orders[0].epoch_order(0) != orders[0].epoch_order(1)


def test_resume_position_continues_the_stream_exactly():
    order = ShardedOrder(50, 2, 2, 1, seed=3)
    straight = order.micro_batches(0)
    stream = [next(straight) for _ in range(40)]  # crosses epoch boundaries (12 micro-steps per epoch)
    resumed = order.micro_batches(consumed_samples=17 * 4)
    assert [next(resumed) for _ in range(23)] == stream[17:]
    with pytest.raises(ValueError, match="not a multiple"):
        next(order.micro_batches(consumed_samples=3))


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one global micro-batch"):
        ShardedOrder(3, 2, 2, 0, seed=0)


def test_malformed_row_error_names_file_and_row(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
    )
    rows = load_rows(str(tmp_path), "auto", tmp_path / "cache")
    assert len(rows.dataset) == 4

    def function(batch, indices):
        return sft_batch(batch, indices, tokenizer=tokenizer, fields=FIELDS, max_len=64, skip_bad=False)

    with pytest.raises(DataError, match=r"b\.jsonl row 2: no assistant message"):
        tokenize_rows(rows, function, num_proc=1, description="test")


def test_unreadable_file_is_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: cannot read as json"):
        load_rows(str(tmp_path / "bad.jsonl"), "auto", tmp_path / "cache")


def test_collate_pads_right(tokenizer):
    batch = collate_token_rows(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}], tokenizer.pad_token_id
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, tokenizer.pad_token_id, tokenizer.pad_token_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


PAIR_FIELDS = SimpleNamespace(
    messages_field="messages", prompt_field="prompt", chosen_field="chosen", rejected_field="rejected"
)


def trained_and_context(tokenizer, ids, mask):
    return tokenizer.decode([t for t, keep in zip(ids, mask) if keep]), tokenizer.decode(
        [t for t, keep in zip(ids, mask) if not keep]
    )


def test_preference_rows_mask_only_the_responses(tokenizer):
    """A `prompt` row and a `messages` row (whose earlier assistant turn is context, not trained)."""
    earlier = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+5="},
    ]
    batch = {
        "prompt": ["3+4=", None],
        "messages": [None, earlier],
        "chosen": ["7", "7"],
        "rejected": ["8", [{"role": "assistant", "content": "9"}]],
    }
    out = preference_batch(batch, [0, 1], tokenizer=tokenizer, fields=PAIR_FIELDS, max_len=64, skip_bad=False)
    assert out["bad"] == [False, False]
    for row, (chosen, rejected) in enumerate([("7", "8"), ("7", "9")]):
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            ids, mask = out[f"{name}_ids"][row], out[f"{name}_mask"][row]
            assert len(ids) == len(mask)
            trained, context = trained_and_context(tokenizer, ids, mask)
            assert trained == f"{answer}<|im_end|>\n", (
                row,
                name,
            )  # the response, its end marker and the template's newline
            assert context.endswith("<|im_start|>assistant\n") and answer not in context.replace("<|im_start|>", "")
        # Both completions share the prompt's tokens exactly; only the responses differ.
        start = out["chosen_mask"][row].index(1)
        assert (
            out["chosen_ids"][row][:start] == out["rejected_ids"][row][:start]
            and out["rejected_mask"][row].index(1) == start
        )
    _, context = trained_and_context(tokenizer, out["chosen_ids"][0], out["chosen_mask"][0])
    assert "3+4=" in context
    _, context = trained_and_context(tokenizer, out["chosen_ids"][1], out["chosen_mask"][1])
    assert "1+1=" in context and "2+5=" in context and "2<|im_end|>" in context  # the earlier answer is context


@pytest.mark.parametrize(
    "rejected, reason", [(None, "'rejected' must be a string .*got None"), (4, "'rejected' must be a string .*got 4")]
)
def test_malformed_preference_row_names_file_and_row(tmp_path, tokenizer, rejected, reason):
    # Word answers: a column mixing strings and numbers is read with datasets' Json feature, which
    # decodes a numeric string ("3") of the good rows as a number too (astrai/data/sources.py).
    good = {"prompt": "1+1=", "chosen": "two", "rejected": "three"}
    bad = {"prompt": "2+2=", "chosen": "four"} if rejected is None else {**good, "rejected": rejected}
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in (good, good, bad)))
    rows = load_rows(str(tmp_path / "pairs.jsonl"), "auto", tmp_path / "cache")

    def function(batch, indices):
        return preference_batch(batch, indices, tokenizer=tokenizer, fields=PAIR_FIELDS, max_len=64, skip_bad=False)

    with pytest.raises(DataError, match=rf"pairs\.jsonl row 3: {reason}"):
        tokenize_rows(rows, function, num_proc=1, description="test")
    skipped = preference_batch(
        {"prompt": ["1+1="], "chosen": ["2"], "rejected": [rejected]},
        [0],
        tokenizer=tokenizer,
        fields=PAIR_FIELDS,
        max_len=64,
        skip_bad=True,
    )
    assert skipped["bad"] == [True] and skipped["chosen_ids"] == [[]]
