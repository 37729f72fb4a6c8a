"""What comparing digests while a resume loads costs (issue #38): DeepSpeed-layout files of Qwen2.5-0.5B's shape.

Writes, once, the files a 2-rank ZeRO-2 fp32 checkpoint of the 0.5B shape (configs/scale_0p5b.yaml,
494M parameters) holds: `mp_rank_00_model_states.pt` (the fp32 module, 1.98 GB) and one
`zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank (its half of the fp32 master weights and both Adam
moments, 2.97 GB each): 7.9 GB. Then, file by file, as a resume reads them through
`astrai.engine.load_tensor_file`:
- `load`: the load alone (checkpoint.verify_on_load: false);
- `load+check <hash>`: the load inside `read_check.checking_reads`, the file hashed beside it and compared
  (the default), for a manifest of sha256 (the default checkpoint.hash) and of xxh3_128;
- `hash <hash>`: the hashing alone (what rank 0's verify before loading paid per file with the old
  `verify_on_load: true`).
Each is timed with the files cold (evicted with posix_fadvise(DONTNEED), this script's files only) and warm
(page-cached). No DeepSpeed engine and no training: the reads are what differs.

    python benchmarks/resume_digest_cost.py [--folder /tmp/astrai_digest_cost] [--rounds 2] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from astrai.checkpoint.hashing import hash_file
from astrai.checkpoint.manifest import Manifest
from astrai.checkpoint.read_check import ReadCheck, checking_reads
from astrai.engine import load_tensor_file

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 896, 4864, 24, 151936, 128  # Qwen2.5-0.5B (2 KV heads x 64)


def module_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        shapes.update(
            {
                prefix + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                prefix + "self_attn.q_proj.bias": (HIDDEN,),
                prefix + "self_attn.k_proj.weight": (KV, HIDDEN),
                prefix + "self_attn.k_proj.bias": (KV,),
                prefix + "self_attn.v_proj.weight": (KV, HIDDEN),
                prefix + "self_attn.v_proj.bias": (KV,),
                prefix + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                prefix + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                prefix + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                prefix + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
                prefix + "input_layernorm.weight": (HIDDEN,),
                prefix + "post_attention_layernorm.weight": (HIDDEN,),
            }
        )
    return shapes


def write_files(folder: Path) -> list[str]:
    """The checkpoint's torch files (relative names), written once."""
    names = ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]
    if all((folder / name).is_file() for name in names):
        return names
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shapes = module_shapes()
    module = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    total = sum(tensor.numel() for tensor in module.values())
    torch.save({"module": module, "global_steps": 4}, folder / names[0])
    del module
    gc.collect()
    for rank in (0, 1):
        count = total // 2 + (total % 2 if rank == 0 else 0)
        state = {
            "fp32_flat_groups": [torch.randn(count, generator=generator) * 0.02],
            "state": {0: {"exp_avg": torch.randn(count, generator=generator) * 1e-3, "step": torch.tensor(4.0)}},
        }
        state["state"][0]["exp_avg_sq"] = state["state"][0]["exp_avg"].square()
        torch.save({"optimizer_state_dict": state, "ds_version": "0.19.8"}, folder / names[1 + rank])
        del state
        gc.collect()
    return names


def evict(path: Path) -> None:
    with open(path, "rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as handle:
        while handle.read(64 << 20):
            pass


def timed(action) -> float:
    gc.collect()
    started = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - started
    del result
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/astrai_digest_cost")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the 7.9 GB of files for another run")
    args = parser.parse_args()
    folder = Path(args.folder)
    names = write_files(folder)
    sizes = {name: (folder / name).stat().st_size for name in names}
    manifests = {}
    for algorithm in ("sha256", "xxh3_128"):
        files = {name: hash_file(folder / name, algorithm) for name in names}
        manifests[algorithm] = Manifest(step=4, parts=(), hash_algorithm=algorithm, files=files)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}")
    print(f"files: {', '.join(f'{name} {size / 1e9:.2f} GB' for name, size in sizes.items())}")

    def load(name: str):
        return lambda: load_tensor_file(folder / name, map_location="cpu")

    def load_checked(name: str, algorithm: str):
        def action():
            check = ReadCheck(folder, replace(manifests[algorithm]), [name])
            with checking_reads(check):
                state = load_tensor_file(folder / name, map_location="cpu")
            assert check.files == 1
            return state

        return action

    variants = {"load": load}
    for algorithm in ("sha256", "xxh3_128"):
        variants[f"load+check {algorithm}"] = lambda name, algorithm=algorithm: load_checked(name, algorithm)
        variants[f"hash {algorithm}"] = lambda name, algorithm=algorithm: lambda: hash_file(folder / name, algorithm)
    results: dict[str, dict[str, list[float]]] = {}
    for cache in ("cold", "warm"):
        for _ in range(args.rounds):
            for variant, make in variants.items():
                seconds = 0.0
                for name in names:
                    (evict if cache == "cold" else warm)(folder / name)
                    seconds += timed(make(name))
                results.setdefault(cache, {}).setdefault(variant, []).append(seconds)
                print(f"{cache} {variant}: {seconds:.2f} s, load average {os.getloadavg()[0]:.2f}", flush=True)
    total = sum(sizes.values())
    print(f"\nbest of {args.rounds} rounds, all files ({total / 1e9:.2f} GB) in one process:")
    for cache, variants_seconds in results.items():
        base = min(variants_seconds["load"])
        for variant, values in variants_seconds.items():
            best = min(values)
            print(f"  {cache:4} {variant:20} {best:7.2f} s  {total / best / 1e9:5.2f} GB/s  x{best / base:.2f} of load")
    print(json.dumps({"bytes": total, "seconds": results}))
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
