"""A folder for the one-rank `dpo` tests: the first shipped preference pairs and tiny Llama models
that share one char tokenizer built from them, saved as an export writes them."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.models.tokenizer import build_tokenizer
from tests.conftest import REPO
from tests.unit.rollout_fixtures import LLAMA_SHAPE


def preference_folder(folder: Path, pairs: int, models: dict[str, int]) -> Path:
    """pairs.jsonl (the first `pairs` of data/arithmetic/preference.jsonl) and one model folder per
    name in `models`, each initialised from its seed."""
    lines = (REPO / "data/arithmetic/preference.jsonl").read_text().splitlines(keepends=True)[:pairs]
    (folder / "pairs.jsonl").write_text("".join(lines))
    tokenizer = build_tokenizer("char", ["".join(lines)])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **LLAMA_SHAPE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    for name, seed in models.items():
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder
