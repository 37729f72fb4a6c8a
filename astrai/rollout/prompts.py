"""Prompt rows -> token ids for generation: `messages` or `prompt` rendered with the chat template and
`add_generation_prompt`, plus the whole row (as JSON) so that rewards can read any field of it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from astrai.data.render import RowError, prompt_messages


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat so far, ending with the template's opening of an assistant turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_batch(
    batch: dict[str, list], indices: list[int], *, tokenizer, fields, max_len: int, skip_bad: bool
) -> dict[str, list[Any]]:
    """`datasets.map` function: rows -> prompt_ids, messages (JSON), row (JSON), bad flag.

    A prompt longer than `data.max_seq_len` tokens is a bad row: cutting it would drop the part of
    the instructions the reward may depend on, so it is refused (or skipped) rather than truncated.
    """
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out: dict[str, list[Any]] = {"prompt_ids": [], "messages": [], "row": [], "bad": []}
    for row, index in zip(rows, indices):
        try:
            messages = prompt_messages(row, index, fields)
            ids = render_prompt(tokenizer, messages)
            if len(ids) > max_len:
                raise RowError(index, f"prompt has {len(ids)} tokens, more than data.max_seq_len={max_len}")
        except RowError:
            if not skip_bad:
                raise
            messages, ids = [], []
        out["prompt_ids"].append(ids)
        out["messages"].append(json.dumps(messages))
        out["row"].append(json.dumps(row, default=str))  # any column types; rewards get plain JSON values
        out["bad"].append(not ids)
    return out


def decode_prompt_row(example: dict) -> tuple[list[int], list[dict], dict]:
    """A prepared example -> (prompt_ids, messages, original row)."""
    return list(example["prompt_ids"]), json.loads(example["messages"]), json.loads(example["row"])


@dataclass(frozen=True)
class Prompts:
    """The prompts of one rollout, one entry each: token ids (chat template applied), chat messages and the
    data row (handed on to the rewards)."""

    ids: Sequence[Sequence[int]]
    messages: Sequence[list[dict]]
    rows: Sequence[dict]

    @classmethod
    def from_examples(cls, examples: Sequence[dict]) -> Prompts:
        """Prepared examples (`prompt_batch`' columns) -> their prompts."""
        ids, messages, rows = zip(*(decode_prompt_row(example) for example in examples))
        return cls(ids, messages, rows)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: slice) -> Prompts:
        return Prompts(self.ids[index], self.messages[index], self.rows[index])
