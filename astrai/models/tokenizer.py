"""Tokenizers: load a local one, or build a small one from the training texts (no hub at run time).

Built tokenizers use ChatML markers as single special tokens, so a chat template renders the same
way for every kind; `<|im_end|>` is the end-of-sequence token (generation stops there). A loaded
tokenizer without a chat template gets ChatML only when it has those markers as single tokens: in
any other vocabulary they would split into pieces (or `<unk>`) and no turn would ever end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from astrai.errors import AstraiError
from astrai.safe_write import install_folder

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
TOKENIZER_DIR = "tokenizer"  # in every checkpoint, and in output_dir for a built tokenizer

logger = logging.getLogger("astrai.tokenizer")


class TokenizerError(AstraiError):
    """A tokenizer that cannot be loaded or built; the message says which and why."""


def build_tokenizer(
    kind: str, texts: Iterable[str], vocab_size: int = 512, fill_vocab: bool = False
) -> PreTrainedTokenizerFast:
    """A deterministic tokenizer trained on `texts`: one token per character (`char`) or byte-level BPE.
    fill_vocab (bpe only): ids past what the data trains are filled with unreachable tokens up to `vocab_size`."""
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
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        if fill_vocab:
            backend = filled_vocabulary(backend, vocab_size)
    else:
        raise TokenizerError(f"tokenizer.build.kind: unknown kind {kind!r} (use char or bpe)")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def filled_vocabulary(backend: Tokenizer, vocab_size: int) -> Tokenizer:
    """`backend` (a trained byte-level BPE) with tokens added to its vocabulary, without merges, until it has
    `vocab_size` ids: three-symbol strings of the byte-level alphabet, so they decode to bytes. No text
    encodes to them (no merge makes them), but the model's embedding and output layer have the full size
    and a sampler can draw them: a large-vocabulary shape (151,936 ids for Qwen2.5) on a small corpus,
    which could never train that many merges."""
    data = json.loads(backend.to_str())
    vocabulary = data["model"]["vocab"]
    taken = set(vocabulary) | {token["content"] for token in data["added_tokens"]}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    next_id = max([*vocabulary.values(), *(token["id"] for token in data["added_tokens"])]) + 1
    for first in alphabet:
        for second in alphabet:
            for third in alphabet:
                if next_id >= vocab_size:
                    return Tokenizer.from_str(json.dumps(data))
                token = first + second + third
                if token not in taken:
                    vocabulary[token] = next_id
                    next_id += 1
    return Tokenizer.from_str(json.dumps(data))


def load_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer from a local folder; hub names are refused offline with a clear message."""
    if not Path(path).is_dir():
        raise TokenizerError(
            f"tokenizer: {path!r} is not a local folder (AstrAI never downloads from a hub at run time)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"tokenizer: cannot load from {path!r}: {error}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif tokenizer.chat_template is None and has_chatml_markers(tokenizer):
        tokenizer.chat_template = CHATML_TEMPLATE
        if tokenizer.eos_token != "<|im_end|>":
            logger.warning("%s: ChatML template set (none of its own), but its EOS is %r", path, tokenizer.eos_token)
    if tokenizer.pad_token is None:
        # Right padding is always masked out of losses, so reusing EOS as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def set_pad_token(tokenizer: PreTrainedTokenizerBase, token: str | None) -> None:
    """`tokenizer.pad_token`: pad with this token, which must already be in the vocabulary (adding one would
    change the model's embedding size)."""
    if token is None:
        return
    if token not in tokenizer.get_vocab():
        raise TokenizerError(f"tokenizer.pad_token: {token!r} is not a token of the tokenizer's vocabulary")
    tokenizer.pad_token = token


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> None:
    """Write the tokenizer atomically for readers: into a staging folder, then swapped in by rename."""
    install_folder(Path(folder), tokenizer.save_pretrained)


def has_chatml_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `<|im_start|>` and `<|im_end|>` each encode to one known token (ChatML can render)."""
    for marker in CHATML_MARKERS:
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
            return False
    return True


def require_chat_template(tokenizer: PreTrainedTokenizerBase, source: str, train_type: str) -> None:
    """Fail before training when a train type that renders chats has no template to render them with."""
    if not tokenizer.chat_template:
        raise TokenizerError(
            f"tokenizer.chat_template: the tokenizer of {source} has no chat template and no ChatML markers "
            f"({', '.join(CHATML_MARKERS)} as single tokens), so {train_type} cannot render its chats; set "
            "tokenizer.chat_template to a Jinja template whose end-of-turn marker is the tokenizer's EOS"
        )


def _pipeline(tokenizer: PreTrainedTokenizerBase) -> dict | None:
    """The fast backend's tokenization rules (normalizer, pre-tokenizer, model incl. BPE merges); None if slow."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    document = json.loads(backend.to_str())
    return {key: document.get(key) for key in ("normalizer", "pre_tokenizer", "model")}


def tokenizer_difference(current: PreTrainedTokenizerBase, saved: PreTrainedTokenizerBase) -> str | None:
    """The first difference between two tokenizers that changes what token ids mean or how a chat
    renders (vocabulary, tokenization rules, special tokens, chat template); None when they agree."""
    current_vocab, saved_vocab = current.get_vocab(), saved.get_vocab()
    if current_vocab != saved_vocab:
        changed = sorted(set(current_vocab.items()) ^ set(saved_vocab.items()), key=lambda item: item[1])
        token = changed[0][0]
        return (
            f"vocabulary differs ({len(saved_vocab)} -> {len(current_vocab)} tokens; e.g. {token!r}: id "
            f"{saved_vocab.get(token)} -> {current_vocab.get(token)})"
        )
    if _pipeline(current) != _pipeline(saved):
        return "tokenization rules differ (normalizer, pre-tokenizer or merges)"
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(current, name) != getattr(saved, name):
            return f"{name} differs ({getattr(saved, name)!r} -> {getattr(current, name)!r})"
    if sorted(current.all_special_tokens) != sorted(saved.all_special_tokens):
        return f"special tokens differ ({sorted(saved.all_special_tokens)} -> {sorted(current.all_special_tokens)})"
    if current.chat_template != saved.chat_template:
        return "chat_template differs"
    return None


def check_saved_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path, context: str) -> bool:
    """Refuse `tokenizer` when it differs from the one saved in `folder` (its ids would mean other
    tokens there); False when `folder` holds none to compare with. `context` starts the message."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    difference = tokenizer_difference(tokenizer, load_tokenizer(str(folder)))
    if difference is not None:
        raise TokenizerError(f"{context}: this job's tokenizer differs from {folder}: {difference}")
    return True
