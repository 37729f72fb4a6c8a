"""Tokenizers: load a local one, or build a small one from the training texts (no hub at run time).

Built tokenizers use ChatML markers as single special tokens, so a chat template renders the same
way for every kind; `<|im_end|>` is the end-of-sequence token (generation stops there).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


class TokenizerError(Exception):
    """A tokenizer that cannot be loaded or built; the message says which and why."""


def build_tokenizer(kind: str, texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A deterministic tokenizer trained on `texts`: one token per character (`char`) or byte-level BPE."""
    if kind == "char":
        characters = sorted({character for text in texts for character in text})
        vocabulary = {token: index for index, token in enumerate(SPECIAL_TOKENS + ["<|unk|>"] + characters)}
        backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<|unk|>"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
    elif kind == "bpe":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        backend.train_from_iterator(texts, trainer=trainer)
    else:
        raise TokenizerError(f"tokenizer.build.kind: unknown kind {kind!r} (use char or bpe)")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>", additional_special_tokens=["<|endoftext|>", "<|im_start|>"]
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer from a local folder; hub names are refused offline with a clear message."""
    if not Path(path).is_dir():
        raise TokenizerError(f"tokenizer: {path!r} is not a local folder (AstrAI never downloads from a hub at run time)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"tokenizer: cannot load from {path!r}: {error}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        # Right padding is always masked out of losses, so reusing EOS as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> None:
    """Write the tokenizer atomically enough for readers: into a temp folder, then rename."""
    folder = Path(folder)
    temporary = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    tokenizer.save_pretrained(temporary)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    os.replace(temporary, folder)
