"""The critic of `online_ppo`: a causal LM's transformer trunk plus a scalar value head per token.

`ValueModel` is a plain `nn.Module` holding two parts; the policy's class is never modified:

    trunk       the causal LM's base model (`base_model`, e.g. `LlamaModel`): same architecture and,
                at a warm start, the same weights as the policy; its `lm_head` is dropped
    value_head  nn.Linear(hidden_size, 1) with weight and bias ZERO-initialised, so every value of the
                first rollout is exactly 0 (the first explained variance is exactly 0 too)

Warm start: the trunk comes from a causal LM built exactly as the policy is (`build_policy`:
`model.path` through `from_pretrained`, or `model.init` seeded with `train.seed`), so under ZeRO-3 it
loads partitioned like the policy and its hidden states equal the policy's at step 0 (tested).

A critic folder (what `python -m astrai export-hf CKPT OUT --part critic` writes and `critic.path` reads):

    config.json, model.safetensors (+ index)   the trunk: a transformers base model (`AutoModel.from_pretrained`)
    value_head.safetensors                     {"weight": [1, hidden_size], "bias": [1]}
    value_head.json                            {"format": "astrai-value-head", "version": 1, "hidden_size": H}
    tokenizer files                            the run's tokenizer

`critic.path` may also name any transformers model folder: a causal LM's trunk is loaded by `AutoModel`
and the head starts at zero; a reward model (a sequence classifier with one output, e.g. an `rm` export)
gives the trunk and the value head's weight (bias 0), as DeepSpeed-Chat and OpenRLHF start the critic
from the reward model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from astrai.models.activation_offload import offload_saved_activations

HEAD_WEIGHTS = "value_head.safetensors"
HEAD_INFO = "value_head.json"
HEAD_FORMAT = {"format": "astrai-value-head", "version": 1}


def trunk_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer trunk of a transformers causal LM (`model.model` for Llama), without its lm_head."""
    trunk = getattr(causal_lm, "base_model", causal_lm)
    if trunk is causal_lm:
        raise ValueError(
            f"{type(causal_lm).__name__} exposes no base model (base_model_prefix) to use as the critic's trunk"
        )
    return trunk


def hidden_size(config) -> int:
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not size:
        raise ValueError(f"cannot read the hidden size of a {type(config).__name__} for the value head")
    return int(size)


def trunk_states(trunk: nn.Module, input_ids, attention_mask=None, position_ids=None, cache=None, **keywords):
    """The trunk's last hidden states [batch, seq_len, hidden] for a scalar head (the critic's, the reward
    model's): with a cache the trunk extends it and attends to it (a shared prompt's keys and values), without
    one nothing is cached."""
    return trunk(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
        **keywords,
    ).last_hidden_state


class ValueModel(nn.Module):
    """trunk + zero-initialised value head. forward -> values [batch, seq_len] float32, one per position:
    the value of the state after reading the tokens up to and including that position."""

    def __init__(self, trunk: nn.Module):
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(hidden_size(trunk.config), 1)
        with torch.no_grad():
            for parameter in self.value_head.parameters():
                parameter.zero_()
                # Built partitioned (ZeRO-3 `model.zero3_init`, engine/zero3_init.py): the local tensor is empty
                # and this rank's slice lives in DeepSpeed's `ds_tensor`.
                if hasattr(parameter, "ds_tensor"):
                    parameter.ds_tensor.zero_()

    @property
    def config(self):
        return self.trunk.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        **attention_keywords,
    ) -> torch.Tensor:
        """input_ids, attention_mask, position_ids: [batch, seq_len]. Returns values [batch, seq_len] float32.
        attention_keywords: a packed row's boundaries for the trunk's attention (rl.packing, rollout/packed_scoring.py).
        cache: a transformers cache the trunk extends and attends to (rl.share_prefix, rollout/prefix_scoring.py);
        without one nothing is cached."""
        hidden = trunk_states(self.trunk, input_ids, attention_mask, position_ids, cache, **attention_keywords)
        return self.value_head(hidden).squeeze(-1).float()

    def tie_weights(self) -> None:
        self.trunk.tie_weights()

    def save_pretrained(self, folder: str | Path, max_shard_size: str | int = "5GB") -> None:
        """The critic folder layout of the module docstring (tokenizer files are the caller's)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        self.trunk.save_pretrained(folder, max_shard_size=max_shard_size)
        head = {
            "weight": self.value_head.weight.detach().contiguous(),
            "bias": self.value_head.bias.detach().contiguous(),
        }
        save_file(head, str(folder / HEAD_WEIGHTS))
        (folder / HEAD_INFO).write_text(
            json.dumps({**HEAD_FORMAT, "hidden_size": hidden_size(self.config)}, indent=1) + "\n"
        )


def load_value_model(folder: str | Path, **kwargs) -> ValueModel:
    """A critic from a local folder: its trunk via `AutoModel` (a causal LM's checkpoint loads too, its
    lm_head ignored), its value head from value_head.safetensors when present, else zero."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from astrai.models.policy import ModelError

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(
            f"critic.path: {str(folder)!r} is not a local folder (AstrAI never downloads from a hub at run time)"
        )
    reward_model = is_reward_model(folder)
    try:
        if reward_model:  # a scalar sequence classifier (an rm export): its head starts the value head
            from transformers import AutoModelForSequenceClassification

            from astrai.models.reward import classifier_head

            classifier = AutoModelForSequenceClassification.from_pretrained(
                str(folder), dtype=torch.float32, local_files_only=True, **kwargs
            )
            trunk, reward_head = classifier.base_model, classifier_head(classifier)
        else:
            trunk = AutoModel.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True, **kwargs)
    except (OSError, ValueError) as error:
        raise ModelError(f"critic.path: cannot load {str(folder)!r}: {error}") from None
    critic = ValueModel(trunk)
    if reward_model and not (folder / HEAD_WEIGHTS).is_file():
        bias = reward_head.bias if reward_head.bias is not None else torch.zeros(1)
        critic.value_head.load_state_dict({"weight": reward_head.weight.detach(), "bias": bias.detach()})
    if (folder / HEAD_WEIGHTS).is_file():
        head = load_file(str(folder / HEAD_WEIGHTS))
        try:
            critic.value_head.load_state_dict(head)
        except RuntimeError as error:
            raise ModelError(f"critic.path: {folder / HEAD_WEIGHTS} does not fit the trunk: {error}") from None
    return critic


def is_reward_model(folder: Path) -> bool:
    """Whether `folder` holds a transformers sequence classifier with one output (a reward model)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") or []
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels")
    return any(name.endswith("ForSequenceClassification") for name in architectures) and labels == 1


def build_value_model(model_config, tokenizer, seed: int, critic_path: str | None = None) -> ValueModel:
    """The critic: from `critic_path`, else warm-started from the policy's own source (see the module docstring)."""
    from astrai.models.policy import (
        ModelError,
        attention_implementation,
        build_policy,
        disable_dropout,
        embedding_rows,
        logger,
    )

    if critic_path is None:
        return ValueModel(trunk_of(build_policy(model_config, tokenizer, seed)))
    attention = attention_implementation(model_config.attn_implementation)
    critic = load_value_model(critic_path, **({"attn_implementation": attention} if attention else {}))
    embeddings = embedding_rows(critic.trunk)
    if len(tokenizer) > embeddings:
        raise ModelError(
            f"critic.path: tokenizer has {len(tokenizer)} tokens but the critic's embedding has {embeddings}"
        )
    if model_config.disable_dropout:  # a warm-started critic's trunk had it done by build_policy
        changed = disable_dropout(critic)
        logger.info("model.disable_dropout: %d dropout probabilities of the critic (%s) set to 0", changed, critic_path)
    if model_config.gradient_checkpointing:
        critic.trunk.gradient_checkpointing_enable()
        if model_config.gradient_checkpointing == "offload":
            offload_saved_activations(critic.trunk)
    return critic
