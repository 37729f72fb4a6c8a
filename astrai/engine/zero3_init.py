"""`model.init` under ZeRO-3 with `model.zero3_init`: each parameter partitioned as soon as its module is
built, with the very weights the whole build gives for the same seed.

transformers' own ZeRO-3 path (`from_config` while an `HfDeepSpeedConfig` is alive) skips every init at
construction (`no_init_weights`) and then initialises each module's gathered parameters on rank 0 only.
The whole build draws from the RNG twice per layer (torch's `reset_parameters` while constructing, then
transformers' `_init_weights` in `post_init`), so that path gives other weights than the whole build,
and leaves rank 0's RNG ahead of the others'. ZeRO-0 and ZeRO-3 runs of one `model.init` job would start
from different models.

Here construction runs as in the whole build, inside `deepspeed.zero.Init`: each module's
`reset_parameters` draws on its full tensor, then DeepSpeed keeps this rank's partition and frees the
rest (one module's full weights live at a time: the 151k-row embedding, not the model). transformers'
`_initialize_weights` (what `post_init` applies to every module, in the whole build's order) runs on the
module's gathered parameters on every rank, with the same RNG draws; rank 0's result is broadcast and
each rank keeps its partition. Every draw the whole build makes is made, in the same order, on tensors
of the same shape and dtype (fp32, as the whole build; the engine casts to bf16/fp16 as it does a whole
model), so every rank ends with its exact slice of the whole build's weights and the same RNG state.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import torch

from astrai.engine.engines import with_batch_size, zero3_loading

logger = logging.getLogger("astrai.engine")


@contextlib.contextmanager
def zero3_building(ds_config: dict, enabled: bool, *, from_config: bool):
    """`model.zero3_init` under ZeRO-3 (`enabled`; nothing otherwise): a model built inside holds only this
    rank's partition of each parameter, whether loaded (`from_pretrained`: transformers' partitioned
    loading, `zero3_loading`) or built from a config (`from_config=True`: `zero3_construction`)."""
    with zero3_construction(ds_config, enabled and from_config), zero3_loading(ds_config, enabled and not from_config):
        yield


@contextlib.contextmanager
def zero3_construction(ds_config: dict, enabled: bool):
    """While active (ZeRO-3 only), modules constructed are partitioned across ranks as they are built,
    with the whole build's initial weights (module docstring). Leave no `HfDeepSpeedConfig` alive inside:
    transformers would switch to its own ZeRO-3 init. On one rank a partition is the whole tensor: building
    partitioned would only add copies (the partition beside the full tensor, the gather), so it builds whole."""
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if not enabled or ds_config["zero_optimization"]["stage"] != 3 or ranks < 2:
        yield
        return
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        # zero.Init builds on the accelerator, whose generator is not the CPU one the whole build draws from: the
        # weights would differ from ZeRO-0's. Proven on the CPU only, so a GPU builds whole until checked there.
        logger.info(
            "model.zero3_init: a model.init model is built whole on %s (partitioned build: CPU only)",
            get_accelerator().device_name(),
        )
        yield
        return
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    original = PreTrainedModel._initialize_weights

    def initialize_gathered(self, module, is_custom_code: bool = False):
        if getattr(module, "_is_hf_initialized", False):  # nothing to draw: no gather either
            return
        # _init_weights may also set its plain children's parameters (e.g. `module.q_proj.weight`)
        parameters = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                parameters.extend(child.parameters(recurse=False))
        # Every rank draws (same RNG state after, as in the whole build); rank 0's tensors are broadcast.
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
            original(self, module, is_custom_code)

    PreTrainedModel._initialize_weights = initialize_gathered
    try:
        with (
            prevent_arange_dtype_change(),
            deepspeed.zero.Init(config_dict_or_path=fp32_build_config(ds_config)),
        ):
            yield
    finally:
        PreTrainedModel._initialize_weights = original
        # A tied output layer's own partition (built, initialised, then replaced by the embedding's parameter)
        # sits in a reference cycle: freed by the collector only (149 MiB per rank at hidden 512, 152k vocabulary).
        gc.collect()


def fp32_build_config(ds_config: dict) -> dict:
    """The DeepSpeed config `zero.Init` builds with: the job's, with bf16 and fp16 off, so that DeepSpeed derives
    fp32 partitions from the config itself (the engine casts later, as it does a whole model).

    Why not `zero.Init(dtype=torch.float32)`: in deepspeed 0.19.8 an explicit dtype is read as `dtype or
    torch.float16 if accelerator.is_fp16_supported() else torch.bfloat16 if ...` (operator precedence), so on a CPU
    whose oneDNN has no fp16 (AMD EPYC) the explicit fp32 is dropped and the partitions come out bf16. With
    `dtype=None` DeepSpeed takes the config's branch, which has no such slip."""
    config = with_batch_size(ds_config)
    for section in ("bf16", "fp16"):
        config[section] = {**config.get(section, {}), "enabled": False}
    return config
