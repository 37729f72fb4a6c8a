"""The `parallel` section: how a job's ranks split the work beyond data parallelism (Ulysses sequence parallelism)."""

from __future__ import annotations

from pydantic import Field

from astrai.config.sections.base import Section


class ParallelConfig(Section):
    """Sequence parallelism (DeepSpeed Ulysses, docs/guides/long-context.md): each sequence split along its length
    over `sequence_parallel_size` ranks, attention heads exchanged by all-to-all."""

    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks that share one sequence (DeepSpeed Ulysses): world = sequence_parallel_size x data-parallel "
        "ranks, consecutive ranks forming a group. Each micro-batch is packed into one row, cut along its length "
        "across the group; attention exchanges heads by all-to-all over the model's own attention implementation "
        "(sdpa, flash_attention_2; not eager). Losses, metrics and the data order are those of the data-parallel "
        "ranks alone: sp=2 on 2 ranks with twice the accumulation trains as 1 rank per sequence on 2. Must divide "
        "the world size and the model's attention heads (and its key/value heads, or be a multiple of them). 1: off.",
    )
    tiled_mlp: bool = Field(
        False,
        description="Run each decoder layer's MLP over the sequence in tiles (DeepSpeed's TiledMLP, ALST): the MLP's "
        "intermediate activations [tokens, intermediate_size] exist for one tile at a time, in forward and in the "
        "recompute of backward. Same numbers up to float rounding; costs one more MLP forward per layer.",
    )
