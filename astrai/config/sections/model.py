"""The `model` section: the policy's source, precision and build options, and its LoRA adapter."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from astrai.config.sections.base import Section


class LoraSection(Section):
    """A LoRA adapter through PEFT (docs/guides/lora.md): the model's own weights stay frozen, only the
    adapter (and `modules_to_save`) trains, is in the optimizer and in checkpoints."""

    r: int = Field(16, ge=1, description="Rank of the adapter's low-rank update.")
    alpha: float = Field(
        32,
        gt=0,
        description="LoRA scaling numerator: the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora).",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input (applied even with model.disable_dropout)."
    )
    target_modules: list[str] | None = Field(
        None,
        description="Names (or name suffixes, as PEFT matches them) of the linear modules to adapt. null: every linear "
        "layer inside the decoder blocks (not the lm_head), derived from the model. Names matching nothing are refused "
        "before training, listing the model's linear modules; so is an empty list (give null for the default).",
    )
    modules_to_save: list[str] | None = Field(
        None,
        description="Modules trained fully beside the adapter and saved with it (e.g. `lm_head`, `embed_tokens`); "
        "names (or name suffixes) matching no module of the model are refused before training.",
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    use_dora: bool = Field(False, description="DoRA: weight-decomposed LoRA (a trained magnitude per output).")
    init: Literal["default", "gaussian"] | bool = Field(
        "default",
        description="Adapter initialisation (PEFT's `init_lora_weights`): `default`/true: Kaiming A, B = 0, so the "
        "adapted model starts as the base; `gaussian`: Gaussian A, B = 0; false: random B (the start differs from the "
        "base: for tests). Initialisations that rewrite the base weights (PiSSA, OLoRA) are not offered: the base must "
        "stay the reference and what the checkpoint's base-model hash names.",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_target_modules(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:  # was read as null (every linear layer): say which is meant
            raise ValueError(
                "an empty list adapts no module: name the modules (e.g. [q_proj, v_proj]), or leave the key out "
                "(null) for every linear layer inside the decoder blocks"
            )
        return value


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local folder of a transformers causal LM (config + weights). Exclusive with `init`."
    )
    init: dict[str, Any] | None = Field(
        None,
        description="Architecture block for a freshly initialised model: `model_type` plus any config field of that "
        "transformers architecture (e.g. hidden_size, num_hidden_layers). `vocab_size` defaults to the tokenizer's.",
    )
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Training precision. `auto`: bf16 on GPUs that support it, fp32 on CPU."
    )
    attn_implementation: str | None = Field(
        None,
        description="Attention kernel handed to transformers (`sdpa`, `eager`, `flash_attention_2`). Env ASTR_BACKEND "
        "overrides. A name this transformers does not offer, whose package is not installed, or that the model does "
        "not support is refused before training.",
    )
    gradient_checkpointing: bool | Literal["offload"] = Field(
        False,
        description="Recompute activations in backward to save memory. `offload`: also keep what the checkpointed "
        "forward saves for backward (mostly each layer's input) in host memory, pinned on a GPU (ALST's checkpoint "
        "offload, for long sequences).",
    )
    zero3_init: bool = Field(
        True,
        description="Under ZeRO-3, load `model.path` weights partitioned (never a full copy per rank). A `model.init` "
        "policy, and the reference and critic built from it, are built partitioned too, module by module, with "
        "exactly the whole build's initial weights for `train.seed` (a LoRA base of `model.init` is built whole; on a "
        "GPU a `model.init` model is still built whole until that path is checked there).",
    )
    reference_path: str | None = Field(
        None, description="Frozen reference model for `dpo`/RL (default: the policy's starting weights)."
    )
    init_from_checkpoint: str | None = Field(
        None,
        description="Start a new run from the policy weights of an AstrAI checkpoint (a `step_<N>` folder, or an "
        "output_dir: its newest), e.g. `grpo` after `sft`. Only the weights: optimizer, LR schedule, step and data "
        "position start fresh. `model.init`/`model.path` still give the architecture; the tokenizer must match the "
        "checkpoint's. A checkpoint of this run's own output_dir is resumed as usual instead.",
    )
    disable_dropout: bool = Field(
        True,
        description="Set every dropout probability of the policy, critic and reference to 0 when they are built "
        "(modules, attention floats, config fields; logged), so that the loss forwards are deterministic: "
        "ratio 1 and KL 0 at the first RL step, DPO rewards 0 at step 0. An export keeps the model's own values.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Mixture-of-experts policies (Qwen2-MoE, Mixtral): weight of the router's load-balancing loss "
        "added to every train type's loss (metric `router_aux_loss`). null: the model config's own "
        "`router_aux_loss_coef`; 0: off. A model without a router takes null or 0 only.",
    )
    lora: LoraSection | None = Field(
        None,
        description="Train a LoRA adapter instead of every weight (r, alpha, dropout, target_modules, modules_to_save, "
        "use_rslora, use_dora, init); null: full fine-tuning. The dpo/grpo/online_ppo reference is then the same "
        "model with its adapter disabled (no second model), unless model.reference_path names one.",
    )

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, value):
        if isinstance(value, bool) or value == "offload":
            return value
        raise ValueError(f"{value!r}: use true, false or offload")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.init is None):
            raise ValueError(
                "give exactly one of `model.path` (a local model folder) or `model.init` (an architecture block)"
            )
        if self.init is not None and "model_type" not in self.init:
            raise ValueError("`model.init` needs a `model_type` (e.g. llama, qwen2, gpt2)")
        return self
