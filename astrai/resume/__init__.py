"""What a checkpoint of a training job holds, resuming from it, and resuming on another topology.

- `training_checkpoints.py`: the trainer's side of a checkpoint: what it contains, save, resume (checked first).
- `topology.py`: resume on another world size / ZeRO stage / precision: detect, convert once, load.
- `portable.py`: the topology-free form (full fp32 weights + Adam moments per engine): write and open it.
- `rng_state.py`: every rank's RNG states as JSON data (old pickled ones read with an allow-list).

The DeepSpeed-specific halves (reading DeepSpeed's shard files, filling its optimizer layouts) are in
astrai/engine/portable_state.py: only astrai/engine/ imports DeepSpeed. The byte-level publishing
(manifest, hashes, atomic install, retention) is astrai/checkpoint/, which knows nothing of training.
"""
