"""The `tokenizer` and `data` sections: where the tokenizer comes from, and how data rows become tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astrai.config.sections.base import Section


class TokenizerBuild(Section):
    kind: Literal["char", "bpe"] = Field(
        "char",
        description="`char`: one token per character seen in the data; `bpe`: byte-level BPE trained on the data.",
    )
    vocab_size: int = Field(512, ge=16, description="Target vocabulary size for `bpe` (ignored by `char`).")
    fill_vocab: bool = Field(
        False,
        description="`bpe` only: when the data trains fewer than `vocab_size` tokens, fill the rest with tokens no "
        "text encodes to, so the tokenizer (and the model's embedding and output layer) has exactly `vocab_size` ids: "
        "a large-vocabulary shape on a small corpus (configs/scale_0p5b.yaml).",
    )


class TokenizerConfig(Section):
    path: str | None = Field(
        None, description="Local tokenizer folder (default: `model.path`). Hub names fail offline with a clear error."
    )
    build: TokenizerBuild | None = Field(
        None, description="Build a tokenizer from the training data instead of loading one (small runs)."
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template to set on the tokenizer (default: the tokenizer's own, else ChatML when the "
        "tokenizer has `<|im_start|>`/`<|im_end|>` as single tokens; otherwise a train type that renders chats fails "
        "before training).",
    )
    pad_token: str | None = Field(
        None,
        description="A token of the vocabulary to pad with (default: the tokenizer's own, else its EOS). `rm` needs "
        "one that is not the EOS, as its reward head reads the last non-pad token.",
    )


class DataConfig(Section):
    path: str = Field(..., description="Training data: a local file, folder or glob of json/jsonl/parquet/arrow files.")
    format: Literal["auto", "json", "parquet", "arrow"] = Field(
        "auto", description="File format; `auto` reads it from the extension."
    )
    text_field: str = Field("text", description="Field with raw text (`seq`).")
    messages_field: str = Field(
        "messages", description="Field with a chat `[{role, content}]` list (`sft`, `dpo`, RL prompts)."
    )
    prompt_field: str = Field("prompt", description="Field with a prompt string, used when there is no messages field.")
    response_field: str = Field(
        "response", description="Field with the response string (`sft` with prompt/response rows)."
    )
    chosen_field: str = Field("chosen", description="Preferred response (`dpo`).")
    rejected_field: str = Field("rejected", description="Dispreferred response (`dpo`).")
    max_seq_len: int = Field(512, ge=8, description="Block length for `seq` packing; longer `sft` rows are truncated.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="Malformed row: stop with file and row named, or skip and count it in the log."
    )
    num_proc: int = Field(1, ge=1, description="Processes for tokenisation (`datasets.map`).")
    shuffle: bool = Field(True, description="Shuffle each epoch (deterministic for `train.seed` and the epoch).")
    packing: bool = Field(
        False,
        description="`sft`, `dpo`: padding-free micro-batches. Rows (a dpo pair as one) are concatenated into one row "
        "of up to `train.micro_batch_tokens` tokens, positions restart at every row and attention never crosses "
        "one; the sampler balances tokens across ranks (docs/guides/training.md, Packing).",
    )
    document_mask: bool = Field(
        False,
        description="`seq`: documents inside a packed block stop attending to each other (positions restart after "
        "every EOS; a document's first token is not predicted from the one before). false: they attend across.",
    )
