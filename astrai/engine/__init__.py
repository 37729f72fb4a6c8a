"""The only package that knows DeepSpeed: distributed init, the DeepSpeed config, and engines.

Everything else gets an `Engine`: forward, backward, step, module, save, load. A job may hold
several engines (the PPO policy and critic), each built by `make_engine` with its own optimizer,
LR schedule and clipping.

- `distributed.py`: the process group (job timeout, DeepSpeed's ZeRO group too), threads, collectives.
- `host_memory.py`: glibc malloc thresholds that keep each step's buffers instead of faulting them in again.
- `ds_config.py`: one engine's DeepSpeed config, LR schedule and weight-decay groups.
- `engines.py`: `Engine`, `FrozenEngine`, partitioned loading, consolidated weights.
- `sequence_parallel.py`: Ulysses sequence parallelism: the groups, every engine's `mpu`, attention sharded.
- `zero3_init.py`: `model.init` models partitioned as they are built, with the whole build's weights.
- `streamed_writes.py`: an engine's checkpoint files serialised into the caller's file objects.
- `safe_load.py`: every checkpoint file read weights-only (DeepSpeed's readers included); old RNG pickles.
- `portable_state.py`: DeepSpeed's shard files read as full tensors, and full tensors filled into each
  optimizer layout (the DeepSpeed halves of astrai/resume/portable.py's topology-free form).
"""

from astrai.engine.distributed import (
    CollectiveStalledError,
    DistInfo,
    all_gather_objects,
    all_reduce_maxes,
    all_reduce_sum,
    all_reduce_sums,
    barrier,
    pin_threads,
    set_log_format,
    setup_distributed,
    shutdown_distributed,
)
from astrai.engine.ds_config import (
    build_ds_config,
    deep_merge,
    effective_zero_stage,
    lr_lambda,
    parameter_groups,
    resolve_precision,
)
from astrai.engine.engines import (
    DS_TAG,
    PARAMETER_NAMES_KEY,
    CheckpointShapeError,
    Engine,
    FrozenEngine,
    check_shapes,
    consolidated_state_dict,
    make_engine,
    make_frozen_engine,
    zero3_loading,
)
from astrai.engine.host_memory import module_parameters, release_malloc, tune_malloc, tunes_malloc
from astrai.engine.safe_load import (
    CheckpointDamagedError,
    UnsafeCheckpointError,
    load_snapshot_pickle,
    load_tensor_file,
    weights_only_torch_load,
)
from astrai.engine.sequence_parallel import (
    check_heads,
    check_shardable,
    join_sequence_groups,
    shard_attention,
    tile_mlps,
)
from astrai.engine.zero3_init import zero3_building, zero3_construction

__all__ = [
    "CollectiveStalledError",
    "DistInfo",
    "all_gather_objects",
    "all_reduce_maxes",
    "all_reduce_sum",
    "all_reduce_sums",
    "barrier",
    "pin_threads",
    "set_log_format",
    "setup_distributed",
    "shutdown_distributed",
    "build_ds_config",
    "deep_merge",
    "effective_zero_stage",
    "lr_lambda",
    "parameter_groups",
    "resolve_precision",
    "DS_TAG",
    "PARAMETER_NAMES_KEY",
    "Engine",
    "FrozenEngine",
    "consolidated_state_dict",
    "make_engine",
    "make_frozen_engine",
    "zero3_loading",
    "check_heads",
    "check_shardable",
    "join_sequence_groups",
    "shard_attention",
    "tile_mlps",
    "zero3_building",
    "zero3_construction",
    "tune_malloc",
    "tunes_malloc",
    "module_parameters",
    "release_malloc",
    "CheckpointShapeError",
    "check_shapes",
    "CheckpointDamagedError",
    "UnsafeCheckpointError",
    "load_snapshot_pickle",
    "load_tensor_file",
    "weights_only_torch_load",
]
