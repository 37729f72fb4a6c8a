"""The baselines AstrAI is measured against: a plain DeepSpeed loop and a plain PyTorch AdamW loop,
over the same model, data, batch and DeepSpeed config, written here and not through AstrAI.

    deepspeed --num_gpus 2 benchmarks/plain_loop.py --mode deepspeed --stage 2 ...   (ranks)
    python benchmarks/plain_loop.py --mode torch ...                                 (one process)

Prints `BENCH step N` after each step (the parent timestamps it) and writes a JSON of per-step
times, with forward / backward / optimizer-step split, to `--out` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("deepspeed", "torch"), required=True)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (deepspeed mode)")
    parser.add_argument("--model", required=True, help="JSON of the model.init block")
    parser.add_argument("--tokens", required=True, help="tokens.pt written by common.prepare_sft_data")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument(
        "--no-single-rank-allreduce",
        action="store_true",
        help="ZeRO-0 on one rank: skip DeepSpeed's gradient all-reduce (flatten, reduce over 1 rank, copy back)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    return parser.parse_args(argv)


def loss_of(model, input_ids, attention_mask, loss_mask):
    """Mean next-token cross-entropy over the loss-mask tokens (the usual shifted-labels form)."""
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    labels = input_ids[:, 1:].masked_fill(loss_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def parameter_groups(model):
    """Matrices and the rest, as two groups (weight decay 0 for both here, as in the AstrAI job)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": 0.0}, {"params": others, "weight_decay": 0.0}]


def deepspeed_config(stage: int, micro_batch: int, lr: float) -> dict:
    """The DeepSpeed config of the AstrAI job (ds_configs/zero2.json + the job's settings), spelled out."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
        },
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.common import build_model

    init = json.loads(args.model)
    data = torch.load(args.tokens)
    rank, world = 0, 1
    model = build_model(init, args.seed)
    if args.mode == "deepspeed":
        import deepspeed
        import torch.distributed as dist

        if "RANK" not in os.environ:
            from benchmarks.common import free_port

            os.environ.update(
                RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        rank, world = dist.get_rank(), dist.get_world_size()
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=parameter_groups(model),
            config=deepspeed_config(args.stage, args.micro_batch, args.lr),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
            dist_init_required=False,
        )
        engine.train()
        if args.no_single_rank_allreduce and world == 1 and args.stage == 0:
            engine.enable_backward_allreduce = (
                False  # a no-op reduction over one rank, costing two copies of every gradient
            )

        def backward(loss):
            engine.backward(loss)

        def step():
            engine.step()

        forward_module = engine
    else:
        optimizer = torch.optim.AdamW(parameter_groups(model), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        model.train()

        def backward(loss):
            loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        forward_module = model
    setup_s = time.perf_counter() - started
    rows = data["input_ids"].shape[0]
    records = []
    for index in range(args.steps):
        # Global micro-step `index` takes rows [index*M*W, (index+1)*M*W) of the fixed data, this rank its slice.
        first = (index * args.micro_batch * world + rank * args.micro_batch) % (rows - args.micro_batch + 1)
        input_ids = data["input_ids"][first : first + args.micro_batch]
        loss_mask = data["loss_mask"][first : first + args.micro_batch]
        attention_mask = torch.ones_like(input_ids)
        t0 = time.perf_counter()
        loss = loss_of(forward_module, input_ids, attention_mask, loss_mask)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        loss_value = float(loss.detach())
        t4 = time.perf_counter()
        tokens = input_ids.numel() * world
        records.append(
            {
                "step": index + 1,
                "seconds": t4 - t0,
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,
                "optimizer_step_s": t3 - t2,
                "tokens": tokens,
                "tokens_per_s": tokens / (t4 - t0),
                "loss": loss_value,
            }
        )
        if rank == 0:
            print(f"BENCH step {index + 1}", flush=True)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "mode": args.mode,
                    "stage": args.stage if args.mode == "deepspeed" else None,
                    "world_size": world,
                    "threads": torch.get_num_threads(),
                    "setup_s": setup_s,
                    "peak_rss_mib_self": peak_rss_mib,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "steps": records,
                },
                handle,
            )
    if args.mode == "deepspeed":
        import torch.distributed as dist

        dist.destroy_process_group()
        # Plain DeepSpeed on a CPU maps a 69 MB shared-memory all-reduce segment per rank and never
        # unlinks it; the baseline keeps DeepSpeed's behaviour but not the leak (AstrAI skips the op).
        address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        segment = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"
        if os.path.exists(segment):
            os.remove(segment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
