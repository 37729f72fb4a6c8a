"""Rows -> token ids and loss masks: chat rendering for `sft`, packing for `seq`.

Both run through `datasets.map(batched=True)`, so results are cached under the output dir.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = {"system", "user", "assistant"}


class RowError(ValueError):
    """One malformed row; `index` is its global position, so the caller can name file and row."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def row_messages(row: dict, index: int, fields) -> list[dict]:
    """The chat of one row: its `messages` list, or a `prompt`/`response` pair turned into one."""
    messages = row.get(fields.messages_field)
    if messages is None:
        prompt, response = row.get(fields.prompt_field), row.get(fields.response_field)
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise RowError(
                index,
                f"needs a {fields.messages_field!r} list or string {fields.prompt_field!r} and "
                f"{fields.response_field!r} fields",
            )
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    if not isinstance(messages, list) or not messages:
        raise RowError(index, f"{fields.messages_field!r} must be a non-empty list")
    for position, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise RowError(
                index, f"message {position} must be {{role: system|user|assistant, content: string}}, got {message!r}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(index, "no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _render_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_ids_and_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], last_turn_only: bool = False
) -> tuple[list[int], list[int]]:
    """Ids of the whole chat and a mask that is 1 on assistant tokens only (the last turn's only,
    when `last_turn_only`: preference pairs train the completion, not the context).

    Each assistant turn's tokens are found as the difference between the rendering up to that turn
    and the prompt rendered with `add_generation_prompt`. This works with any template whose
    renderings are prefixes of each other (checked, so a template where they are not fails loudly).
    """
    ids = _render_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant" or (last_turn_only and turn != len(messages) - 1):
            continue
        start = len(_render_ids(tokenizer, messages[:turn], add_generation_prompt=True))
        end = len(_render_ids(tokenizer, messages[: turn + 1], add_generation_prompt=False))
        if ids[:end] != _render_ids(tokenizer, messages[: turn + 1], add_generation_prompt=False)[:end] or start > end:
            raise ValueError(
                "the chat template does not render conversations as prefixes of each other; cannot mask prompts"
            )
        mask[start:end] = [1] * (end - start)
    return ids, mask


def sft_batch(
    batch: dict[str, list], indices: list[int], *, tokenizer, fields, max_len: int, skip_bad: bool
) -> dict[str, list[Any]]:
    """`datasets.map` function: chat rows -> input_ids, loss_mask (prompt tokens masked), bad flag."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "bad": []}
    for row, index in zip(rows, indices):
        try:
            ids, mask = chat_ids_and_mask(tokenizer, row_messages(row, index, fields))
            ids, mask = ids[:max_len], mask[:max_len]
            if sum(mask[1:]) == 0:
                raise RowError(index, f"no response token left within data.max_seq_len={max_len}")
        except RowError:
            if not skip_bad:
                raise
            ids, mask = [], []
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["bad"].append(not ids)
    return out


def pack_batch(
    batch: dict[str, list], indices: list[int], *, tokenizer, field: str, block_len: int
) -> dict[str, list[Any]]:
    """`datasets.map` function: texts -> EOS-separated stream -> fixed blocks of `block_len` tokens.

    The tail of each map batch that does not fill a block is dropped (as in most pre-training
    code); documents in a block attend to each other, which packed pre-training accepts.
    """
    stream: list[int] = []
    for text, index in zip(batch[field], indices):
        if not isinstance(text, str):
            raise RowError(index, f"field {field!r} must be a string, got {type(text).__name__}")
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.eos_token_id)
    blocks = [stream[start : start + block_len] for start in range(0, len(stream) - block_len + 1, block_len)]
    return {"input_ids": blocks, "loss_mask": [[1] * block_len for _ in blocks]}


def is_text_row(row: dict, field: str) -> bool:
    return isinstance(row.get(field), str)


def _completion(value, index: int, name: str) -> str:
    """A completion is a string or a one-message assistant list (the conversational format)."""
    if (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], dict)
        and value[0].get("role") == "assistant"
    ):
        value = value[0].get("content")
    if not isinstance(value, str):
        raise RowError(index, f"{name!r} must be a string (or a one-message assistant list), got {value!r}")
    return value


def prompt_messages(row: dict, index: int, fields) -> list[dict]:
    """The context of a preference pair or an RL prompt: a `messages` list or a `prompt` string."""
    messages = row.get(fields.messages_field)
    if messages is None:
        prompt = row.get(fields.prompt_field)
        if not isinstance(prompt, str):
            raise RowError(index, f"needs a {fields.messages_field!r} list or a string {fields.prompt_field!r}")
        return [{"role": "user", "content": prompt}]
    if not isinstance(messages, list) or not messages:
        raise RowError(index, f"{fields.messages_field!r} must be a non-empty list")
    for position, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise RowError(
                index, f"message {position} must be {{role: system|user|assistant, content: string}}, got {message!r}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def preference_batch(
    batch: dict[str, list], indices: list[int], *, tokenizer, fields, max_len: int, skip_bad: bool
) -> dict[str, list[Any]]:
    """`datasets.map` function: (prompt, chosen, rejected) rows -> ids and completion masks of both."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out: dict[str, list[Any]] = {
        "chosen_ids": [],
        "chosen_mask": [],
        "rejected_ids": [],
        "rejected_mask": [],
        "bad": [],
    }
    for row, index in zip(rows, indices):
        try:
            context = prompt_messages(row, index, fields)
            pair = {}
            for name, field in (("chosen", fields.chosen_field), ("rejected", fields.rejected_field)):
                reply = {"role": "assistant", "content": _completion(row.get(field), index, field)}
                ids, mask = chat_ids_and_mask(tokenizer, context + [reply], last_turn_only=True)
                ids, mask = ids[:max_len], mask[:max_len]
                if sum(mask[1:]) == 0:
                    raise RowError(index, f"no {name} token left within data.max_seq_len={max_len}")
                pair[name] = (ids, mask)
        except RowError:
            if not skip_bad:
                raise
            pair = {"chosen": ([], []), "rejected": ([], [])}
        for name in ("chosen", "rejected"):
            out[f"{name}_ids"].append(pair[name][0])
            out[f"{name}_mask"].append(pair[name][1])
        out["bad"].append(not pair["chosen"][0])
    return out
