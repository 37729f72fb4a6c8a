"""The reward model `rm` trains: a causal LM's trunk plus a scalar head read at the last non-pad token.

    trunk   the causal LM's base model, as online_ppo's critic takes it (`value.trunk_of`): the policy's
            architecture and starting weights (`model.path` / `model.init`), its lm_head dropped
    score   nn.Linear(hidden_size, 1, bias=False), zero-initialised (every first reward is exactly 0)

The score is read where transformers' `*ForSequenceClassification` reads it: at the last position whose
token is not `pad_token_id` (right padding). That is why `rm` needs a pad token, and why the export is a
plain `AutoModelForSequenceClassification` (num_labels 1, the same `pad_token_id`) that scores exactly
as training did: the trunk's weights go under the classifier's base model, `score` becomes its head
(no bias, as transformers' heads of Llama, Qwen2, Mistral, GPT-2 ...).

Export folder (`export-hf` of an rm checkpoint), beside the classifier's config, weights and tokenizer:

    reward_stats.json   {"format": "astrai-reward-stats", "version": 1, "mean": m, "std": s, "pairs": n,
                         "source": ...}: the reward's mean and std over the training pairs (chosen and
                         rejected), read by `reward.normalize: stored`
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from astrai.models.value import hidden_size, trunk_states

STATS_FILE = "reward_stats.json"
STATS_FORMAT = {"format": "astrai-reward-stats", "version": 1}


def last_non_pad_positions(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """[batch] index of each row's last token that is not `pad_token_id` (0 for an all-pad row): the rule of
    transformers' sequence classifiers, so that training and the exported classifier read the same token."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id).int()).argmax(-1)


class RewardModel(nn.Module):
    """trunk + zero-initialised bias-free scalar head. forward -> rewards [batch] float32."""

    def __init__(self, trunk: nn.Module, pad_token_id: int):
        super().__init__()
        self.trunk = trunk
        self.score = nn.Linear(hidden_size(trunk.config), 1, bias=False)
        nn.init.zeros_(self.score.weight)
        self.pad_token_id = int(pad_token_id)

    @property
    def config(self):
        return self.trunk.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        every_position: bool = False,
    ) -> torch.Tensor:
        """input_ids, attention_mask, position_ids: [batch, seq_len], the response right-padded (the prompt may be
        left-padded, with position_ids). Returns rewards [batch] float32.
        cache: a transformers cache holding the prompt's keys and values (`rm.share_prefix`,
        rollout/prefix_scoring.py); input_ids are then the response's columns, attention_mask covers both.
        every_position: the head's score at every position [batch, seq_len] instead (a sequence-parallel cut holds
        no whole sequence: the caller gathers the cuts and reads each sequence's last token itself)."""
        hidden = trunk_states(self.trunk, input_ids, attention_mask, position_ids, cache)
        if every_position:
            return self.score(hidden).squeeze(-1).float()
        last = last_non_pad_positions(input_ids, self.pad_token_id)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.score(hidden[rows, last]).squeeze(-1).float()

    def tie_weights(self) -> None:
        self.trunk.tie_weights()


def reward_model_of(causal_lm: nn.Module, tokenizer) -> RewardModel:
    """The module `rm` trains: `causal_lm`'s trunk (as online_ppo's critic takes it) under a zero scalar head."""
    from astrai.models.value import trunk_of

    return RewardModel(trunk_of(causal_lm), tokenizer.pad_token_id)


def classifier_head(classifier: nn.Module) -> nn.Linear:
    """The one scalar Linear of a transformers sequence classifier outside its base model (`score` for
    Llama/Qwen2/GPT-2, ...); a ValueError when there is not exactly one."""
    prefix = classifier.base_model_prefix
    heads = [
        module
        for name, child in classifier.named_children()
        if name != prefix
        for module in child.modules()
        if isinstance(module, nn.Linear) and module.out_features == 1
    ]
    if len(heads) != 1:
        raise ValueError(f"{type(classifier).__name__}: expected one scalar output layer, found {len(heads)}")
    return heads[0]


def to_sequence_classifier(reward_model: RewardModel, dtype: torch.dtype):
    """The transformers `AutoModelForSequenceClassification` (num_labels 1, pad_token_id set) holding
    `reward_model`'s weights (shared, not copied); built on the meta device, then filled."""
    from transformers import AutoModelForSequenceClassification

    config = reward_model.config.__class__.from_dict(reward_model.config.to_dict())
    config.num_labels = 1
    config.pad_token_id = reward_model.pad_token_id
    config.problem_type = "regression"  # one continuous output: transformers' loss with labels would be MSE
    config.use_cache = True
    config.architectures = None  # save_pretrained writes the classifier's own class name
    with torch.device("meta"):
        classifier = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    trunk_state = reward_model.trunk.state_dict()
    classifier.base_model.load_state_dict(trunk_state, strict=True, assign=True)
    head = classifier_head(classifier)
    if head.bias is not None:
        raise ValueError(f"{type(classifier).__name__}'s head has a bias; the rm head has none")
    head.weight = nn.Parameter(reward_model.score.weight.detach().to(dtype).clone())
    classifier.config.dtype = dtype
    classifier.tie_weights()
    return classifier.eval()


def reward_stats_text(mean: float, std: float, pairs: int, source: str) -> str:
    """The content of reward_stats.json."""
    return json.dumps({**STATS_FORMAT, "mean": mean, "std": std, "pairs": pairs, "source": source}, indent=1) + "\n"


def read_reward_stats(folder: str | Path) -> tuple[float, float]:
    """(mean, std) of an rm export's `reward_stats.json`; ValueError naming the file when absent or malformed."""
    path = Path(folder) / STATS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist (written by `export-hf` of an rm checkpoint)")
    try:
        stats = json.loads(path.read_text())
        mean, std = float(stats["mean"]), float(stats["std"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not an astrai-reward-stats file ({type(error).__name__}: {error})") from None
    if stats.get("format") != STATS_FORMAT["format"] or not math.isfinite(mean) or not (math.isfinite(std) and std > 0):
        raise ValueError(f"{path}: needs format {STATS_FORMAT['format']!r}, a finite mean and a finite std > 0")
    return mean, std
