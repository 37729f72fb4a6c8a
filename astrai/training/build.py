"""Build a run from a validated job: tokenizer, data, order, strategy, engines. No training here."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import datasets
import numpy
import torch

from astrai.config import JobConfig
from astrai.data.sources import iter_texts, load_rows
from astrai.data.stream import DataStream
from astrai.data.token_order import make_order
from astrai.engine import (
    DistInfo,
    Engine,
    barrier,
    join_sequence_groups,
    lr_lambda,
    make_engine,
    module_parameters,
    resolve_precision,
    shard_attention,
    tile_mlps,
    zero3_building,
    zero3_loading,
)
from astrai.eval.data import split_eval_data
from astrai.export.weights import load_checkpoint_weights
from astrai.models.lora import apply_lora, base_model_identity, critic_base_identity
from astrai.models.policy import build_policy
from astrai.models.segment_attention import check_packing_job, use_segment_attention
from astrai.models.token_forward import token_forward
from astrai.models.tokenizer import (
    TOKENIZER_DIR,
    TokenizerError,
    build_tokenizer,
    check_saved_tokenizer,
    load_tokenizer,
    require_chat_template,
    save_tokenizer,
    set_pad_token,
)
from astrai.models.value import build_value_model
from astrai.strategies import Strategy, strategy_class
from astrai.strategies.engine_settings import engine_config
from astrai.training.run_parts import Run

logger = logging.getLogger("astrai.build")


def make_tokenizer(job: JobConfig, rows, output_dir: Path, is_main: bool):
    if job.tokenizer.build is not None:
        fields = (
            job.data.text_field,
            job.data.messages_field,
            job.data.prompt_field,
            job.data.response_field,
            job.data.chosen_field,
            job.data.rejected_field,
        )
        tokenizer = build_tokenizer(
            job.tokenizer.build.kind,
            iter_texts(rows, fields),
            job.tokenizer.build.vocab_size,
            job.tokenizer.build.fill_vocab,
        )
        if job.tokenizer.chat_template:
            tokenizer.chat_template = job.tokenizer.chat_template
        keep_run_tokenizer(tokenizer, output_dir / TOKENIZER_DIR, is_main)
        source = "tokenizer.build"
    else:
        source = job.tokenizer.path or job.model.path
        tokenizer = load_tokenizer(source, job.tokenizer.chat_template)
    set_pad_token(tokenizer, job.tokenizer.pad_token)
    if strategy_class(job.train.train_type).renders_chats:
        require_chat_template(tokenizer, source, job.train.train_type)
    return tokenizer


def keep_run_tokenizer(tokenizer, folder: Path, is_main: bool) -> None:
    """A built tokenizer is saved once in `output_dir/tokenizer` and never replaced by another: a rebuild
    (every start and resume rebuilds it from the data) must give the same one, else the job fails here,
    before that folder or any checkpoint that needs it is touched. Every rank compares, so all fail."""
    try:
        same = check_saved_tokenizer(tokenizer, folder, "tokenizer.build")
    except TokenizerError as error:
        raise TokenizerError(
            f"{error} (the tokenizer this output_dir was trained with, rebuilt from data.path: did the data, "
            f"tokenizer.build or tokenizer.chat_template change? Use a new output_dir, or replace tokenizer.build "
            f"with tokenizer.path: {folder})"
        ) from None
    if not same and is_main:
        save_tokenizer(tokenizer, folder)


def seed_everything(seed: int) -> None:
    """`train.seed` for Python's `random`, numpy and torch (every device), the same on every rank, before
    anything is built: model init, dropout masks and sampling repeat exactly in a rerun of the job."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only
    torch.manual_seed(seed)


def prepare_dataset(strategy: Strategy, rows, is_main: bool) -> tuple[datasets.Dataset, int]:
    """Rank 0 tokenises first; the others then read its cache instead of repeating the work."""
    if is_main:
        result = strategy.prepare_data(rows)
    barrier()
    if not is_main:
        result = strategy.prepare_data(rows)
    return result


def total_steps(job: JobConfig, num_samples: int, samples_per_step: int) -> int:
    if job.train.max_steps is not None:
        return job.train.max_steps
    return max(1, math.ceil(job.train.epochs * num_samples / samples_per_step))


def warmup_steps(job: JobConfig, steps: int) -> int:
    if job.train.warmup_steps is not None:
        return job.train.warmup_steps
    return round((job.train.warmup_ratio or 0.0) * steps)


def warn_long_warmup(job: JobConfig, policy_steps: int) -> None:
    """One warning when `train.warmup_steps` outlasts the policy's steps: the LR never reaches `train.lr`. A
    warning, not a refusal: a recipe tried for a few steps (`--set train.max_steps=2`) keeps its warmup, and
    such a run is valid, only not at full LR."""
    warmup = job.train.warmup_steps
    if warmup is None or warmup <= policy_steps:
        return
    length = f"train.max_steps: {job.train.max_steps}" if job.train.max_steps else f"train.epochs: {job.train.epochs}"
    if job.train.max_steps and policy_steps != job.train.max_steps:
        length += f" less critic.warmup_rollouts: {job.critic.warmup_rollouts}"
    logger.warning(
        "train.warmup_steps (%d) is longer than the run's %d steps (%s): the learning rate never reaches train.lr, "
        "it peaks at %d/%d of it",
        warmup,
        policy_steps,
        length,
        policy_steps,
        warmup,
    )


def build_critic(job: JobConfig, dist: DistInfo, source: str, tokenizer, steps: int, updates: int) -> Engine:
    """online_ppo's value model in its own engine: own ZeRO stage, AdamW (critic.lr, weight decay),
    LR schedule over every step's updates (warmup rollouts included) and gradient clipping."""
    critic, train = job.critic, job.train
    ds_config = engine_config(job, source, world_size=dist.world_size, part="critic")
    model = build_critic_module(job, ds_config, tokenizer)
    if job.rl.packing:  # its packed forwards run sdpa one row at a time, as the policy's
        use_segment_attention(model.trunk)
    warmup = critic.warmup_steps if critic.warmup_steps is not None else warmup_steps(job, steps)
    schedule = lr_lambda(steps * updates, warmup * updates, critic.lr_schedule or train.lr_schedule, train.min_lr_ratio)
    weight_decay = critic.weight_decay if critic.weight_decay is not None else train.weight_decay
    return make_engine(model, ds_config, weight_decay=weight_decay, schedule=schedule)


def partitioned_at_build(job: JobConfig, path: str | None, lora) -> bool:
    """Whether a model is built holding only this rank's partition under ZeRO-3 (`model.zero3_init`): loaded
    from `path`, or built from `model.init`, except a `model.init` base under LoRA (its identity in the
    manifest hashes the whole initial weights, models/lora.py: built whole as before)."""
    return job.model.zero3_init and (path is not None or lora is None)


def build_critic_module(job: JobConfig, ds_config: dict, tokenizer):
    """online_ppo's value model before its engine: `critic.path`, else warm-started from the policy's source;
    partitioned while built under ZeRO-3 as the policy is."""
    critic = job.critic
    path = critic.path or job.model.path
    partitioned = partitioned_at_build(job, path, critic.lora)
    with zero3_building(ds_config, partitioned, from_config=path is None):
        model = build_value_model(job.model, tokenizer, job.train.seed, critic.path)
    if critic.lora is not None:
        identity = critic_base_identity(job, model)
        with zero3_loading(ds_config, partitioned):  # PEFT gathers partitioned weights it reads; the head trains
            model = apply_lora(model, critic.lora, identity, key="critic.lora", keep_trainable=("value_head",))
    return model


def build_policy_model(job: JobConfig, ds_config: dict, tokenizer):
    """The policy module before its engine: `model.init` / `model.path`, then `model.init_from_checkpoint`'s
    weights when set (loaded whole on every rank, so not partitioned while loading under ZeRO-3)."""
    start = job.model.init_from_checkpoint
    partitioned = start is None and partitioned_at_build(job, job.model.path, job.model.lora)
    with zero3_building(ds_config, partitioned, from_config=job.model.path is None):
        model = build_policy(job.model, tokenizer, job.train.seed)
    if start is not None:
        checkpoint = load_checkpoint_weights(model, start, tokenizer)
        logger.info(
            "model.init_from_checkpoint: policy weights of %s; optimizer, LR schedule, step and data position "
            "start fresh",
            checkpoint,
        )
    if job.model.lora is not None:
        identity = base_model_identity(job.model, job.train.seed, model)
        with zero3_loading(ds_config, partitioned):  # PEFT gathers the partitioned weights it reads (DoRA's norms)
            model = apply_lora(model, job.model.lora, identity)
    return model


def build_run(job: JobConfig, dist: DistInfo, source: str) -> Run:
    seed_everything(job.train.seed)
    dist = join_sequence_groups(dist, job.parallel.sequence_parallel_size)  # Ulysses: ranks sharing a sequence
    output_dir = Path(job.output_dir)
    skip_bad = job.data.on_bad_row == "skip"
    rows = load_rows(job.data.path, job.data.format, output_dir / "cache" / "datasets", skip_bad=skip_bad)
    tokenizer = make_tokenizer(job, rows, output_dir, dist.is_main)
    strategy = strategy_class(job.train.train_type)(job, tokenizer)
    dataset, skipped = prepare_dataset(strategy, rows, dist.is_main)
    if skipped:
        logger.warning("skipped %d malformed rows (data.on_bad_row: skip)", skipped)
    dataset, eval_dataset = split_eval_data(job, strategy, dataset, output_dir, dist.is_main)
    # The run's one data order: what one draw takes per rank is the strategy's (a micro-batch, or a step's prompts);
    # with data.packing a step's micro-batches are cut by tokens (TokenBalancedOrder).
    order = make_order(job, dataset, dist, strategy.rows_per_draw(dist.data_parallel_size))
    if job.data.packing:
        steps = job.train.max_steps or order.steps_for_epochs(job.train.epochs)
    else:
        steps = total_steps(
            job,
            order.samples_per_epoch,
            job.train.micro_batch_size * job.train.grad_accum_steps * dist.data_parallel_size,
        )
    ds_config = engine_config(job, source, world_size=dist.world_size)
    model = build_policy_model(job, ds_config, tokenizer)
    check_packing_job(job, model)
    model = strategy.policy_module(model, tokenizer)  # rm: the trunk under a scalar head
    if dist.sequence_parallel_size > 1:  # every model of the job runs this attention: one wrapper serves them all
        shard_attention(model, dist)
        strategy.tokens = token_forward(dist)
    if job.parallel.tiled_mlp:
        logger.info("parallel.tiled_mlp: %d MLPs run tile by tile", tile_mlps(model))
    # DeepSpeed steps the schedule once per optimizer update; an online step (one rollout) makes several.
    # The policy does not step during online_ppo's critic warmup rollouts, so its schedule spans the rest.
    updates = strategy.optimizer_steps_per_step(dist.data_parallel_size)
    policy_steps = steps - (job.critic.warmup_rollouts if "critic" in strategy.engine_parts else 0)
    if dist.is_main:
        warn_long_warmup(job, policy_steps)
        for message in strategy.rules.warnings(job):
            logger.warning(message)
    schedule = lr_lambda(
        policy_steps * updates, warmup_steps(job, policy_steps) * updates, job.train.lr_schedule, job.train.min_lr_ratio
    )
    policy = make_engine(model, ds_config, weight_decay=job.train.weight_decay, schedule=schedule)
    engines = {"policy": policy}
    if "critic" in strategy.engine_parts:
        engines["critic"] = build_critic(job, dist, source, tokenizer, steps, updates)
    logger.info(
        "%s: %d samples, %d steps of %d samples, ZeRO-%d, %s, %.2fM parameters, %d threads per rank",
        job.train.train_type,
        len(dataset),
        steps,
        job.train.micro_batch_size * job.train.grad_accum_steps * dist.data_parallel_size,
        policy.zero_stage,
        resolve_precision(job.model.dtype),
        module_parameters(model) / 1e6,
        torch.get_num_threads(),
    )
    run = Run(job, dist, output_dir, tokenizer, strategy, DataStream(dataset, order), steps, engines)
    run.eval_dataset = eval_dataset
    strategy.setup(run)
    return run
