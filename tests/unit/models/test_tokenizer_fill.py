"""`tokenizer.build.fill_vocab`: a byte-level BPE filled to exactly `vocab_size` ids, encoding text as the
unfilled one does, with the extra ids decodable and deterministic."""

from __future__ import annotations

from astrai.models.tokenizer import build_tokenizer

TEXTS = ["12+7=19", "30-4=26", "what is 5 times 6?", "the answer is 30"] * 5


def test_filled_bpe_has_the_size_and_encodes_as_the_trained_one():
    trained = build_tokenizer("bpe", TEXTS, 1000)
    filled = build_tokenizer("bpe", TEXTS, 1000, fill_vocab=True)
    assert len(trained) < 1000 and len(filled) == 1000
    for text in ("12+7=19", "answer 99 <|im_end|>"):
        assert filled(text)["input_ids"] == trained(text)["input_ids"]
    assert isinstance(filled.decode([999]), str) and filled.decode([999])  # an extra id decodes to its bytes
    again = build_tokenizer("bpe", TEXTS, 1000, fill_vocab=True)
    assert again.get_vocab() == filled.get_vocab()  # a rebuild (every start and resume) gives the same one


def test_char_tokenizers_ignore_fill_vocab():
    assert len(build_tokenizer("char", TEXTS, 1000, fill_vocab=True)) == len(build_tokenizer("char", TEXTS))
