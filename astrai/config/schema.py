"""Typed schema of the job YAML: the job, composed of its sections, and the rules that span sections.

Every field is documented once, in its `description`, in the module of its section (astrai/config/sections/);
`docs/guides/config.md` lists every key and a test keeps the two in step. Unknown keys are errors
(`extra="forbid"`) so a typo never silently falls back to a default. Every section class is re-exported here:
`from astrai.config.schema import RlConfig` is the import path for the rest of the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from astrai.config.sections.base import Section
from astrai.config.sections.checkpoint import CheckpointConfig, KeepBest
from astrai.config.sections.critic import CriticConfig
from astrai.config.sections.data import DataConfig, TokenizerBuild, TokenizerConfig
from astrai.config.sections.deepspeed import DeepSpeedSection
from astrai.config.sections.dpo import DpoConfig
from astrai.config.sections.eval import EvalConfig
from astrai.config.sections.export import ExportConfig
from astrai.config.sections.infra import InfraConfig, NodeConfig
from astrai.config.sections.model import LoraSection, ModelConfig
from astrai.config.sections.parallel import ParallelConfig
from astrai.config.sections.reward import RewardComponent, RewardConfig
from astrai.config.sections.rl import OverlongPenalty, RlConfig
from astrai.config.sections.rm import RmConfig
from astrai.config.sections.rollout import RolloutConfig
from astrai.config.sections.runtime import LOG_LEVELS, RuntimeConfig, known_log_level
from astrai.config.sections.train import TrainConfig
from astrai.train_types import train_type_rules, users_of

__all__ = [
    "LOG_LEVELS",
    "CheckpointConfig",
    "CriticConfig",
    "DataConfig",
    "DeepSpeedSection",
    "DpoConfig",
    "EvalConfig",
    "ExportConfig",
    "InfraConfig",
    "JobConfig",
    "KeepBest",
    "LoraSection",
    "ModelConfig",
    "NodeConfig",
    "OverlongPenalty",
    "ParallelConfig",
    "RewardComponent",
    "RewardConfig",
    "RlConfig",
    "RmConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "Section",
    "TokenizerBuild",
    "TokenizerConfig",
    "TrainConfig",
    "known_log_level",
]


class JobConfig(Section):
    output_dir: str = Field(
        ..., description="Everything the run writes: checkpoints, metrics.jsonl, job.yaml, tokenizer, caches."
    )
    model: ModelConfig = Field(..., description="The policy: a local transformers causal LM or an architecture block.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Where the tokenizer comes from.")
    data: DataConfig = Field(
        ..., description="Training data (local files through `datasets`) and how rows become tokens."
    )
    train: TrainConfig = Field(..., description="The train type and its optimisation hyperparameters.")
    deepspeed: DeepSpeedSection = Field(
        default_factory=DeepSpeedSection, description="DeepSpeed: a template from `ds_configs/` plus job overrides."
    )
    eval: EvalConfig | None = Field(
        None, description="Held-out evaluation during training: data, cadence, online pass@k (null: none)."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Crash-safe checkpoints: cadence, retention, resume, verification.",
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="Sequence parallelism (DeepSpeed Ulysses) for long sequences: ranks per sequence, tiled MLP.",
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig, description="Per-job process settings: environment, timeouts, logging."
    )
    infra: InfraConfig = Field(
        default_factory=InfraConfig,
        description="Host side, never read by the training loop: the container keys are the docker wrappers' "
        "(scripts/train.sh, serve.sh), which check them on the host; the node keys are `python -m astrai launch`'s "
        "and the preflight's.",
    )
    export: ExportConfig = Field(default_factory=ExportConfig, description="Hugging Face export of the final policy.")
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="Preference optimisation (`train_type: dpo`).")
    serve: dict[str, Any] | None = Field(
        None,
        description="Serving an export with an OpenAI-compatible engine (`scripts/serve.sh`): model_dir, image, port, "
        "served_model_name, extra_args (docs/developer/docker-training.md). Read and checked on the host by the "
        "docker wrappers; the trainer accepts the section as given.",
    )
    rm: RmConfig = Field(default_factory=RmConfig, description="Reward-model training (`train_type: rm`).")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="Sampling of the online train types (`grpo`, `online_ppo`): prompts per step, group size, sampler.",
    )
    rl: RlConfig = Field(
        default_factory=RlConfig,
        description="Policy optimisation of the online train types: replay epochs, minibatches, clipping, KL, "
        "advantages.",
    )
    reward: RewardConfig | None = Field(
        None,
        description="Reward of the online train types: a function, a reward model, an HTTP service, or weighted "
        "components.",
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description="The value model of `online_ppo`: starting weights, optimizer, clipping, ZeRO stage, warmup.",
    )

    @model_validator(mode="after")
    def _packing_train_types(self) -> JobConfig:
        rules = train_type_rules(self.train.train_type)
        train_type = rules.name
        if self.data.packing and "data.packing" not in rules.options:
            raise ValueError(
                f"`data.packing` is for {users_of('data.packing')}, not {train_type}{rules.data_packing_hint}"
            )
        if self.data.document_mask and "data.document_mask" not in rules.options:
            raise ValueError(f"`data.document_mask` is for {users_of('data.document_mask')}, not {train_type}")
        if self.parallel.sequence_parallel_size > 1:
            self._check_sequence_parallel(rules)
        if self.rl.packing and "rl.packing" not in rules.options:
            raise ValueError(f"`rl.packing` is for {users_of('rl.packing')}, not {train_type} (use `data.packing`)")
        if self.rl.share_prefix:
            self._check_share_prefix()
        if self.rm.share_prefix:
            if "rm.share_prefix" not in rules.options:
                raise ValueError(
                    f"`rm.share_prefix` is for {users_of('rm.share_prefix')}, not {train_type} "
                    f"({users_of('rl.share_prefix')}: `rl.share_prefix`)"
                )
            self._refuse_checkpointing_with("rm.share_prefix")
        return self

    def _check_sequence_parallel(self, rules) -> None:
        """Ulysses: the train types whose forwards are cut along the sequence, with the options it can join."""
        size = self.parallel.sequence_parallel_size
        key = f"`parallel.sequence_parallel_size: {size}`"
        if "parallel.sequence_parallel_size" not in rules.options:
            raise ValueError(
                f"{key} is for {users_of('parallel.sequence_parallel_size')} in this version, not {rules.name}"
            )
        for other, value in (
            ("data.packing", self.data.packing and rules.online),
            ("rl.packing", self.rl.packing),
            ("rl.share_prefix", self.rl.share_prefix),
            ("rm.share_prefix", self.rm.share_prefix),
            ("rl.dynamic_sampling", self.rl.dynamic_sampling),
        ):
            if value:  # the sequence shards pack every micro-batch themselves; dynamic rounds are per rank
                raise ValueError(
                    f"{key} with `{other}`: use one of them (sequence parallelism packs every micro-batch "
                    "into one row itself)"
                    if other != "rl.dynamic_sampling"
                    else f"{key} with `rl.dynamic_sampling` is not available in this version"
                )
        if self.model.attn_implementation in ("eager", "paged|eager"):
            raise ValueError(
                f"{key} with `model.attn_implementation: {self.model.attn_implementation}`: Ulysses needs an attention "
                "that takes no materialised [T, T] mask (sdpa, flash_attention_2)"
            )

    def _check_share_prefix(self) -> None:
        """rl.share_prefix: the online train types only; not with the packed forward nor with checkpointed layers."""
        rules = train_type_rules(self.train.train_type)
        if "rl.share_prefix" not in rules.options:
            raise ValueError(f"`rl.share_prefix` is for {users_of('rl.share_prefix')}, not {rules.name}")
        if self.rl.packing:
            raise ValueError(
                "`rl.share_prefix` with `rl.packing`: use one of them (each makes the scoring forward its own way)"
            )
        if self.rollout.group_size < 2:
            raise ValueError(
                f"`rl.share_prefix` with `rollout.group_size: {self.rollout.group_size}`: each prompt has one "
                "response, so there is no prompt to share (it would only add a forward); set it false or sample a group"
            )
        self._refuse_checkpointing_with("rl.share_prefix")

    def _refuse_checkpointing_with(self, key: str) -> None:
        """A shared prompt's keys and values live in a cache that checkpointed layers do not keep."""
        if self.model.gradient_checkpointing:
            raise ValueError(
                f"`{key}` with `model.gradient_checkpointing`: use one of them (checkpointed layers drop "
                "the prompt's keys and values)"
            )

    @model_validator(mode="after")
    def _online_sections(self) -> JobConfig:
        rules = train_type_rules(self.train.train_type)
        if not rules.online:
            return self
        if self.reward is None:
            raise ValueError(
                f"`train.train_type: {self.train.train_type}` needs a `reward` section (function, model_path, url or "
                "components)"
            )
        if self.train.max_steps is None:
            raise ValueError("online train types count steps in rollouts: give `train.max_steps` (not `train.epochs`)")
        rules.check_sections(self)  # grpo's groups, online_ppo's critic warmup
        return self

    @field_validator("output_dir")
    @classmethod
    def _named_folder(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a folder (an empty output_dir would write into the current directory)")
        return value

    @model_validator(mode="after")
    def _rl_combinations(self) -> JobConfig:
        """RL options that cannot work together, named before any rank starts (docs/guides/rl.md)."""
        rules = train_type_rules(self.train.train_type)
        if rules.online:
            rules.check_rl_options(self)
        return self

    @model_validator(mode="after")
    def _export_destination(self) -> JobConfig:
        if not self.export.hf_dir:
            self.export.hf_dir = str(Path(self.output_dir) / "hf")
        return self

    @model_validator(mode="after")
    def _tokenizer_source(self) -> JobConfig:
        if self.tokenizer.path is None and self.tokenizer.build is None and self.model.path is None:
            raise ValueError("a model built from `model.init` needs `tokenizer.path` or `tokenizer.build`")
        return self
