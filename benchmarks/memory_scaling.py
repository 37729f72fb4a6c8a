"""Memory scaling: per-rank parameter + optimizer memory under ZeRO-0/1/2/3 at world size 2, from
DeepSpeed's own tensors (and RSS), against the fractions ZeRO is expected to give.

    python benchmarks/memory_scaling.py                  # small model, 2 ranks, one launch per stage
    python benchmarks/memory_scaling.py --size tiny      (smoke size)

Each stage gets its own launch (so RSS is not shared between stages), builds AstrAI's engine
(astrai.engine.make_engine with the stage's ds_configs template), takes one optimizer step and
counts, on every rank, the bytes of the tensors it holds:
    parameters   the module's parameters (ZeRO-3: each parameter's own partition, `ds_tensor`)
    master       DeepSpeed's fp32 partition the optimizer updates (`single_partition_of_fp32_groups`
                 for ZeRO-1/2, `fp32_partitioned_groups_flat` for ZeRO-3; none under ZeRO-0)
    optimizer    the AdamW state (exp_avg, exp_avg_sq) in the optimizer DeepSpeed steps
Expected in fp32 with Adam, P parameters, N ranks (bytes per rank): ZeRO-0 4P + 8P = 12P;
ZeRO-1/2 4P + (4P + 8P)/N (the fp32 master copy is a separate partition, even in fp32);
ZeRO-3 (4P + 4P + 8P)/N. Gradients (4P, or 4P/N under ZeRO-2/3) are transient and not counted.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    add_launch_arguments,
    child_env,
    command_line,
    deepspeed_command,
    fmt,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    model_init,
    parameter_count,
    require_success,
    write_results,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--ranks", type=int, default=2)
    add_launch_arguments(parser, "memory_scaling")
    return parser.parse_args(argv)


def expected_bytes(stage: int, parameters: int, ranks: int) -> dict[str, float]:
    """Per-rank bytes ZeRO should hold in fp32 with Adam (see the module docstring)."""
    full, shard = 4.0 * parameters, 4.0 * parameters / ranks
    if stage == 0:
        return {"parameters": full, "master": 0.0, "optimizer": 2 * full}
    if stage in (1, 2):
        return {"parameters": full, "master": shard, "optimizer": 2 * shard}
    return {"parameters": shard, "master": shard, "optimizer": 2 * shard}


def _bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(plan: dict) -> int:
    import torch
    import torch.distributed as dist

    from astrai.config.schema import DeepSpeedSection
    from astrai.engine import build_ds_config, make_engine, setup_distributed
    from benchmarks.common import build_model

    info = setup_distributed(600)
    stage = plan["stage"]
    rss_before = _rss_mib()
    init = model_init(plan["size"], 64)
    template = REPO / "ds_configs" / f"zero{stage}.json"
    config = build_ds_config(
        DeepSpeedSection(zero_stage=stage),
        template_path=template if template.exists() else None,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_grad_norm=1.0,
        precision="fp32",
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        world_size=info.world_size,
    )
    engine = make_engine(build_model(init, 0), config, weight_decay=0.0, schedule=lambda _: 1.0)
    ids = torch.randint(0, init["vocab_size"], (2, 64))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    ds_engine = engine._engine
    optimizer = ds_engine.optimizer
    basic = getattr(optimizer, "optimizer", optimizer)  # the torch AdamW DeepSpeed steps
    parameters = list(ds_engine.module.parameters())
    if stage == 3:
        parameter_bytes = _bytes(p.ds_tensor for p in parameters)
        master = list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    else:
        parameter_bytes = _bytes(parameters)
        master = list(getattr(optimizer, "single_partition_of_fp32_groups", [])) if stage in (1, 2) else []
    state_tensors = [
        v for state in basic.state.values() for k, v in state.items() if torch.is_tensor(v) and v.numel() > 1
    ]
    record = {
        "rank": info.rank,
        "stage": stage,
        "effective_stage": engine.zero_stage,
        "parameters": parameter_bytes,
        "master": _bytes(master),
        "optimizer": _bytes(state_tensors),
        "rss_before_mib": rss_before,
        "rss_after_step_mib": _rss_mib(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, record)
    if info.rank == 0:
        Path(plan["out"]).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    started = time.perf_counter()
    init = model_init(args.size, 64)
    parameters = parameter_count(init)
    stages = {}
    for stage in (int(s) for s in args.stages.split(",")):
        plan = {"stage": stage, "size": args.size, "out": str(work / f"z{stage}.json")}
        (work / f"plan_z{stage}.json").write_text(json.dumps(plan))
        result = launch(
            deepspeed_command(args.ranks, Path(__file__).resolve(), "--worker", str(work / f"plan_z{stage}.json")),
            env=child_env(),
            log=work / f"z{stage}.log",
        )
        require_success(result, f"the ZeRO-{stage} launch")
        ranks = json.loads(Path(plan["out"]).read_text())
        stages[stage] = {
            "ranks": ranks,
            "expected": expected_bytes(stage, parameters, args.ranks),
            "polled_peak_rss_mib": result.peak_rss_mib,
        }
        print(
            f"  ZeRO-{stage}: "
            + "; ".join(
                f"rank {r['rank']} {(r['parameters'] + r['master'] + r['optimizer']) / 2**20:.1f} MiB" for r in ranks
            )
        )
    payload = {
        "benchmark": "memory_scaling",
        "command": command_line(),
        "machine": info,
        "settings": vars(args),
        "model": init,
        "parameters": parameters,
        "stages": stages,
        "total_s": time.perf_counter() - started,
    }
    write_results(args.name, payload, render_markdown(payload), results_dir)
    return 0


def render_markdown(payload: dict) -> str:
    settings, parameters = payload["settings"], payload["parameters"]
    baseline = None
    rows = []
    for stage, entry in sorted(payload["stages"].items(), key=lambda item: int(item[0])):
        expected = sum(entry["expected"].values())
        for record in entry["ranks"]:
            held = record["parameters"] + record["master"] + record["optimizer"]
            if int(stage) == 0 and record["rank"] == 0:
                baseline = held
            rows.append(
                [
                    f"ZeRO-{stage}",
                    record["rank"],
                    f"{record['parameters'] / 2**20:.1f}",
                    f"{record['master'] / 2**20:.1f}",
                    f"{record['optimizer'] / 2**20:.1f}",
                    f"{held / 2**20:.1f}",
                    f"{held / expected:.3f}",
                    fmt(held / baseline if baseline else None, 3),
                    fmt(expected / (12.0 * parameters), 3),
                    f"{record['rss_after_step_mib'] - record['rss_before_mib']:.0f}",
                ]
            )
    lines = [
        f"### Memory per rank ({parameters / 1e6:.2f}M-parameter Llama, fp32, AdamW, {settings['ranks']} ranks)",
        "",
        machine_line(payload["machine"]),
        "",
        markdown_table(
            [
                "stage",
                "rank",
                "parameters (MiB)",
                "fp32 master (MiB)",
                "Adam state (MiB)",
                "total (MiB)",
                "measured / expected",
                "fraction of ZeRO-0",
                "expected fraction",
                "RSS growth, build + 1 step (MiB)",
            ],
            rows,
        ),
        "",
        "Expected fractions of ZeRO-0's 12P bytes per rank: ZeRO-1/2 (4P + 12P/N) / 12P, ZeRO-3 16P/N / 12P. "
        "In fp32 DeepSpeed keeps a separate fp32 master partition even though the parameters are fp32 already, "
        "so at N = 2 ZeRO-1/2 save only 1/6 of ZeRO-0's parameter + optimizer memory.",
        f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
