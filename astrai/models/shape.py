"""Sizes of the policy read from its config alone (`model.init` or `model.path`'s config.json): no weights."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig


def model_hidden_size(model_config) -> int | None:
    """The transformer's hidden size (the text model's, for a multimodal config; the largest of
    `hidden_sizes`), or None when the config cannot be read or names none (the job checks report why)."""
    try:
        if model_config.init is not None:
            settings = dict(model_config.init)
            settings.setdefault("vocab_size", 1 << 20)  # the tokenizer's size is not needed for the width
            config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        elif model_config.path is not None and Path(model_config.path, "config.json").is_file():
            config = AutoConfig.from_pretrained(str(model_config.path), local_files_only=True)
        else:
            return None
    except Exception:  # noqa: BLE001 - an unreadable config is check_model_config's to report, with its key
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "hidden_size", None) or max(getattr(text, "hidden_sizes", None) or [0]) or None
    return int(size) if isinstance(size, int) and size > 0 else None
