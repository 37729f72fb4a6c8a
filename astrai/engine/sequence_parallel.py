"""Ulysses sequence parallelism (`parallel.sequence_parallel_size`), wired from DeepSpeed's own pieces.

DeepSpeed ships the parts (deepspeed.runtime.sequence_parallel): `parallel_state_sp` makes the groups (consecutive
ranks share a sequence; ZeRO partitions and gradient reductions span the whole world, DeepSpeed dividing the
gradient sum by the data-parallel size world / sp), and `UlyssesSPAttentionHF` exchanges attention heads for
sequence by all-to-all around a core attention. This module joins them to the job:

- `join_sequence_groups` makes the groups once per process and returns the rank's `DistInfo` with them;
- `sequence_mpu` is what every `deepspeed.initialize` of the job receives (the policy's, the reference's, the
  critic's), so that all of them reduce and partition over the same groups;
- `shard_attention` puts Ulysses around the model's attention implementation. Unlike DeepSpeed's
  `register_with_transformers`, the wrapper runs Ulysses only for a forward whose position ids the sequence
  shards marked (models/token_forward.py): generation and any other whole-sequence forward go to the
  model's own attention untouched. And its core attention keeps packed documents apart: sdpa, given no mask,
  would let a document attend to the one before it in the row, so the core runs causal sdpa document by
  document (the documents read from the gathered position ids, restarting at 0), as flash_attention_2's
  variable-length path does from the same position ids.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from astrai.config import ConfigError
from astrai.data.packing import SEGMENT_ATTENTION, SEQUENCE_SHARD_MARK
from astrai.engine.distributed import DistInfo

logger = logging.getLogger("astrai.engine")


_ACTIVE = {"size": 1}  # the sequence-parallel size of the job this process builds now (one process may run several)


def join_sequence_groups(dist: DistInfo, size: int) -> DistInfo:
    """The rank's DistInfo with its sequence-parallel group of `size` consecutive ranks (made once per process);
    `dist` itself when size is 1. Later engines of the process take the groups as their `mpu` only while the
    job building them has size > 1."""
    import deepspeed.utils.groups as ds_groups

    _ACTIVE["size"] = size
    if size == 1:
        ds_groups.mpu = None  # DeepSpeed keeps the last engine's mpu module-wide: not for a job without groups
        return dist
    if dist.world_size % size:
        raise ConfigError(
            f"parallel.sequence_parallel_size: {size} does not divide the world size {dist.world_size} "
            "(ranks = sequence_parallel_size x data-parallel ranks)"
        )
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

    if groups._SEQUENCE_PARALLEL_GROUP is None:
        groups.initialize_sequence_parallel(sequence_parallel_size=size)
    elif groups.get_sequence_parallel_world_size() != size:
        made = groups.get_sequence_parallel_world_size()
        raise RuntimeError(f"this process already has sequence-parallel groups of {made} ranks, not {size}")
    return dataclasses.replace(dist, sequence_parallel_size=size, sequence_group=groups.get_sequence_parallel_group())


class SequenceParallelState:
    """DeepSpeed's `parallel_state_sp` module as the engines' `mpu`, but with no tensor parallelism. That module
    aliases its model-parallel functions to the sequence-parallel group, which DeepSpeed needs (its gradient norm
    counts each replicated parameter on model-parallel rank 0 and sums over that group); but the checkpoint's
    metadata reads the same function as the tensor-parallel degree, and a checkpoint recorded as tp=2 cannot be
    converted to DeepSpeed's universal form (`ds_to_universal`: "model-state file count 1 does not match
    pp_degree=1 * tp_degree=2"), which a resume on another topology does. This answers tp=1 there alone."""

    def __getattr__(self, name: str):
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

        return getattr(groups, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1


def sequence_mpu():
    """DeepSpeed's `mpu` argument for every engine of the process (policy, reference, critic): its
    sequence-parallel state once `join_sequence_groups` made the groups, else None."""
    return SequenceParallelState() if _ACTIVE["size"] > 1 else None


def correct_zero3_reduce_scatter(ds_engine) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 has two ways to reduce a bucket of gradients. The contiguous one divides the sum
    over the world by world / sp (the data-parallel ranks: the sequence ranks' gradients are parts of one sum);
    the reduce-scatter one (`reduce_scatter: true`, its default, and any bucket larger than reduce_bucket_size)
    averages over the whole world, so under sequence parallelism its gradients came out sp times too small
    (measured: the gradient norm of a 2-rank sp=2 run exactly half that of the same run without it). Scale that
    path's partitions by sp on this engine's optimizer, the factor DeepSpeed's other path applies."""
    optimizer = getattr(ds_engine, "optimizer", None)
    name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"  # the private method the reduction calls
    if ds_engine.zero_optimization_stage() != 3 or _ACTIVE["size"] == 1 or not hasattr(optimizer, name):
        return
    average = getattr(optimizer, name)
    size = float(_ACTIVE["size"])

    def summed_over_sequence_ranks(params, communication_data_type):
        return [partition.mul_(size) for partition in average(params, communication_data_type)]

    setattr(optimizer, name, summed_over_sequence_ranks)  # an instance attribute: DeepSpeed's class stays as it is


def check_shardable(model, size: int, key: str = "parallel.sequence_parallel_size") -> None:
    """Refuse, with one line naming the key, a model whose attention Ulysses cannot split over `size` ranks."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation in (None, "eager", "paged|eager"):
        raise ConfigError(
            f"{key}: {size} needs an attention implementation that takes no materialised mask (sdpa, "
            f"flash_attention_2, flex_attention); this model runs {implementation!r}: set model.attn_implementation"
        )
    check_heads(config, size, key)


def check_heads(config, size: int, key: str = "parallel.sequence_parallel_size") -> None:
    """Ulysses gives each rank of the group heads / size query heads and key/value heads / size (or repeats
    them when there are fewer than size): refuse a transformers `config` whose heads do not split so."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        raise ConfigError(f"{key}: {size}: the model's config names no num_attention_heads to split")
    if heads % size:
        raise ConfigError(f"{key}: {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            f"{key}: {size} neither divides the model's {kv_heads} key/value heads nor is a multiple of them"
        )
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise ConfigError(f"{key}: {size}: this model's sliding-window attention is not sharded (only full attention)")


def shard_attention(model, dist: DistInfo) -> None:
    """Put Ulysses around the attention implementation `model` runs, for every model of the process: the wrapper
    stands in transformers' table under that name, as DeepSpeed's own integration does (and under sdpa's too when
    the policy switched to the packed rows' segment attention, which its reference and critic do not)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    check_shardable(model, dist.sequence_parallel_size)
    module = getattr(model, "module", model)
    implementation = module.config._attn_implementation
    names = {implementation, "sdpa"} if _is_sdpa(implementation) else {implementation}
    for name in sorted(names):
        if not getattr(ALL_ATTENTION_FUNCTIONS[name], "_astrai_ulysses", False):
            ALL_ATTENTION_FUNCTIONS[name] = _ulysses_attention(ALL_ATTENTION_FUNCTIONS[name], name, module, dist)
    logger.info(
        "sequence parallelism: %d ranks per sequence, Ulysses around %s attention",
        dist.sequence_parallel_size,
        implementation,
    )


def _ulysses_attention(current, implementation: str, module, dist: DistInfo):
    """`current` (an attention function of transformers' table) with Ulysses for the forwards of marked cuts."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    text = module.config.get_text_config()
    ulysses = UlyssesSPAttentionHF(
        attn=_document_attention() if _is_sdpa(implementation) else current,
        batch_size=1,  # the sequence shards pack every micro-batch into one row
        attn_head_count=text.num_attention_heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=dist.sequence_group,
        seq_length_is_variable=True,
    )
    ulysses.core_attn_implementation = implementation

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not getattr(kwargs.get("position_ids"), SEQUENCE_SHARD_MARK, False):
            return current(module, query, key, value, attention_mask, *args, **kwargs)
        # The mask transformers made is the local cut's; the documents come from the gathered position ids.
        return ulysses(module, query, key, value, None, *args, **kwargs)

    attention._astrai_ulysses = True
    return attention


def _is_sdpa(implementation: str) -> bool:
    return implementation in ("sdpa", SEGMENT_ATTENTION)


def _document_attention():
    """Causal sdpa over each document of the gathered row [1, heads, T, dim], the documents starting where the
    position ids restart at 0; returns ([1, T, heads, dim], None) as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        positions = kwargs.pop("position_ids")[0]
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
            kwargs.pop(name, None)
        starts = (positions == 0).nonzero().squeeze(1).tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        edges = [*starts, positions.shape[0]]
        outputs = [
            sdpa_attention_forward(
                module,
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                None,
                dropout,
                scaling,
                is_causal=True,
                **kwargs,
            )[0]
            for start, end in zip(edges[:-1], edges[1:])
        ]
        return torch.cat(outputs, dim=1), None

    return attention


def tile_mlps(model) -> int:
    """`parallel.tiled_mlp`: every gated MLP of `model` (gate_proj, up_proj, down_proj: Llama, Qwen, Mistral...) runs
    through DeepSpeed's TiledMLP, ceil(tokens / hidden_size) tiles of the sequence at a time in forward and again in
    backward, so its [tokens, intermediate_size] activations exist for one tile only. Returns the MLPs tiled."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiled = 0
    for module in getattr(model, "module", model).modules():
        if not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue
        plain = type(module).forward

        def forward(x, module=module, plain=plain):
            tiles = _agreed_tiles(math.ceil(x.shape[-2] / x.shape[-1]), x.device)
            if tiles <= 1:
                return plain(module, x)
            weights = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
            return TiledMLP.apply(plain, module, x, tiles, weights)

        module.forward = forward  # an instance attribute: the class (and other models of it) stays as it is
        tiled += 1
    if not tiled:
        name = type(getattr(model, "module", model)).__name__
        raise ConfigError(f"parallel.tiled_mlp: {name} has no gated MLP (gate_proj, up_proj, down_proj) to tile")
    return tiled


def _agreed_tiles(tiles: int, device: torch.device) -> int:
    """The most tiles any rank needs: under ZeRO-3 every tile's forward gathers the weights, a collective that
    every rank must run as often."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return tiles
    count = torch.tensor([tiles], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())
