"""`model.init_from_checkpoint`: a new run starts from the policy weights of another run's checkpoint.

Only the weights travel (the checkpoint's consolidated fp32 tensors, read as the HF export reads
them): the optimizer, its moments, the LR schedule, the step and the data position start fresh. A
resume of the same job is `checkpoint.resume`, not this.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from astrai.models.policy import ModelError
from astrai.models.tokenizer import TOKENIZER_DIR, check_saved_tokenizer

logger = logging.getLogger("astrai.models")


def resolve_init_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: itself, or the newest one of an output_dir or checkpoints folder."""
    from astrai.export import ExportError, resolve_checkpoint

    try:
        return resolve_checkpoint(path)
    except ExportError as error:
        raise ModelError(f"model.init_from_checkpoint: {error}") from None


def load_checkpoint_weights(model: torch.nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Copy the checkpoint's policy weights into `model` (built, not yet in an engine); returns the
    checkpoint. Names and shapes must match the model's exactly (tied aliases aside). `tokenizer`:
    the job's, refused when it differs from the one the checkpoint saved (its ids would mean other
    tokens)."""
    from astrai.export import ExportError, part_weights, prepare_state, tied_aliases

    checkpoint = resolve_init_checkpoint(path)
    folder = checkpoint / "policy"
    if not folder.is_dir():
        raise ModelError(f"model.init_from_checkpoint: {checkpoint} has no policy/ folder")
    if tokenizer is not None:
        check_saved_tokenizer(tokenizer, checkpoint / TOKENIZER_DIR, "model.init_from_checkpoint")
    try:
        state = prepare_state(part_weights(folder), model, torch.float32)
    except ExportError as error:
        raise ModelError(f"model.init_from_checkpoint: {checkpoint}: {error}") from None
    result = model.load_state_dict(state, strict=False)  # copies into the model's tensors: ties stay tied
    missing = [name for name in result.missing_keys if name not in tied_aliases(model)]
    if missing or result.unexpected_keys:
        unexpected = result.unexpected_keys[:5]
        raise ModelError(f"model.init_from_checkpoint: not loaded: missing {missing[:5]}, unexpected {unexpected}")
    return checkpoint
