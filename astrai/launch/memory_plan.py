"""`python -m astrai plan --config job.yaml`: the memory one rank of a job needs, before any rank starts.

Per engine (policy, frozen reference, critic, ZeRO-3 generation copy) the bytes of parameters, gradients,
fp32 master weights and Adam moments under the job's ZeRO stage and offload, DeepSpeed's buckets, an
activation estimate and the logits; the checkpoint's size on disk; and whether it fits. Parameters are
counted exactly from the model's config on torch's meta device: no weights are built. The bytes per
parameter follow DeepSpeed's optimizers (docs/guides/memory.md):

    fp32 training: params 4, grads 4, Adam m + v 8, fp32 master 4 under ZeRO-1/2/3 (DeepSpeed clones
    the flat partition even in fp32; ZeRO-0 steps the module's own parameters)
    bf16/fp16:     params 2, grads 2, fp32 master 4, Adam m + v 8
    ZeRO-1 partitions master and moments over the N ranks, ZeRO-2 also the gradients, ZeRO-3 also the
    parameters. offload_optimizer moves master and moments to host memory, offload_param the parameters.

Activations and logits, the rows that grow with the sequence, are astrai/launch/activation_memory.py's (per
attention kernel, sequence parallelism, tiled MLP, checkpointing). Under sequence parallelism ZeRO partitions
over every rank (sp x dp). `--max-seq-len` searches the longest sequence that fits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace

from astrai.launch.activation_memory import (
    ModelShape,
    SequenceLayout,
    activation_bytes,
    attention_name,
    logits_bytes,
)

GIB = 1024**3
# Peak RSS of a rank whose model is negligible: a real 3-step sft run of a ~5k-parameter Llama (python, torch,
# deepspeed, transformers, datasets, the data, tokenizer and trainer; benchmarks/plan_memory.py, this machine,
# CPU build: 632 MiB; the imports and a gloo group alone: 532 MiB).
RUNTIME_BASELINE_BYTES = 632 * 1024**2
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py) when the resolved config leaves a key out.
ZERO_DEFAULTS = {
    "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_max_live_parameters": 1e9,
}


@dataclass
class Row:
    component: str
    gpu: int = 0
    host: int = 0


@dataclass
class Plan:
    train_type: str
    world_size: int
    precision: str
    zero_stage: int
    policy_parameters: int
    rows: list[Row] = field(default_factory=list)
    checkpoint_bytes: int = 0
    gpu_limit: int | None = None
    host_limit: int = 0
    shape: ModelShape | None = None  # the policy's
    layout: SequenceLayout | None = None
    on_gpu: bool = True  # False: a CPU-only run holds everything in host memory

    @property
    def gpu_total(self) -> int:
        return sum(row.gpu for row in self.rows)

    @property
    def host_total(self) -> int:
        return sum(row.host for row in self.rows)

    @property
    def fits(self) -> bool:
        gpu_ok = self.gpu_limit is None or self.gpu_total <= self.gpu_limit
        return gpu_ok and self.host_total <= self.host_limit

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(gpu_total=self.gpu_total, host_total=self.host_total, fits=self.fits)
        return data


def model_config(job, vocab_size: int):
    """The transformers config `build_policy` would build the policy from (`model.init` or `model.path`)."""
    from transformers import AutoConfig

    if job.model.init is not None:
        settings = dict(job.model.init)
        model_type = settings.pop("model_type")
        settings.setdefault("vocab_size", vocab_size)
        return AutoConfig.for_model(model_type, **settings)
    return AutoConfig.from_pretrained(job.model.path)


def tokenizer_size(job) -> int:
    """len(tokenizer) as the run would have it: loaded (`tokenizer.path` / `model.path`) or built from the data."""
    if job.model.init is not None and "vocab_size" in job.model.init:
        return int(job.model.init["vocab_size"])
    if job.tokenizer.build is None:
        from astrai.models.tokenizer import load_tokenizer

        return len(load_tokenizer(job.tokenizer.path or job.model.path, job.tokenizer.chat_template))
    from pathlib import Path

    from astrai.data.sources import iter_texts, load_rows
    from astrai.models.tokenizer import build_tokenizer

    data = job.data
    fields = (data.text_field, data.messages_field, data.prompt_field, data.response_field)
    fields += (data.chosen_field, data.rejected_field)
    import datasets

    datasets.disable_progress_bars()  # the table is the output
    with tempfile.TemporaryDirectory() as cache:  # the plan writes nothing into output_dir
        rows = load_rows(data.path, data.format, Path(cache))
        return len(
            build_tokenizer(
                job.tokenizer.build.kind,
                iter_texts(rows, fields),
                job.tokenizer.build.vocab_size,
                job.tokenizer.build.fill_vocab,
            )
        )


def count_shapes(config, critic: bool = False, lora=None) -> ModelShape:
    """Exact parameter count of the causal LM (or the critic: its trunk + value head) built on the meta
    device: no storage is allocated. Tied embeddings are one parameter, counted once. `lora`: the
    model.lora / critic.lora settings, the model wrapped as the run wraps it (`trainable` counted)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if critic:
            from astrai.models.value import ValueModel, trunk_of

            model = ValueModel(trunk_of(model))
        if lora is not None:
            from astrai.models.lora import apply_lora

            keep = ("value_head",) if critic else ()
            model = apply_lora(model, lora, {"path": "plan", "hash": ""}, keep_trainable=keep)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape(
        parameters=sum(parameter.numel() for parameter in model.parameters()),
        layers=int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0)),
        hidden=int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0)),
        heads=int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_head", 0)),
        vocab=int(text.vocab_size),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad) if lora is not None else 0,
        intermediate=int(getattr(text, "intermediate_size", 0) or getattr(text, "n_inner", 0) or 0),
        kv_heads=int(getattr(text, "num_key_value_heads", 0) or 0),
        head_dim=int(getattr(text, "head_dim", 0) or 0),
    )


def zero_setting(zero: dict, key: str) -> float:
    value = zero.get(key, ZERO_DEFAULTS[key])
    return float(value) if isinstance(value, (int, float)) else ZERO_DEFAULTS[key]  # "auto" -> DeepSpeed's default


def engine_rows(
    name: str, parameters: int, ds_config: dict, precision: str, world_size: int, trainable: int = 0
) -> list[Row]:
    """One trainable engine's parameters, gradients, master weights, Adam moments and buckets on one rank.
    `trainable`: a LoRA engine's adapter parameters, the only ones with gradients and optimizer state."""
    zero = ds_config["zero_optimization"]
    stage = zero["stage"]
    half = precision in ("bf16", "fp16")
    weight_bytes = 2 if half else 4
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    offload_param = stage == 3 and zero.get("offload_param", {}).get("device", "none") not in ("none", None)
    params = parameters * weight_bytes // (world_size if stage == 3 else 1)
    parameters = trainable or parameters  # what has gradients, master weights, moments and buckets
    grads = parameters * weight_bytes // (world_size if stage >= 2 else 1)
    master = parameters * 4 // (world_size if stage >= 1 else 1) if (half or stage >= 1) else 0
    moments = parameters * 8 // (world_size if stage >= 1 else 1)
    if stage in (1, 2):
        buckets = int(min(parameters, zero_setting(zero, "reduce_bucket_size"))) * weight_bytes
        buckets += int(min(parameters, zero_setting(zero, "allgather_bucket_size"))) * weight_bytes
    elif stage == 3:
        # Gathered full parameters in flight: the prefetch bucket (max_live_parameters is only a ceiling).
        prefetch = zero_setting(zero, "stage3_prefetch_bucket_size")
        live = min(parameters, prefetch, zero_setting(zero, "stage3_max_live_parameters"))
        # The reduce bucket, and the flat copy of it that DeepSpeed's reduce_scatter_coalesced makes (torch.cat).
        reduce_bucket = int(min(parameters, zero_setting(zero, "reduce_bucket_size")))
        buckets = (2 * reduce_bucket + int(live)) * weight_bytes
    else:
        buckets = 0

    def placed(component: str, size: int, on_host: bool) -> Row:
        return Row(f"{name} {component}", host=size) if on_host else Row(f"{name} {component}", gpu=size)

    return [
        placed("parameters", params, offload_param),
        placed("gradients", grads, False),
        placed("fp32 master weights", master, offload_optimizer),
        placed("Adam moments", moments, offload_optimizer),
        placed(f"ZeRO-{stage} buckets", buckets, False),
    ]


def sequence_rows(shape: ModelShape, layout: SequenceLayout, precision: str, on_gpu: bool) -> list[Row]:
    """The rows that grow with the sequence: activations and logits (fp32 logits and log-softmax of one
    `train.logits_chunk_size` chunk of the rank's positions at a time)."""
    gpu, host = activation_bytes(shape, layout, precision)
    rows = [Row("activations", gpu, host), Row("logits + log-softmax", gpu=logits_bytes(shape, layout))]
    return rows if on_gpu else [Row(row.component, 0, row.gpu + row.host) for row in rows]


def checkpoint_bytes(parameters: int, stage: int, precision: str) -> int:
    """What one engine's DeepSpeed checkpoint holds on disk over all ranks: the module in its training dtype
    (ZeRO-0/1/2; ZeRO-3 saves partitioned placeholders), fp32 master weights (ZeRO-1/2/3 and bf16 ZeRO-0;
    fp32 ZeRO-0 saves the module as the master) and Adam's m and v, each fp32."""
    half = precision in ("bf16", "fp16")
    module = 0 if stage == 3 else parameters * (2 if half else 4)
    master = parameters * 4 if (half or stage >= 1) else 0
    return module + master + parameters * 8


def sequence_geometry(job) -> tuple[int, int]:
    """(sequences per micro-batch, tokens per sequence): a dpo or rm pair is two sequences
    (`Strategy.sequences_per_row`); RL sequences are prompt (<= data.max_seq_len) + response
    (<= rollout.max_new_tokens). data.packing, rl.packing: one packed row of train.micro_batch_tokens."""
    from astrai.strategies import strategy_class

    strategy = strategy_class(job.train.train_type)
    if job.data.packing or (job.rl.packing and strategy.rules.online):
        return 1, job.train.micro_batch_tokens
    if strategy.rules.online:
        return job.train.micro_batch_size, job.data.max_seq_len + job.rollout.max_new_tokens
    return job.train.micro_batch_size * strategy.sequences_per_row, job.data.max_seq_len


def reward_model_rows(job) -> list[Row]:
    """The reward models of `reward.model_path` (or of its components): each loaded whole, in fp32, on every rank
    (astrai/rollout/rewards.py `ModelReward`), counted from its config.json on the meta device. A folder that does
    not exist yet (another job's export) is named with 0 bytes."""
    if job.reward is None:
        return []
    sources = [job.reward, *(job.reward.components or [])]
    rows = []
    for path in [source.model_path for source in sources if source.model_path is not None]:
        if not os.path.isfile(os.path.join(path, "config.json")):
            rows.append(Row(f"reward model {path} (not there yet: not counted)"))
            continue
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification

        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path))
        rows.append(Row(f"reward model {os.path.basename(path.rstrip('/'))}", gpu=4 * module_size(model)))
    return rows


def module_size(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def make_plan(job, source: str, world_size: int, gpu_memory_gib: float | None, host_memory: int | None = None) -> Plan:
    """Every component's bytes on one rank of `job` over `world_size` ranks."""
    import torch

    from astrai.config import ConfigError
    from astrai.rollout.generation import generation_mode
    from astrai.strategies import strategy_class
    from astrai.strategies.engine_settings import engine_config
    from astrai.strategies.frozen_reference import reference_is_the_policy

    on_gpu = gpu_memory_gib is not None or torch.cuda.is_available()
    dtype = job.model.dtype
    precision = ("bf16" if on_gpu else "fp32") if dtype == "auto" else dtype
    job = job.model_copy(update={"model": job.model.model_copy(update={"dtype": precision})})
    config = model_config(job, tokenizer_size(job))
    shape = count_shapes(config, lora=job.model.lora)
    ds_config = engine_config(job, source, world_size=world_size)
    stage = ds_config["zero_optimization"]["stage"]
    weight_bytes = 2 if precision in ("bf16", "fp16") else 4
    plan = Plan(job.train.train_type, world_size, precision, stage, shape.parameters)
    plan.rows += engine_rows("policy", shape.parameters, ds_config, precision, world_size, shape.trainable)
    plan.checkpoint_bytes = checkpoint_bytes(shape.trainable or shape.parameters, stage, precision)
    # The run's own answers: whether a reference is held while training (a LoRA policy is its own, adapter
    # disabled) and where the rollout samples (a LoRA policy samples in place under ZeRO-3).
    strategy = strategy_class(job.train.train_type)
    if strategy.keeps_reference(job) and not reference_is_the_policy(job):
        # A frozen engine: the policy's dtype, partitioned only under ZeRO-3.
        reference = shape.parameters * weight_bytes // (world_size if stage == 3 else 1)
        plan.rows.append(Row("reference parameters", gpu=reference))
    if "critic" in strategy.engine_parts:
        critic_config = engine_config(job, source, world_size=world_size, part="critic")
        critic = count_shapes(config, critic=True, lora=job.critic.lora)
        plan.rows += engine_rows("critic", critic.parameters, critic_config, precision, world_size, critic.trainable)
        critic_stage = critic_config["zero_optimization"]["stage"]
        plan.checkpoint_bytes += checkpoint_bytes(critic.trainable or critic.parameters, critic_stage, precision)
    plan.rows += reward_model_rows(job)
    copy = generation_mode(job.rollout.zero3_generation, job.model.lora is not None) == "copy"
    if strategy.rules.online and stage == 3 and copy:
        # Engine.generation_module: a plain module of the policy's class and dtype, filled for the rollout.
        plan.rows.append(Row("ZeRO-3 generation copy", gpu=shape.parameters * weight_bytes))
    checkpointing = job.model.gradient_checkpointing  # a bool, or the string "offload"
    sp = job.parallel.sequence_parallel_size
    if shape.heads % sp or world_size % sp:  # DeepSpeed's Ulysses refuses it when the model is built
        raise ConfigError(
            f"{source}: parallel.sequence_parallel_size: {sp} must divide the world size ({world_size}) and the "
            f"model's attention heads ({shape.heads})"
        )
    plan.shape, plan.on_gpu = shape, on_gpu
    plan.layout = SequenceLayout(
        *sequence_geometry(job),
        attention=attention_name(job, config),
        sequence_parallel=sp,
        tiled_mlp=job.parallel.tiled_mlp,
        checkpointing="offload" if checkpointing == "offload" else bool(checkpointing),
        logits_chunk=job.train.logits_chunk_size or 0,
    )
    plan.rows += sequence_rows(shape, plan.layout, precision, on_gpu)
    if not on_gpu:  # a CPU-only run holds everything in host memory
        plan.rows = [Row(row.component, 0, row.gpu + row.host) for row in plan.rows]
    plan.rows.append(Row("runtime baseline", host=RUNTIME_BASELINE_BYTES))
    plan.gpu_limit = int(gpu_memory_gib * GIB) if gpu_memory_gib is not None else None
    plan.host_limit = host_memory if host_memory is not None else machine_memory()
    return plan


def with_length(plan: Plan, seq_len: int) -> Plan:
    """`plan` with its activations and logits planned for sequences of `seq_len` tokens."""
    layout = replace(plan.layout, seq_len=seq_len)
    rows = {row.component: row for row in sequence_rows(plan.shape, layout, plan.precision, plan.on_gpu)}
    return replace(plan, layout=layout, rows=[rows.get(row.component, row) for row in plan.rows])


@dataclass
class LongestSequence:
    tokens: int  # per sequence, a multiple of sp (0: not even sp tokens fit)
    limited_by: str  # the component that outgrows the memory one step (sp tokens) further
    memory: str  # "GPU" or "host": the side that overflows
    ceiling: bool = False  # the search stopped at its ceiling still fitting


def longest_sequence(plan: Plan, ceiling: int = 1 << 30) -> LongestSequence:
    """The longest sequence (a multiple of sp tokens) whose plan fits: a binary search over `with_length`.
    The limit is the component that grows the most from that length to sp tokens more (with nothing fitting:
    the largest), on the side (GPU or host) that overflows."""
    step = plan.layout.sequence_parallel
    low, high = 0, 1  # in steps of sp tokens: low fits (0: nothing tried), high is the next to try
    while high * step <= ceiling and with_length(plan, high * step).fits:
        low, high = high, high * 2
    if high * step > ceiling:
        return LongestSequence(low * step, "", "", ceiling=True)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if with_length(plan, middle * step).fits else (low, middle)
    fitting, failing = with_length(plan, low * step), with_length(plan, (low + 1) * step)
    on_gpu = failing.gpu_limit is not None and failing.gpu_total > failing.gpu_limit
    side = "gpu" if on_gpu else "host"

    def grown(pair) -> int:
        before, after = (getattr(row, side) for row in pair)
        return after - before if low else after

    pairs = zip(fitting.rows, failing.rows)
    limit = max(pairs, key=grown)[1].component
    return LongestSequence(low * step, limit, "GPU" if on_gpu else "host")


def longest_line(plan: Plan, longest: LongestSequence) -> str:
    limit = plan.gpu_limit if plan.gpu_limit is not None else plan.host_limit
    memory = f"{limit / GIB:.1f}" if limit >= GIB else f"{limit / GIB:.3g}"
    memory += " GiB per rank" if plan.gpu_limit is not None else " GiB of host memory per rank"
    if longest.ceiling:
        return f"longest sequence that fits {memory}: over {longest.tokens:,} tokens ({plan.layout.describe()})"
    return (
        f"longest sequence that fits {memory}: {longest.tokens:,} tokens ({plan.layout.describe()}); "
        f"limited by {longest.limited_by} ({longest.memory} memory)"
    )


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def render_table(plan: Plan) -> str:
    """Rows per component, GPU and host columns per rank, in GiB when a total reaches 10 GiB, else MiB."""
    unit, scale = ("GiB", GIB) if max(plan.gpu_total, plan.host_total) >= 10 * GIB else ("MiB", 1024**2)
    width = max(len(row.component) for row in plan.rows) + 2
    lines = [
        f"{plan.train_type}: {plan.policy_parameters:,} parameters, {plan.precision}, ZeRO-{plan.zero_stage}, "
        f"{plan.world_size} rank(s); {unit} per rank",
        f"{'component':<{width}}{'GPU':>12}{'host':>12}",
    ]
    for row in plan.rows:
        if row.gpu or row.host:
            lines.append(f"{row.component:<{width}}{row.gpu / scale:12.1f}{row.host / scale:12.1f}")
    lines.append(f"{'total':<{width}}{plan.gpu_total / scale:12.1f}{plan.host_total / scale:12.1f}")
    limits = f"host {plan.host_limit / GIB:.1f} GiB"
    limits += f", GPU {plan.gpu_limit / GIB:.1f} GiB" if plan.gpu_limit else ""
    lines.append(f"checkpoint on disk: {plan.checkpoint_bytes / scale:.1f} {unit} (all ranks' shards)")
    lines.append(f"fits: {'yes' if plan.fits else 'NO'} ({limits} per rank)")
    return "\n".join(lines)


def positive(kind: type):
    """An argparse type: a number of `kind` above zero (a rank count of 0 divides by zero further on)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not 0 < value < math.inf:  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m astrai plan",
        description="Per-rank memory of a job, and whether it fits.",
    )
    parser.add_argument("--config", required=True, help="job YAML")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a key, as train.py",
    )
    parser.add_argument("--nodes", type=positive(int), default=1, help="nodes (a positive integer)")
    parser.add_argument("--gpus-per-node", type=positive(int), default=1, help="ranks per node")
    parser.add_argument(
        "--gpu-memory-gib",
        type=positive(float),
        default=None,
        help="memory of one GPU (default: plan for host memory)",
    )
    parser.add_argument(
        "--max-seq-len",
        action="store_true",
        help="also the longest sequence (a multiple of parallel.sequence_parallel_size) that fits, and what limits it",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def plan_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from astrai.config import ConfigError
    from astrai.launch.job_checks import load_and_check

    world_size = args.nodes * args.gpus_per_node
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)  # load_and_check checks batch splits for this many ranks
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the plan; DeepSpeed's import says things
            job = load_and_check(args.config, args.set)
    except ConfigError as error:
        print(f"astrai: {error}", file=sys.stderr)
        return 2
    finally:
        os.environ.pop("WORLD_SIZE") if saved is None else os.environ.update(WORLD_SIZE=saved)
    try:
        plan = make_plan(job, args.config, world_size, args.gpu_memory_gib)
    except ConfigError as error:
        print(f"astrai: {error}", file=sys.stderr)
        return 2
    data, text = plan.to_json(), render_table(plan)
    if args.max_seq_len:
        longest = longest_sequence(plan)
        data["max_seq_len"] = asdict(longest) | {"line": longest_line(plan, longest)}
        text += "\n" + data["max_seq_len"]["line"]
    print(json.dumps(data, indent=2) if args.json else text)
    return 0
