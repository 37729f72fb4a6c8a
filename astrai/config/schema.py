"""Typed schema of the job YAML.

Every field is documented once, here, in its `description`; `docs/guides/config.md` lists every
key and a test keeps the two in step. Unknown keys are errors (`extra="forbid"`) so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from astrai.train_types import train_type_rules, users_of

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENVIRONMENT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # what a shell (and every launcher's env file) accepts


class Section(BaseModel):
    # No key of a job means anything with .inf or .nan: a non-finite lr or timeout is a typo, refused here.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


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
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
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

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.init is None):
            raise ValueError(
                "give exactly one of `model.path` (a local model folder) or `model.init` (an architecture block)"
            )
        if self.init is not None and "model_type" not in self.init:
            raise ValueError("`model.init` needs a `model_type` (e.g. llama, qwen2, gpt2)")
        return self


class TokenizerBuild(Section):
    kind: Literal["char", "bpe"] = Field(
        "char",
        description="`char`: one token per character seen in the data; `bpe`: byte-level BPE trained on the data.",
    )
    vocab_size: int = Field(512, ge=16, description="Target vocabulary size for `bpe` (ignored by `char`).")
    fill_vocab: bool = Field(
        False,
        description="`bpe` only: when the data trains fewer than `vocab_size` tokens, fill the rest with tokens no "
        "text encodes to, so the tokenizer (and the model's embedding and output layer) has exactly `vocab_size` ids: "
        "a large-vocabulary shape on a small corpus (configs/scale_0p5b.yaml).",
    )


class TokenizerConfig(Section):
    path: str | None = Field(
        None, description="Local tokenizer folder (default: `model.path`). Hub names fail offline with a clear error."
    )
    build: TokenizerBuild | None = Field(
        None, description="Build a tokenizer from the training data instead of loading one (small runs)."
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template to set on the tokenizer (default: the tokenizer's own, else ChatML when the "
        "tokenizer has `<|im_start|>`/`<|im_end|>` as single tokens; otherwise a train type that renders chats fails "
        "before training).",
    )
    pad_token: str | None = Field(
        None,
        description="A token of the vocabulary to pad with (default: the tokenizer's own, else its EOS). `rm` needs "
        "one that is not the EOS, as its reward head reads the last non-pad token.",
    )


class DataConfig(Section):
    path: str = Field(..., description="Training data: a local file, folder or glob of json/jsonl/parquet/arrow files.")
    format: Literal["auto", "json", "parquet", "arrow"] = Field(
        "auto", description="File format; `auto` reads it from the extension."
    )
    text_field: str = Field("text", description="Field with raw text (`seq`).")
    messages_field: str = Field(
        "messages", description="Field with a chat `[{role, content}]` list (`sft`, `dpo`, RL prompts)."
    )
    prompt_field: str = Field("prompt", description="Field with a prompt string, used when there is no messages field.")
    response_field: str = Field(
        "response", description="Field with the response string (`sft` with prompt/response rows)."
    )
    chosen_field: str = Field("chosen", description="Preferred response (`dpo`).")
    rejected_field: str = Field("rejected", description="Dispreferred response (`dpo`).")
    max_seq_len: int = Field(512, ge=8, description="Block length for `seq` packing; longer `sft` rows are truncated.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="Malformed row: stop with file and row named, or skip and count it in the log."
    )
    num_proc: int = Field(1, ge=1, description="Processes for tokenisation (`datasets.map`).")
    shuffle: bool = Field(True, description="Shuffle each epoch (deterministic for `train.seed` and the epoch).")
    packing: bool = Field(
        False,
        description="`sft`, `dpo`: padding-free micro-batches. Rows (a dpo pair as one) are concatenated into one row "
        "of up to `train.micro_batch_tokens` tokens, positions restart at every row and attention never crosses "
        "one; the sampler balances tokens across ranks (docs/guides/training.md, Packing).",
    )
    document_mask: bool = Field(
        False,
        description="`seq`: documents inside a packed block stop attending to each other (positions restart after "
        "every EOS; a document's first token is not predicted from the one before). false: they attend across.",
    )


class TrainConfig(Section):
    train_type: Literal["seq", "sft", "dpo", "grpo", "online_ppo", "rm"] = Field(
        ..., description="What to train: see the table of train types."
    )
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to run (exclusive with `epochs`).")
    epochs: float | None = Field(None, gt=0, description="Passes over the data; converted to steps from the data size.")
    micro_batch_size: int = Field(1, ge=1, description="Samples per rank per forward/backward.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    micro_batch_tokens: int = Field(
        4096,
        ge=8,
        description="With `data.packing`: the token budget of one packed micro-batch (replaces micro_batch_size); "
        "every row must fit in it (a dpo pair: chosen + rejected). With `rl.packing`: each optimizer step's "
        "sequences (micro_batch_size x grad_accum_steps per rank) are cut into micro-batches of up to this many "
        "prompt + response tokens, every sequence whole, as many on every rank; data.max_seq_len + "
        "rollout.max_new_tokens must fit in it.",
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of `lr`.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int | None = Field(
        None,
        ge=0,
        description="Linear warmup steps (exclusive with `warmup_ratio`). Online types count steps in rollouts, as "
        "`max_steps`. A warmup longer than the run is warned about, once: the learning rate never reaches `lr`.",
    )
    warmup_ratio: float | None = Field(None, ge=0, le=1, description="Warmup as a fraction of the total steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (not applied to biases and norms).")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this (null: no clipping)."
    )
    seed: int = Field(
        42,
        description="Seeds Python, numpy and torch on every rank before anything is built (model init, dropout, "
        "sampling), and the data order: a rerun of the job repeats its losses exactly.",
    )
    log_every_steps: int = Field(1, ge=1, description="Write a metrics record every N optimizer steps.")
    logits_chunk_size: int = Field(
        512,
        ge=0,
        description="Token log-probs, entropy and the cross-entropy are computed from the final hidden states this "
        "many positions at a time, so the full [batch, seq_len, vocab] logits never exist (their backward recomputes "
        "each chunk's logits: one more output-layer matmul). Used when a micro-batch has more positions than one "
        "chunk; 0 = off. Models that change their logits after the output layer (Gemma 2 softcapping) take the full "
        "path (docs/guides/memory.md).",
    )
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        "stop",
        description="A non-finite loss or gradient norm on any rank (decided on all ranks together): `stop` "
        "ends the run with exit 1 before the step's update and before any checkpoint of it (the last good checkpoint "
        "stays newest); `skip_step` "
        "discards that optimizer step's gradients, applies no update and counts it in the metric `skipped_steps`.",
    )

    @model_validator(mode="after")
    def _length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of `train.max_steps` or `train.epochs`")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("give at most one of `train.warmup_steps` or `train.warmup_ratio`")
        return self


class DeepSpeedSection(Section):
    config: str | None = Field(
        None, description="Template JSON (e.g. `ds_configs/zero3.json`), relative to the repo or the job file."
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(None, description="ZeRO stage; overrides the template's.")
    offload_optimizer: Literal["none", "cpu", "nvme"] | None = Field(
        None, description="Optimizer state offload; overrides the template."
    )
    offload_param: Literal["none", "cpu", "nvme"] | None = Field(
        None, description="Parameter offload (ZeRO-3); overrides the template."
    )
    optimizer: Literal["auto", "torch", "fused", "cpu_adam"] = Field(
        "auto",
        description="AdamW implementation: `auto` = fused on CUDA, torch on CPU, DeepSpeedCPUAdam with optimizer "
        "offload.",
    )
    single_rank_stage0: bool = Field(
        True,
        description="On one rank, run ZeRO-1/2 (without offload) as ZeRO-0: they partition nothing there and only "
        "cost time.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Raw DeepSpeed config keys merged last (deep merge)."
    )


class KeepBest(Section):
    """The checkpoint to keep beside the newest `keep_last`: the best one by an eval metric."""

    metric: str = Field(
        ...,
        description="An eval metric the job's eval produces, e.g. `eval/loss` (the `eval/` prefix may be left out); "
        "checked before training.",
    )
    mode: Literal["min", "max"] = Field(..., description="`min`: lower is better (a loss); `max`: higher (accuracy).")

    @field_validator("metric")
    @classmethod
    def _prefixed(cls, value: str) -> str:
        return value if value.startswith("eval/") else f"eval/{value}"


class CheckpointConfig(Section):
    every_steps: int | None = Field(
        None, ge=1, description="Publish a checkpoint every N optimizer steps (always at the end of a run)."
    )
    keep_last: int | None = Field(
        None,
        ge=1,
        description="Keep the newest K checkpoints; older ones are removed only after a newer one is published.",
    )
    resume: str = Field(
        "auto", description="`auto`: newest valid checkpoint in output_dir; `never`: start fresh; or a checkpoint path."
    )
    verify_on_load: bool = Field(
        True,
        description="Check every file a resume loads against the manifest's digest (shards hashed as they load, "
        "the rest before); a mismatch falls back to the previous checkpoint. `false`: sizes only.",
    )
    keep_best: KeepBest | None = Field(
        None,
        description="Keep the best checkpoint by an eval metric beside the newest `keep_last` (retention never deletes "
        "it); each checkpoint's manifest records the eval figures of its step; `export-hf --best` exports it.",
    )
    hash: Literal["sha256", "blake2b", "xxh3_128"] = Field(
        "sha256",
        description="File digest recorded in the manifest: sha256 (~1.1 GB/s a core, cryptographic; files hash in "
        "parallel threads and across ranks), or xxh3_128 (~10 GB/s a core) where hashing would show in save time.",
    )
    save_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A save that cannot finish on every rank within this fails with the stalled phase named.",
    )
    async_save: bool = Field(
        False,
        description="Training goes on while a save is hashed, fsynced and published in a background thread (it blocks "
        "only while the shards are written); the next save, and the run's end, wait for it and fail on its error. The "
        "final save is always synchronous.",
    )


class EvalConfig(Section):
    """Held-out evaluation during training (docs/guides/training.md, "Evaluation")."""

    data_path: str | None = Field(
        None, description="Eval data, in the formats of `data.path` (exclusive with `holdout`)."
    )
    format: Literal["auto", "json", "parquet", "arrow"] = Field(
        "auto", description="File format of `data_path`; `auto` reads it from the extension."
    )
    holdout: float | int | None = Field(
        None,
        gt=0,
        description="Hold out of `data.path` a fraction (0 < x < 1) or a count (an integer >= 1) of the prepared "
        "examples, chosen by `train.seed`, the same on every rank and on resume; never trained on.",
    )
    every_steps: int | None = Field(
        None, ge=1, description="Evaluate every N steps (null: only at the end; there is always one at the end)."
    )
    max_samples: int | None = Field(
        None, ge=1, description="Evaluate at most this many examples (prompts for the online types): the first ones."
    )
    at_start: bool = Field(False, description="Also evaluate before the first step of a fresh run (logged as step 0).")
    pass_k: int = Field(
        1,
        ge=1,
        description="Online types: k of `eval/pass@k`, the unbiased estimate from `samples_per_prompt` answers.",
    )
    samples_per_prompt: int | None = Field(
        None,
        ge=1,
        description="Online types: answers sampled per eval prompt with the training sampler (null: "
        "`rollout.group_size`); at least `pass_k`.",
    )
    pass_threshold: float = Field(
        1.0,
        description="Online types: an answer passes (pass@k, `greedy_pass`) when its total reward is at least this.",
    )
    log_samples: int = Field(
        4, ge=0, description="Online types: prompts (with their answers) appended to `eval_samples.jsonl` per eval."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if (self.data_path is None) == (self.holdout is None):
            raise ValueError("an eval section needs data: give exactly one of `eval.data_path` or `eval.holdout`")
        if isinstance(self.holdout, float) and not self.holdout < 1:
            raise ValueError(f"`eval.holdout` {self.holdout} is neither a fraction (< 1) nor a count (an integer)")
        if self.samples_per_prompt is not None and self.samples_per_prompt < self.pass_k:
            raise ValueError(
                f"`eval.pass_k` {self.pass_k} > `eval.samples_per_prompt` {self.samples_per_prompt}: pass@k needs "
                "at least k answers per prompt"
            )
        return self


class RuntimeConfig(Section):
    environment: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables exported to every rank of this job (values rendered with str(); null = empty), e.g. "
        "`{ASTR_LOG_LEVEL: DEBUG, ASTR_BACKEND: sdpa}` (the trainer's log level; the attention implementation handed "
        "to transformers: sdpa, eager, flash_attention_2). Nothing comes from the host shell unless listed here.",
    )
    dist_timeout_s: float = Field(1800.0, gt=0, description="Timeout of every collective of the job's process groups.")
    log_level: str = Field(
        "INFO", description="Trainer log level (env ASTR_LOG_LEVEL overrides): DEBUG, INFO, WARNING, ERROR or CRITICAL."
    )
    progress_bar: bool = Field(True, description="tqdm bar on rank 0.")
    tensorboard: bool = Field(
        True,
        description="Older key, kept: with `runtime.trackers` unset, true writes TensorBoard events when `tensorboard` "
        "is installed (as before), false writes none. Prefer `runtime.trackers`.",
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="Experiment trackers fed every metrics record beside metrics.jsonl (always written), on rank 0: "
        "`tensorboard` (<output_dir>/tensorboard), `wandb` (offline under <output_dir>/wandb unless WANDB_MODE or "
        "WANDB_API_KEY says otherwise), `mlflow` (a file store <output_dir>/mlruns by default). Each is an extra "
        "(`pip install 'astrai[wandb]'`); one not installed fails before any rank starts. A resume continues the "
        "same tracker runs (<output_dir>/trackers.json). null: `runtime.tensorboard` decides "
        "(docs/guides/training.md).",
    )
    wandb_project: str = Field("astrai", description="W&B project of the run (entity: WANDB_ENTITY or your default).")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server `http://...`, `sqlite:///...`, `file:...`); null: a file store at "
        "<output_dir>/mlruns.",
    )
    mlflow_experiment: str = Field("astrai", description="MLflow experiment the run is created in (created if new).")
    tune_malloc: bool | Literal["auto"] = Field(
        "auto",
        description="Set glibc malloc's mmap/trim thresholds on every rank so each step's buffers are kept rather "
        "than faulted in again (1.1x tokens/s on a CPU for small models; skipped where another allocator is preloaded "
        "or MALLOC_*_ is set; astrai/engine/host_memory.py). `auto`: for a policy under 100M parameters; above, "
        "freed blocks over 128 KiB go back to the kernel instead (at Qwen2.5-0.5B's size the kept heap, and glibc's "
        "own defaults, cost 2.4-2.7 GiB per rank: docs/benchmarks.md, 3c). true/false: always/never tuned.",
    )

    @field_validator("tune_malloc", mode="before")
    @classmethod
    def _tune_malloc_choice(cls, value: Any) -> bool | str:
        # One line for a wrong value, instead of pydantic's one per member of the union.
        if value == "auto" or isinstance(value, bool):
            return value
        try:
            return TypeAdapter(bool).validate_python(value)  # pydantic's own spellings: "yes", "off", 1, ...
        except ValidationError:
            raise ValueError(f"expected true, false or auto, not {value!r}") from None

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        return known_log_level(value)

    @field_validator("trackers")
    @classmethod
    def _distinct_trackers(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"names a tracker twice: {value}")
        return value

    @field_validator("wandb_project")
    @classmethod
    def _wandb_project_name(cls, value: str) -> str:
        refused = [character for character in "/\\#?%:" if character in value]
        if refused or not value or len(value) > 128:
            raise ValueError(f"{value!r} is not a W&B project name (1-128 characters, none of / \\ # ? % :)")
        return value

    @model_validator(mode="after")
    def _one_tensorboard_answer(self) -> RuntimeConfig:
        """`runtime.tensorboard` given beside `runtime.trackers` must agree with it (else which one wins?)."""
        if self.trackers is not None and "tensorboard" in self.model_fields_set:
            if self.tensorboard != ("tensorboard" in self.trackers):
                raise ValueError(
                    f"`runtime.tensorboard: {str(self.tensorboard).lower()}` contradicts `runtime.trackers: "
                    f"{self.trackers}`; keep `runtime.trackers` alone"
                )
        return self

    @field_validator("environment")
    @classmethod
    def _variable_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [str(name) for name in value if not ENVIRONMENT_NAME.match(str(name))]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a variable name (letters, digits and _, not starting with a digit)")
        return value


def known_log_level(value: str) -> str:
    """`value` if it names a log level (any case), else a ValueError listing the levels."""
    if str(value).upper() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {value!r}: one of {', '.join(LOG_LEVELS)}")
    return value


class GpuConfig(Section):
    devices: Literal["all"] | list[int] = Field(
        "all",
        description="GPUs of the host for this job: `all` (CUDA_VISIBLE_DEVICES left unset) or a list like [0, 1, 2, "
        "3].",
    )
    count: int | None = Field(
        None, ge=1, description="Ranks to start on the host (default: the number of listed devices, or every GPU)."
    )


class NodeConfig(Section):
    host: str = Field(..., description="Host name or address of a node.")
    slots: int = Field(..., ge=1, description="Ranks (GPUs) to run on that node.")


class InfraConfig(Section):
    """Host side (containers, GPUs, nodes): read by the wrappers and `python -m astrai launch`, not the trainer."""

    job_name: str | None = Field(None, description="Name of the job (containers, logs).")
    data: str | None = Field(None, description="Host folder mounted read-only as the container's data folder.")
    model: str | None = Field(None, description="Host folder of models mounted into the container.")
    checkpoint_dir: str | None = Field(
        None, description="Host folder mounted as the container's output folder (checkpoints, metrics)."
    )
    gpu: GpuConfig = Field(default_factory=GpuConfig, description="Which GPUs of the host the job uses.")
    image: str = Field("astrai:latest", description="Container image the trainer runs in.")
    shm_size: str = Field("16g", description="Shared memory of the container (NCCL and data loaders need plenty).")
    nodes: list[NodeConfig] | None = Field(None, description="Nodes of a multi-node job (exclusive with `hostfile`).")
    hostfile: str | None = Field(None, description="A DeepSpeed hostfile (`host slots=N` lines) instead of `nodes`.")
    master_addr: str | None = Field(None, description="Address of node 0 for the rendezvous (default: the first node).")
    master_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on the master node.")
    launcher: Literal["pdsh", "openmpi", "slurm", "no_ssh"] = Field(
        "pdsh", description="How DeepSpeed's launcher reaches the nodes."
    )
    gpus_per_node: int | None = Field(None, ge=1, description="Devices each node must have (checked by the preflight).")

    @model_validator(mode="after")
    def _one_host_list(self) -> InfraConfig:
        if self.nodes is not None and self.hostfile is not None:
            raise ValueError("give at most one of `infra.nodes` or `infra.hostfile`")
        return self


class ServeConfig(Section):
    model_dir: str | None = Field(None, description="Host folder of the exported Hugging Face model to serve.")
    image: str = Field("vllm/vllm-openai:latest", description="Image of the OpenAI-compatible server.")
    port: int = Field(8000, ge=1, le=65535, description="Host port of the server.")
    served_model_name: str | None = Field(None, description="Model name clients use (default: the job name).")
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments for the server command line.")


class ExportConfig(Section):
    hf_dir: str | None = Field(
        None,
        description="Folder for a Hugging Face export of the final policy (null: `<output_dir>/hf`, so a run moved by "
        "`--set output_dir=...` never overwrites another run's export).",
    )
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of the exported weights.")
    on_finish: bool = Field(False, description="Export when the run ends.")


class DpoConfig(Section):
    beta: float = Field(
        0.1,
        gt=0,
        description="`sigmoid`/`ipo`/`hinge`: strength of the implicit KL to the reference (DPO's beta); `simpo`: "
        "scale of the average log-prob reward (SimPO's beta, paper: 2-2.5); `orpo`: weight of the odds-ratio term "
        "beside the NLL (ORPO's lambda, TRL's default 0.1).",
    )
    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = Field(
        "sigmoid",
        description="`sigmoid`: DPO; `ipo`: IPO's squared loss; `hinge`: SLiC-style hinge; reference-free (no "
        "reference model is built): `simpo`: SimPO on average token log-probs with margin `dpo.simpo_gamma`; `orpo`: "
        "ORPO, NLL on chosen plus the odds-ratio term.",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Assumed label-flip rate (conservative DPO); `sigmoid` only."
    )
    precompute_reference: bool = Field(
        False,
        description="Compute the reference log-probs of every pair once before training, then free the reference "
        "model.",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="`simpo` only: target reward margin gamma, subtracted from beta x (avg chosen - avg rejected "
        "log-prob) (TRL's `simpo_gamma`; the SimPO paper's gamma/beta ratio is ~0.5, e.g. beta 2.5, gamma 1.25).",
    )


class RmConfig(Section):
    margin_field: str | None = Field(
        None,
        description="`rm`: data field holding each pair's margin m, subtracted inside the loss "
        "-log sigmoid(r_c - r_r - m) (Llama 2's reward model; a larger m for a clearer preference). null: no margin.",
    )
    center_rewards_coef: float = Field(
        0.0,
        ge=0,
        description="`rm`: weight of the centring term coef x mean((r_c + r_r)^2), which keeps the rewards near mean 0 "
        "(TRL's `center_rewards_coefficient`, suggested 0.01; 0: off).",
    )
    share_prefix: bool = Field(
        False,
        description="`rm`: each micro-batch runs every distinct prompt once and the chosen and rejected completions "
        "against its keys and values (astrai/rollout/shared_prompt.py), instead of the prompt once per completion: "
        "the same rewards and gradients within float rounding, fewer tokens when completions are short beside "
        "their prompts. Not with `model.gradient_checkpointing`.",
    )


class RolloutConfig(Section):
    prompts_per_step: int = Field(
        8,
        ge=1,
        description="Prompts per step across all ranks (a multiple of the number of ranks); each step samples "
        "prompts_per_step x group_size responses.",
    )
    group_size: int = Field(
        8, ge=1, description="Responses sampled per prompt; `grpo` scores each against the others of its group (>= 2)."
    )
    max_new_tokens: int = Field(
        64,
        ge=1,
        description="Longest response in tokens; a response that reaches it without EOS is cut there (metric "
        "`truncated_frac`).",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature; the loss's log-probs use the same temperature, so ratios compare like with "
        "like.",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling (1: off). Below 1 the ratio ignores the truncation: a small bias.",
    )
    top_k: int = Field(
        0, ge=0, description="Sample among the k likeliest tokens only (0: off). Same caveat as `top_p`."
    )
    zero3_generation: Literal["copy", "gather"] = Field(
        "copy",
        description="ZeRO-3 only: `copy` samples from a plain copy of the policy allocated for each rollout (one full "
        "copy of the weights per rank while sampling; ~5x faster on a CPU); `gather` samples from the partitioned "
        "module inside one gather (same peak memory, DeepSpeed's hooks at every forward).",
    )
    behaviour_logprobs: Literal["auto", "recompute", "sampler"] = Field(
        "auto",
        description="Where the ratio's behaviour log-probs come from: `recompute`: one forward of the policy engine "
        "after sampling, the loss's own call, so the first ratio is exactly 1; `sampler`: kept from the sampling "
        "logits at each step (no extra forward: 1.1x the rollout tokens/s in benchmarks/rollout_speed.py; the "
        "KV-cached kernels differ from the full forward by ~1e-6 in fp32, ~1e-2 in bf16); `auto`: `sampler` when the "
        "policy trains in fp32, `recompute` in bf16/fp16.",
    )
    share_prefill: bool = Field(
        True,
        description="Prefill each prompt once and repeat its KV cache to the group before decoding, instead of "
        "prefilling all group_size copies (TRL's way); same tokens and log-probs for the same seed. false: every "
        "copy prefilled.",
    )


class OverlongPenalty(Section):
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13), added to every response's reward."""

    buffer_tokens: int = Field(
        ..., ge=1, description="L_cache: the penalty grows linearly over the buffer_tokens tokens before max_tokens."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="L_max: a response this long or longer gets -penalty_factor; 0 up to max_tokens - "
        "buffer_tokens (null: rollout.max_new_tokens, so a truncated response gets the full penalty).",
    )
    penalty_factor: float = Field(
        1.0,
        gt=0,
        description="Scale of the penalty, in reward units (verl's overlong_buffer.penalty_factor; the "
        "paper's is 1, against a correctness reward of +-1).",
    )

    @model_validator(mode="after")
    def _buffer_within(self) -> OverlongPenalty:
        if self.max_tokens is not None and self.buffer_tokens > self.max_tokens:
            raise ValueError(
                f"`rl.overlong_penalty.buffer_tokens` ({self.buffer_tokens}) is larger than "
                f"`rl.overlong_penalty.max_tokens` ({self.max_tokens})"
            )
        return self


class RlConfig(Section):
    packing: bool = Field(
        False,
        description="Padding-free forwards of the policy, reference and critic (grpo, online_ppo): each "
        "micro-batch's sequences run as one packed row without their padding, micro-batches cut by "
        "`train.micro_batch_tokens` instead of `train.micro_batch_size`; the losses are unchanged.",
    )
    share_prefix: bool = Field(
        False,
        description="The policy's, the reference's and the critic's forwards (grpo, online_ppo) run each distinct "
        "prompt of a micro-batch once and its responses against its keys and values, with the gradient summed "
        "over them as before (astrai/rollout/shared_prompt.py): the same losses within float rounding, less "
        "compute when group_size responses share a long prompt. The replay shuffles whole groups, so a "
        "micro-batch of group_size x k sequences holds k prompts. Needs rollout.group_size >= 2; not with "
        "`rl.packing` or `model.gradient_checkpointing`.",
    )
    epochs_per_rollout: int = Field(
        1,
        ge=1,
        description="Passes over each rollout; targets (rewards, advantages, returns, behaviour and reference "
        "log-probs) stay fixed across them.",
    )
    minibatch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step across all ranks; must equal train.micro_batch_size x "
        "train.grad_accum_steps x ranks (null: that product).",
    )
    clip_eps: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Symmetric PPO clip: sets clip_eps_low, and clip_eps_high unless given (null: use "
        "clip_eps_low/high).",
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="PPO clip: the ratio's lower bound is 1 - clip_eps_low.")
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        description="The ratio's upper bound is 1 + clip_eps_high (DAPO's clip-higher uses 0.28; null: clip_eps_low).",
    )
    dual_clip_c: float | None = Field(
        None,
        gt=1,
        description="`online_ppo`: dual-clip (Ye et al. 2020) caps a negative-advantage token's loss at -A x c (e.g. "
        "3; null: off).",
    )
    kl_coef: float = Field(
        0.04,
        ge=0,
        description="Weight of the KL to the reference: in the loss for `grpo` (GRPO paper: 0.04; in the reward with "
        "rl.advantage_estimator reinforce_pp), in the per-token reward for `online_ppo` (see rl.kl_in_reward); the "
        "starting value when rl.target_kl is set. 0 (without target_kl) skips the reference model entirely.",
    )
    kl_max_log_ratio: float | None = Field(
        10.0,
        gt=0,
        description="Clamp |log pi - log pi_ref| here before k3 (whose exp overflows past ~88); null: no clamp.",
    )
    normalize_advantage_std: bool = Field(
        True,
        description="`grpo`: advantages (r - group mean) / (group std + 1e-6) as in GRPO; false: r - group mean only "
        "(Dr. GRPO). Read by rl.advantage_estimator grpo only.",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean",
        description="`token_mean`: every response token of the optimizer step weighs the same; `sequence_mean`: every "
        "response does (GRPO paper).",
    )
    gamma: float = Field(
        1.0, ge=0, le=1, description="`online_ppo`: GAE discount per response token (1: no discount within a response)."
    )
    gae_lambda: float = Field(
        0.95, ge=0, le=1, description="`online_ppo`: GAE lambda (1: Monte Carlo returns, 0: one-step TD)."
    )
    vf_coef: float = Field(
        1.0,
        gt=0,
        description="`online_ppo`: multiplier of the critic's loss. The critic has its own optimizer, so this trades "
        "off nothing against the policy loss: with AdamW it mostly moves where critic.max_grad_norm starts clipping "
        "(docs/guides/rl.md).",
    )
    value_clip: float | None = Field(
        0.2,
        gt=0,
        description="`online_ppo`: PPO2 value clipping, |V - V_old| <= value_clip in the clipped branch (null: plain "
        "squared error).",
    )
    whiten_advantages: bool = Field(
        True, description="`online_ppo`: whiten the GAE advantages over the valid tokens of the whole step (all ranks)."
    )
    kl_in_reward: bool = Field(
        True,
        description="`online_ppo`: -kl_coef x KL(behaviour, reference) in every token's reward (Ziegler et al.); "
        "false: kl_coef x k3 in the loss, as `grpo`.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None,
        description="Per-token KL estimator (Schulman's k1, k2, k3). null: k1 where the KL is in the reward "
        "(`online_ppo` with rl.kl_in_reward, `reinforce_pp`), k3 where it is a loss term (`grpo`, rl.kl_in_reward: "
        'false). k1 as a loss term has zero expected gradient and is refused (docs/guides/rl.md, "Which KL '
        'estimator where").',
    )
    target_kl: float | None = Field(
        None,
        gt=0,
        description="`online_ppo`: adaptive KL coefficient (Ziegler et al. 2019) steering the KL, in nats per "
        "response, to this value (null: fixed kl_coef).",
    )
    kl_horizon: float = Field(
        10000.0, gt=0, description="`online_ppo`: horizon of the adaptive KL controller, in responses."
    )
    reward_clip: float | None = Field(
        None,
        gt=0,
        description="`online_ppo`: clip each sequence reward to [-reward_clip, reward_clip] before shaping (null: "
        "off).",
    )
    reward_normalization: Literal["none", "batch"] = Field(
        "none",
        description="`online_ppo`: `batch` standardises the sequence rewards over all responses of the step (all "
        "ranks) before shaping.",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="`online_ppo`: entropy bonus, minus entropy_coef x the token-mean entropy in the policy loss.",
    )
    max_log_ratio: float = Field(
        20.0,
        gt=0,
        description="Clamp log(pi / pi_old) to [-max_log_ratio, max_log_ratio] before exp in the policy "
        "loss (past ~88 the float32 ratio is inf and the gradient NaN); clamped tokens get no gradient and are "
        "counted in the `log_ratio_clamp_frac` metric.",
    )
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp"] = Field(
        "grpo",
        description="`grpo` train type: `grpo` (group mean and std), `rloo` (leave-one-out group mean), "
        "`reinforce_pp_baseline` (group mean removed, then whitened over the step's tokens), `reinforce_pp` (k1 KL in "
        "every token's reward, returns whitened over the step's tokens, no group baseline).",
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token",
        description="Policy-loss ratio: `token` (PPO, one per token) or `sequence` (GSPO: exp of the "
        "sequence's mean log-ratio, clipped per sequence; GSPO's paper pairs it with loss_aggregation sequence_mean "
        "and clip ranges of ~3e-4 / 4e-4).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="`grpo`: DAPO's dynamic sampling: drop groups whose rewards are all equal (advantages 0) "
        "and sample more prompts until the step holds rollout.prompts_per_step informative groups (metrics "
        "sampling_rounds, kept_groups, dropped_groups; docs/guides/rl.md).",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="`rl.dynamic_sampling`: at most this many rounds of rollout.prompts_per_step prompts per "
        "step; short of informative groups after them, the step is filled with groups of equal rewards (advantages 0).",
    )
    overlong_penalty: OverlongPenalty | None = Field(
        None,
        description="DAPO's soft length penalty added to each reward: {buffer_tokens, max_tokens, "
        "penalty_factor} (null: off; metric overlong_penalty).",
    )
    mask_truncated: bool = Field(
        False,
        description="Responses cut at rollout.max_new_tokens (no EOS) take no loss (DAPO's overlong "
        "filtering); their rewards still count in their group's baseline.",
    )

    def kl_placement(self, train_type: str) -> str:
        """Where the KL to the reference goes for this train type: "reward" or "loss"."""
        return train_type_rules(train_type).kl_placement(self)

    def kl_kind(self, train_type: str) -> str:
        """rl.kl_estimator, or its default where it is null: k1 in the reward, k3 as a loss term."""
        if self.kl_estimator is not None:
            return self.kl_estimator
        return "k1" if self.kl_placement(train_type) == "reward" else "k3"

    @model_validator(mode="after")
    def _clip_alias(self) -> RlConfig:
        if self.clip_eps is not None:
            if "clip_eps_low" in self.model_fields_set and self.clip_eps_low != self.clip_eps:
                raise ValueError(
                    f"give `rl.clip_eps` ({self.clip_eps}) or `rl.clip_eps_low` ({self.clip_eps_low}), not both"
                )
            self.clip_eps_low = self.clip_eps
            if self.clip_eps_high is None:
                self.clip_eps_high = self.clip_eps
        if self.target_kl is not None and self.kl_coef == 0:
            raise ValueError("`rl.target_kl` adapts rl.kl_coef multiplicatively: give a starting `rl.kl_coef` > 0")
        return self


class CriticConfig(Section):
    """The value model of `online_ppo`: its own DeepSpeed engine, optimizer, schedule and clipping."""

    path: str | None = Field(
        None,
        description="Start the critic from this folder: a critic export (`export-hf --part critic`) or any "
        "transformers model, whose trunk is used with a zero value head. null: the policy's starting weights "
        "(model.path or model.init with train.seed). Also lets a resume from a checkpoint without critic/ start a new "
        "critic.",
    )
    lr: float | None = Field(None, gt=0, description="Critic peak learning rate (null: train.lr).")
    weight_decay: float | None = Field(None, ge=0, description="Critic AdamW weight decay (null: train.weight_decay).")
    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip the critic's gradient norm to this (null: train.max_grad_norm)."
    )
    lr_schedule: Literal["cosine", "linear", "constant"] | None = Field(
        None, description="Critic LR decay after warmup (null: train.lr_schedule)."
    )
    warmup_steps: int | None = Field(
        None,
        ge=0,
        description="Critic linear warmup, in steps (rollouts) as train.warmup_steps (null: the policy's warmup).",
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None, description="ZeRO stage of the critic's engine (null: the policy's)."
    )
    warmup_rollouts: int = Field(
        0,
        ge=0,
        description="Train only the critic on the first N rollouts (the policy is frozen and policy_version stays 0).",
    )
    lora: LoraSection | None = Field(
        None,
        description="A LoRA adapter on the critic's trunk, as model.lora; its value head stays fully trainable. "
        "null: the whole critic trains.",
    )


class RewardComponent(Section):
    function: str | None = Field(
        None,
        description="A Python callable 'package.module:function' returning one float per response (arguments: "
        "docs/guides/rl.md).",
    )
    model_path: str | None = Field(
        None, description="Local AutoModelForSequenceClassification folder (one output) scoring prompt + response."
    )
    url: str | None = Field(
        None, description='HTTP service: POST JSON prompts/responses/rows, answer {"rewards": [...]}.'
    )
    name: str | None = Field(
        None,
        description="Name in errors and metrics (default: the function's name, the model folder's name or the URL).",
    )
    weight: float = Field(1.0, description="Multiplier of this reward in the weighted sum.")
    timeout_s: float = Field(
        30.0, gt=0, description="`url`: seconds one attempt may take in all: connect, send, and read the whole answer."
    )
    retries: int = Field(
        2, ge=0, description="`url`: further attempts after a failed one (connection error, timeout, HTTP 408/429/5xx)."
    )
    retry_backoff_s: float = Field(
        1.0, ge=0, description="`url`: wait before the first retry, doubled before each next one."
    )
    batch_size: int = Field(8, ge=1, description="`model_path`: responses per reward-model forward.")
    normalize: Literal["none", "stored"] = Field(
        "none",
        description="`model_path`: `stored` standardises the model's rewards, (r - mean) / std, with the mean and std "
        "over its training pairs that an rm export records (reward_stats.json).",
    )
    max_response_bytes: int = Field(
        16 * 2**20, ge=1, description="`url`: largest answer accepted, in bytes; a larger one is an error."
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardComponent:
        if sum(value is not None for value in (self.function, self.model_path, self.url)) != 1:
            raise ValueError("give exactly one of `function`, `model_path` or `url`")
        return self

    @model_validator(mode="after")
    def _stored_statistics(self) -> RewardComponent:
        if self.normalize == "stored" and self.model_path is None:
            raise ValueError("`normalize: stored` applies to a `model_path` reward only")
        return self

    @model_validator(mode="after")
    def _http_url(self) -> RewardComponent:
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"`url` {self.url!r} must be an http:// or https:// address with a host")
        return self


class RewardConfig(RewardComponent):
    """The reward of the online train types: one source, or `components` summed with their weights."""

    components: list[RewardComponent] | None = Field(
        None,
        description="Several rewards, each {function | model_path | url, weight, ...}; the reward is their weighted "
        "sum.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if sum(value is not None for value in (self.function, self.model_path, self.url, self.components)) != 1:
            raise ValueError(
                "give exactly one of `reward.function`, `reward.model_path`, `reward.url` or `reward.components`"
            )
        return self


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
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig, description="Per-job process settings: environment, timeouts, logging."
    )
    infra: InfraConfig = Field(
        default_factory=InfraConfig,
        description="Host side (containers, GPUs, nodes), read by the wrappers; the trainer ignores it. Extra keys "
        "allowed.",
    )
    export: ExportConfig = Field(default_factory=ExportConfig, description="Hugging Face export of the final policy.")
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="Preference optimisation (`train_type: dpo`).")
    serve: ServeConfig = Field(
        default_factory=ServeConfig,
        description="Serving an export with an OpenAI-compatible engine (`scripts/serve.sh`).",
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
