"""The activations one micro-batch keeps on one rank for backward, and the logits it computes: the rows of
`python -m astrai plan` (astrai/launch/memory_plan.py) that grow with the sequence, the ones its `--max-seq-len`
search moves.

Activations are what autograd keeps for backward (`activation_bytes`), counted for the attention kernel the
model runs (`attention_name`): Korthikanti et al.'s 5 a s^2 b term is the [heads, s, s] scores that only eager
attention materializes; sdpa, FlashAttention and flex attention keep q, k, v, the output and a logsumexp, so a
long context costs memory linear in its length. Sequence parallelism (Ulysses, `parallel.sequence_parallel_size`)
cuts each rank's activations and logits to s / sp tokens, attention excepted (the full length with a / sp
heads). A tiled MLP (`parallel.tiled_mlp`) keeps only its input; gradient checkpointing keeps each layer's input,
in host memory when offloaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The implementations that materialize the [heads, s, s] scores (transformers' eager_attention_forward); every
# other (sdpa, flash_attention_*, flex_attention, a Hub kernel) keeps q, k, v, the output and a logsumexp.
QUADRATIC_ATTENTION = ("eager", "paged|eager")


@dataclass
class ModelShape:
    """What the arithmetic needs of one model: exact parameter count and the transformer's sizes."""

    parameters: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    trainable: int = 0  # a LoRA model: its adapter's parameters (0: every parameter trains)
    intermediate: int = 0  # the MLP's width (0: 4 x hidden)
    kv_heads: int = 0  # key/value heads (0: as many as heads)
    head_dim: int = 0  # (0: hidden / heads)


@dataclass
class SequenceLayout:
    """What the activation and logits rows are planned from: one micro-batch and how it lies on the ranks."""

    sequences: int  # per micro-batch (a dpo pair is two)
    seq_len: int  # tokens per sequence
    attention: str = "sdpa"  # the implementation the model runs (`attention_name`)
    sequence_parallel: int = 1  # ranks per sequence (parallel.sequence_parallel_size)
    tiled_mlp: bool = False  # parallel.tiled_mlp
    checkpointing: bool | str = False  # model.gradient_checkpointing: False, True or "offload"
    logits_chunk: int = 0  # train.logits_chunk_size (0: every position at once)

    @property
    def rank_tokens(self) -> int:
        """The micro-batch's tokens on one rank outside attention: cut along its length over the sp ranks."""
        return -(-self.sequences * self.seq_len // self.sequence_parallel)

    def describe(self) -> str:
        parts = [f"sp={self.sequence_parallel}", self.attention]
        parts += [f"{self.sequences} sequences per micro-batch"] if self.sequences > 1 else []
        if self.checkpointing:
            parts.append("checkpointing offloaded" if self.checkpointing == "offload" else "checkpointing")
        return ", ".join(parts + (["tiled MLP"] if self.tiled_mlp else []))


def activation_bytes(shape: ModelShape, layout: SequenceLayout, precision: str) -> tuple[int, int]:
    """(GPU, host) bytes one micro-batch's activations take on one rank: what autograd keeps for backward in a
    decoder layer of Llama's form (two RMSNorms, attention, a gated MLP, no dropout), after Korthikanti et al. 2022
    (eq. 1, whose s b h (34 + 5 a s / h) counts a GeLU MLP and dropout masks). Per layer, in elements of the
    activation width w unless in bytes, with T = b s / sp the rank's tokens, h hidden, i intermediate, a heads of
    width d, g key/value heads, a' = a / sp and g' = max(1, g / sp) the heads a rank attends with (Ulysses):
        outside attention  T (4 h + a d + 4 i): the two norms' inputs, the q/k/v and output projections' inputs, the
                           MLP's input and its gate, act(gate), up and their product [T, i]
        sdpa, flash, flex  b s d (2 a' + 2 g') + b s a' x 4 bytes: q, output, k and v of the full length, the fp32
                           logsumexp; linear in s
        eager              b s d 3 a' (q; k, v repeated to every head) + b s^2 a' (4 + w) bytes: the fp32 softmax and
                           the w-wide probabilities the value matmul reads (one fp32 tensor in fp32); quadratic in s
    Tiled MLP (parallel.tiled_mlp) keeps the MLP's input only: its intermediates exist for one tile, 4 i per token
    (DeepSpeed's TiledMLP cuts a row of L tokens into ceil(L / h) shards: at most h tokens per row). Gradient
    checkpointing keeps each layer's input (T h) and recomputes one layer in full at a time; "offload" holds
    those inputs in host memory."""
    width = ACTIVATION_BYTES[precision]
    sp = layout.sequence_parallel
    heads = max(1, shape.heads // sp)
    head_dim = shape.head_dim or shape.hidden // max(1, shape.heads)
    kv_heads = max(1, (shape.kv_heads or shape.heads) // sp)  # fewer kv heads than sp ranks: replicated
    intermediate = shape.intermediate or 4 * shape.hidden
    tokens, full = layout.rank_tokens, layout.sequences * layout.seq_len
    kept = tokens * (4 * shape.hidden + shape.heads * head_dim) * width
    if layout.attention in QUADRATIC_ATTENTION:
        score_bytes = 4 if width == 4 else 4 + width
        kept += full * head_dim * 3 * heads * width + full * layout.seq_len * heads * score_bytes
    else:
        kept += full * head_dim * (2 * heads + 2 * kv_heads) * width + full * heads * 4
    if layout.tiled_mlp:
        rows, row = (1, tokens) if sp > 1 else (layout.sequences, layout.seq_len)  # sp: one packed row
        transient = rows * -(-row // max(1, -(-row // shape.hidden))) * 4 * intermediate * width
    else:
        kept, transient = kept + tokens * 4 * intermediate * width, 0
    if not layout.checkpointing:
        return shape.layers * kept + transient, 0
    inputs = shape.layers * tokens * shape.hidden * width
    if layout.checkpointing == "offload":
        return kept + transient, inputs
    return inputs + kept + transient, 0


def logits_bytes(shape: ModelShape, layout: SequenceLayout) -> int:
    """fp32 logits and log-softmax of one `train.logits_chunk_size` chunk of the rank's positions at a time."""
    positions = layout.rank_tokens
    return min(positions, layout.logits_chunk or positions) * shape.vocab * 4 * 2


def attention_name(job, config) -> str:
    """The attention implementation the run's model uses: ASTR_BACKEND (the job's environment, then the shell)
    over `model.attn_implementation`; none named resolves as transformers does (`get_correct_attn_implementation`):
    sdpa where the model's class supports it, else eager."""
    from astrai.models.attention import model_class, supports

    backend = job.runtime.environment.get("ASTR_BACKEND", os.environ.get("ASTR_BACKEND"))
    named = backend or job.model.attn_implementation
    if named:
        return str(named)
    return "sdpa" if supports(model_class(config), "sdpa") else "eager"
