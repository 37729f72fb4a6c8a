"""Step overhead: AstrAI's own training step against a plain DeepSpeed step (and, on 1 rank, a plain
PyTorch step) in the SAME processes, alternated in blocks, so launch-to-launch noise cancels.

    python benchmarks/step_overhead.py                      # 2 ranks, the sft job of trainer_overhead.py
    python benchmarks/step_overhead.py --ranks 1            # 1 rank: AstrAI (ZeRO-0) vs DeepSpeed ZeRO-0 and PyTorch
    python benchmarks/step_overhead.py --size tiny --seq-len 32 --rounds 2 --block 2   (smoke size)

trainer_overhead.py compares whole launches; on a shared 2-core machine two launches of the same
program differ by 10-20% in tokens/s, so a 3% target is lost in the noise. Here one launch builds:
    astrai   the run `astrai/train.py` builds (`build_run`: tokenizer, Arrow dataset, strategy, AstrAI's
             engine) and times what its loop times for `tokens_per_s`: collating the micro-batch from the
             dataset, `astrai.training.loops.offline_update` (the loss-weight all-reduce, the sft loss, engine
             backward and step) and the metric all-reduce; `+log` adds the step's metrics line
             (JSONL, TensorBoard where installed), which the loop runs outside that timing
    deepspeed the plain loop of benchmarks/plain_loop.py: `deepspeed.initialize` of the same model at the
             ZeRO stage AstrAI's engine runs (ZeRO-0 on one rank), the same config spelled out
    torch    (1 rank) plain PyTorch AdamW + clip on another copy of the model
Every round runs a block of `--block` steps of each, in rotating order; a block's figure is its median
step. Ratios are of tokens/s (baseline step time / AstrAI step time), per round, then median [min-max].
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_launch_arguments,
    child_env,
    command_line,
    deepspeed_command,
    fmt,
    fmt_summary,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    model_init,
    parameter_count,
    prepare_sft_data,
    require_success,
    summarize,
    write_results,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", default="small", help="model size from benchmarks/common.py MODELS")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=4, help="steps of each variant per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant before the first round")
    add_launch_arguments(parser, "step_overhead")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker (every rank)


def worker(plan: dict) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from astrai.config import load_job
    from astrai.engine import setup_distributed, tune_malloc
    from astrai.observability.metrics import MetricsLog
    from astrai.training.build import build_run
    from astrai.training.loops import _global_sums, offline_update
    from benchmarks.common import build_model
    from benchmarks.plain_loop import deepspeed_config, loss_of, parameter_groups

    steps_needed = plan["warmup"] + plan["rounds"] * plan["block"]
    job = load_job(plan["job"], [f"train.max_steps={steps_needed}"])
    info = setup_distributed(600)  # pins intra-op threads as the trainer does; the baselines share them
    if job.runtime.tune_malloc:
        tune_malloc()  # as the trainer does; process-wide, so the baselines share it too
    run = build_run(job, info, plan["job"])
    policy = run.engines["policy"]
    policy.train()
    metrics = MetricsLog(
        run.output_dir,
        is_main=info.is_main,
        total_steps=10**9,
        start_step=0,
        tensorboard=job.runtime.tensorboard,
        progress_bar=False,
    )
    batches = run.data.batches()
    astrai_step = {"n": 0}

    def astrai(log: bool) -> float:
        started = time.perf_counter()
        micro_batches = [run.strategy.collate(next(batches))]
        sums = offline_update(run, micro_batches)
        totals = _global_sums(sums, run)
        seconds = time.perf_counter() - started
        if log:
            astrai_step["n"] += 1
            tokens = totals.pop("tokens")
            metrics.log(
                astrai_step["n"],
                {
                    "loss": totals["loss"] / max(totals.pop("weight", 1.0), 1.0),
                    "lr": policy.lr,
                    "grad_norm": policy.grad_norm,
                    "tokens": int(tokens),
                    "tokens_per_s": tokens / seconds,
                },
            )
            metrics.advance()
            seconds = time.perf_counter() - started
        return seconds

    init = dict(plan["init"])
    data = torch.load(plan["tokens"])
    rows, micro, world, rank = data["input_ids"].shape[0], plan["micro_batch"], info.world_size, info.rank
    plain_model = build_model(init, 1)
    engine, _, _, _ = deepspeed.initialize(
        model=plain_model,
        model_parameters=parameter_groups(plain_model),
        config=deepspeed_config(policy.zero_stage, micro, 1e-3),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        dist_init_required=False,
    )
    engine.train()
    if world == 1 and policy.zero_stage == 0:
        engine.enable_backward_allreduce = False  # as AstrAI does on one ZeRO-0 rank (a no-op reduction)
    torch_model = build_model(init, 2) if world == 1 else None
    optimizer = (
        torch.optim.AdamW(parameter_groups(torch_model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8) if torch_model else None
    )
    plain_index = {"deepspeed": 0, "torch": 0}

    def plain_batch(kind: str):
        index = plain_index[kind]
        plain_index[kind] += 1
        first = (index * micro * world + rank * micro) % (rows - micro + 1)
        input_ids = data["input_ids"][first : first + micro]
        return input_ids, torch.ones_like(input_ids), data["loss_mask"][first : first + micro]

    def plain_deepspeed() -> float:
        started = time.perf_counter()
        input_ids, attention_mask, loss_mask = plain_batch("deepspeed")
        loss = loss_of(engine, input_ids, attention_mask, loss_mask)
        engine.backward(loss)
        engine.step()
        float(loss.detach())
        return time.perf_counter() - started

    def plain_torch() -> float:
        started = time.perf_counter()
        input_ids, attention_mask, loss_mask = plain_batch("torch")
        loss = loss_of(torch_model, input_ids, attention_mask, loss_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())
        return time.perf_counter() - started

    variants = {"astrai": lambda: astrai(False), "astrai+log": lambda: astrai(True), "deepspeed": plain_deepspeed}
    if torch_model is not None:
        variants["torch"] = plain_torch
    names = list(variants)
    for name in names:
        for _ in range(plan["warmup"]):
            variants[name]()
    blocks = []
    for round_index in range(plan["rounds"]):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            if dist.is_initialized():
                dist.barrier()  # every rank starts the block together
            seconds = [variants[name]() for _ in range(plan["block"])]
            blocks.append(
                {"round": round_index, "variant": name, "step_s": seconds, "median_s": statistics.median(seconds)}
            )
    metrics.close()
    if info.is_main:
        Path(plan["out"]).write_text(
            json.dumps(
                {
                    "blocks": blocks,
                    "world_size": world,
                    "zero_stage": policy.zero_stage,
                    "threads": torch.get_num_threads(),
                    "tokens_per_step": micro * plan["seq_len"] * world,
                }
            )
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# Parent

RATIOS = [
    ("astrai", "deepspeed", "AstrAI step vs the plain DeepSpeed step (same stage, same processes)"),
    ("astrai+log", "deepspeed", "AstrAI step + its metrics line vs the plain DeepSpeed step"),
    ("astrai", "torch", "AstrAI step vs the plain PyTorch step (1 rank)"),
    ("deepspeed", "torch", "plain DeepSpeed step vs plain PyTorch step (1 rank)"),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    from benchmarks.trainer_overhead import astrai_job

    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    started = time.perf_counter()
    init = model_init(args.size, args.seq_len)
    steps = args.warmup * 2 + args.rounds * args.block * 2  # AstrAI's two variants both draw from its data order
    data = prepare_sft_data(
        work / "data", max(64, steps * args.micro_batch * args.ranks + args.micro_batch), args.seq_len
    )
    job_args = argparse.Namespace(seq_len=args.seq_len, steps=steps, micro_batch=args.micro_batch)
    job = astrai_job(work, data, job_args, init, "astrai")
    plan = {
        "job": str(job),
        "tokens": str(data["tokens"]),
        "init": init,
        "out": str(work / "worker.json"),
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "rounds": args.rounds,
        "block": args.block,
        "warmup": args.warmup,
    }
    (work / "plan.json").write_text(json.dumps(plan))
    result = launch(
        deepspeed_command(args.ranks, Path(__file__).resolve(), "--worker", str(work / "plan.json")),
        env=child_env(),
        timeout=3600,
        log=work / "launch.log",
    )
    require_success(result, "the step-overhead worker launch")
    measured = json.loads((work / "worker.json").read_text())
    blocks = measured["blocks"]
    by = {(b["variant"], b["round"]): b["median_s"] for b in blocks}
    variants = sorted({b["variant"] for b in blocks})
    tokens = measured["tokens_per_step"]
    summary = {name: summarize([tokens / by[(name, r)] for r in range(args.rounds)]) for name in variants}
    ratios = []
    for variant, baseline, what in RATIOS:
        if variant in variants and baseline in variants:
            values = [by[(baseline, r)] / by[(variant, r)] for r in range(args.rounds)]
            ratios.append({"variant": variant, "baseline": baseline, "what": what, **summarize(values)})
    payload = {
        "benchmark": "step_overhead",
        "command": command_line(),
        "machine": info,
        "settings": vars(args),
        "model": init,
        "parameters": parameter_count(init),
        "world_size": measured["world_size"],
        "zero_stage": measured["zero_stage"],
        "threads_per_rank": measured["threads"],
        "tokens_per_s": summary,
        "ratios": ratios,
        "blocks": blocks,
        "total_s": time.perf_counter() - started,
    }
    write_results(args.name, payload, render_markdown(payload), results_dir)
    return 0


def render_markdown(payload: dict) -> str:
    settings = payload["settings"]
    lines = [
        f"### Step overhead, in-process ({payload['world_size']} rank(s), ZeRO-{payload['zero_stage']}, "
        f"{payload['threads_per_rank']} thread(s) per rank; {settings['rounds']} rounds x {settings['block']} steps "
        "per variant)",
        "",
        machine_line(payload["machine"]),
        f"Model: {payload['parameters'] / 1e6:.1f}M-parameter Llama, seq {settings['seq_len']}, micro-batch "
        f"{settings['micro_batch']}.",
        "",
        "Ratios of tokens/s, per round against the baseline's block of the same round: median [min–max].",
        "",
    ]
    lines.append(
        markdown_table(
            ["comparison", "ratio", "spread"],
            [[r["what"], fmt_summary(r), fmt(r["spread"])] for r in payload["ratios"]],
        )
    )
    lines += [
        "",
        markdown_table(
            ["variant", "tokens/s (all ranks)"],
            [[name, fmt_summary(s, 0)] for name, s in payload["tokens_per_s"].items()],
        ),
    ]
    lines += ["", f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
