"""Prompt rows for rollouts (astrai/rollout/prompts.py): rendered with the generation prompt, every
field of the row kept for the reward, and a too long or malformed prompt reported as a bad row."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from astrai.data.render import RowError
from astrai.rollout.prompts import decode_prompt_row, prompt_batch
from tests.unit.rollout_fixtures import tiny_tokenizer

FIELDS = SimpleNamespace(messages_field="messages", prompt_field="prompt")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_prompt_rows_render_with_generation_prompt_and_keep_every_field(tokenizer):
    batch = {"prompt": ["1+2=", None], "answer": ["3", "5"], "messages": [None, [{"role": "user", "content": "2+3="}]]}
    out = prompt_batch(batch, [0, 1], tokenizer=tokenizer, fields=FIELDS, max_len=64, skip_bad=False)
    ids, messages, row = decode_prompt_row({key: values[0] for key, values in out.items()})
    assert tokenizer.decode(ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert messages == [{"role": "user", "content": "1+2="}] and row["answer"] == "3"
    second = decode_prompt_row({key: values[1] for key, values in out.items()})
    assert second[1] == [{"role": "user", "content": "2+3="}] and second[2]["answer"] == "5"
    assert json.loads(out["row"][1])["prompt"] is None and out["bad"] == [False, False]


def test_too_long_or_malformed_prompt_is_a_bad_row(tokenizer):
    batch = {"prompt": ["1+2=" * 20, 7]}
    with pytest.raises(RowError, match="more than data.max_seq_len=16"):
        prompt_batch(batch, [0, 1], tokenizer=tokenizer, fields=FIELDS, max_len=16, skip_bad=False)
    out = prompt_batch(batch, [0, 1], tokenizer=tokenizer, fields=FIELDS, max_len=16, skip_bad=True)
    assert out["bad"] == [True, True] and out["prompt_ids"] == [[], []]
