"""Checkpoint cost: AstrAI's crash-safe publish against DeepSpeed's plain `save_checkpoint` of the same
engine, and against the disk's sequential write bandwidth, measured alternately in one run.

    python benchmarks/checkpoint_cost.py                         # 2 ranks, ZeRO-2 and ZeRO-3, small + medium
    python benchmarks/checkpoint_cost.py --sizes tiny --repeats 1 --hash-mib 16   (smoke size)

One launch of 2 ranks builds, for each (ZeRO stage, model size), AstrAI's own engine (astrai.engine),
takes one optimizer step so the optimizer state exists, then repeats, in rotating order, each after
--overlap-steps optimizer steps (a save in a run follows training, not another save):
    plain        engine.save_checkpoint(dir)  (DeepSpeed alone: page cache, no fsync)
    plain+fsync  the same, then every file fsynced (what durability alone costs)
    publish      CheckpointPublisher.publish with the job's default hash (sha256), as the trainer saves:
                 staging, DeepSpeed's shards written through StreamedFiles (hashed on their way out,
                 kernel write-out started every 16 MiB), fsync of every file, the small files read
                 back and hashed, manifest, directory fsyncs, atomic rename
    publish_reread the same without streaming (shards written by DeepSpeed to their paths, then
                 fsynced and read back to be hashed): how every save ran before StreamedFiles
    publish_xxh3 `publish` with checkpoint.hash: xxh3_128
    publish_async CheckpointPublisher.publish_async (checkpoint.async_save: true), sha256: the time
                 training is blocked (staging + shards, streamed without hashing); then --overlap-steps
                 optimizer steps run while hashing, fsync, manifest and rename go on in the background thread, timed
                 against the steps just before it, with no save in flight; then wait().
                 Also recorded: the background save's own time to durable (its report's seconds)
    disk         both ranks write as many bytes as their checkpoint shards at once, then fsync
Times are the slowest rank's (a save ends when every rank has finished). Hashing GB/s is measured in
memory (one thread) in the parent process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    fmt_summary,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    model_init,
    parameter_count,
    require_success,
    summarize,
    write_results,
)

METHODS = ("plain", "plain+fsync", "publish", "publish_reread", "publish_xxh3", "publish_async", "disk")
PUBLISHED = {
    "publish": "published",
    "publish_reread": "published_reread",
    "publish_xxh3": "published_xxh3",
    "publish_async": "published_async",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,medium", help="model sizes from benchmarks/common.py MODELS")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--overlap-steps", type=int, default=2, help="optimizer steps timed while an async save finishes"
    )
    parser.add_argument("--hash-mib", type=int, default=256, help="buffer hashed in memory per algorithm")
    add_launch_arguments(parser, "checkpoint_cost")
    return parser.parse_args(argv)


def hashing_gbps(mib: int) -> dict[str, float | None]:
    """GB/s of each manifest hash over an in-memory buffer, one thread (best of 3)."""
    import hashlib

    data = os.urandom(mib * 2**20)
    makers = {"sha256": hashlib.sha256, "blake2b": hashlib.blake2b}
    try:
        import xxhash

        makers["xxh3_128"] = xxhash.xxh3_128
    except ImportError:
        pass
    result: dict[str, float | None] = {"sha256": None, "blake2b": None, "xxh3_128": None}
    view = memoryview(data)
    chunk = 8 * 2**20  # the publisher's read size
    for name, make in makers.items():
        best = float("inf")
        for _ in range(3):
            hasher = make()
            started = time.perf_counter()
            for start in range(0, len(data), chunk):
                hasher.update(view[start : start + chunk])
            hasher.hexdigest()
            best = min(best, time.perf_counter() - started)
        result[name] = len(data) / best / 1e9
    return result


# ---------------------------------------------------------------------------------------------
# Worker (every rank)


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _fsync_share(folder: Path, rank: int, world: int) -> None:
    from astrai.checkpoint import fs

    for index, path in enumerate(_files_under(folder)):
        if index % world == rank:
            fs.fsync_file(path)
    for directory, _, _ in os.walk(folder):
        if rank == 0:
            fs.fsync_dir(Path(directory))


def _write_and_fsync(path: Path, size: int) -> None:
    block = os.urandom(min(size, 8 * 2**20)) if size else b""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < size:
            written += os.write(descriptor, block[: size - written])
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def worker(plan: dict) -> int:
    import torch
    import torch.distributed as dist

    import astrai.checkpoint.publisher as publisher_module
    from astrai.checkpoint import CheckpointPublisher, StreamedFiles
    from astrai.config.schema import DeepSpeedSection
    from astrai.engine import build_ds_config, make_engine, setup_distributed
    from benchmarks.common import build_model

    info = setup_distributed(600)
    rank, world = info.rank, info.world_size
    root = Path(plan["work"])
    hash_seconds = {"value": 0.0}
    original_hash_files = publisher_module.hash_files

    def timed_hash_files(*args, **kwargs):  # the publisher's hash phase (fsync + read + digest), this rank
        started = time.perf_counter()
        try:
            return original_hash_files(*args, **kwargs)
        finally:
            hash_seconds["value"] += time.perf_counter() - started

    publisher_module.hash_files = timed_hash_files

    def slowest(seconds: float) -> float:
        tensor = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def total(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor.item())

    # Engine, batch and stream are arguments, not loop names closed over: a closure reads the name when called
    # (late binding), and `del engine` at the end of each case unbinds it.
    def train_steps(engine, ids: torch.Tensor, count: int) -> float:
        begun = time.perf_counter()
        for _ in range(count):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        return time.perf_counter() - begun

    def policy_writer(engine, streamed: StreamedFiles | None, write_seconds: dict):
        def write(staging: Path):
            begun = time.perf_counter()
            engine.save(staging / "policy", open_file=streamed.open if streamed else None)
            write_seconds["value"] = time.perf_counter() - begun
            return streamed.digests_under(staging) if streamed else None

        return write

    results = []
    for stage in plan["stages"]:
        for size in plan["sizes"]:
            init = model_init(size, 64)
            template = REPO / "ds_configs" / f"zero{stage}.json"
            config = build_ds_config(
                DeepSpeedSection(zero_stage=stage),
                template_path=template,
                micro_batch_size=2,
                grad_accum_steps=1,
                max_grad_norm=1.0,
                precision="fp32",
                lr=1e-3,
                betas=(0.9, 0.95),
                eps=1e-8,
                world_size=world,
            )
            engine = make_engine(build_model(init, 0), config, weight_decay=0.0, schedule=lambda _: 1.0)
            ids = torch.randint(0, init["vocab_size"], (2, 64))
            train_steps(engine, ids, 1)
            case = root / f"z{stage}_{size}"
            publishers = {
                "publish": CheckpointPublisher(case / "published", parts=["policy"], hash_algorithm="sha256"),
                "publish_reread": CheckpointPublisher(
                    case / "published_reread", parts=["policy"], hash_algorithm="sha256"
                ),
                "publish_xxh3": CheckpointPublisher(
                    case / "published_xxh3", parts=["policy"], hash_algorithm="xxh3_128"
                ),
                "publish_async": CheckpointPublisher(
                    case / "published_async", parts=["policy"], hash_algorithm="sha256"
                ),
            }
            own_bytes = None
            for repeat in range(plan["repeats"]):
                order = list(METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)])
                for method in order:
                    target = case / f"{method}_{repeat}"
                    dist.barrier()
                    hash_seconds["value"] = 0.0
                    write_seconds = {"value": 0.0}
                    overlap = {}
                    # Every save follows the same training steps, as in a run: a save straight after another
                    # reuses its just-freed memory and runs up to 4x faster on this VM (its balloon takes back
                    # memory left idle for a second or two). For publish_async these are the steps' own pace.
                    overlap["steps_before_s"] = slowest(train_steps(engine, ids, plan["overlap_steps"]))
                    dist.barrier()
                    started = time.perf_counter()
                    if method in ("plain", "plain+fsync"):
                        engine._engine.save_checkpoint(str(target))
                        if method == "plain+fsync":
                            dist.barrier()  # every rank's files exist before they are shared out for fsync
                            _fsync_share(target, rank, world)
                    elif method.startswith("publish"):
                        # As astrai.resume.training_checkpoints writes: streamed, hashed on the way out unless async.
                        streamed = (
                            None
                            if method == "publish_reread"
                            else StreamedFiles(None if method == "publish_async" else publishers[method].hash_algorithm)
                        )
                        write = policy_writer(engine, streamed, write_seconds)
                        if method == "publish_async":
                            publishers[method].publish_async(repeat + 1, write)
                        else:
                            publishers[method].publish(repeat + 1, write)
                    else:  # disk: this rank's share of the checkpoint's bytes, written and fsynced
                        target.mkdir(parents=True, exist_ok=True)
                        _write_and_fsync(target / f"rank{rank}.bin", own_bytes or 0)
                    seconds = time.perf_counter() - started
                    if method == "publish_async":
                        pending = publishers[method].pending_step is not None
                        overlapped_s = train_steps(engine, ids, plan["overlap_steps"])
                        report = publishers[method].wait()
                        overlap.update(
                            pending=total(float(pending)),
                            with_save_s=slowest(overlapped_s),
                            durable_s=slowest(report.seconds),
                        )
                    seconds_all = slowest(seconds)
                    hash_all = slowest(hash_seconds["value"])
                    write_all = slowest(write_seconds["value"])
                    dist.barrier()
                    if method == "plain" and own_bytes is None:
                        sizes = [p.stat().st_size for p in _files_under(target)]
                        own_bytes = int(sum(sizes) // world) + 1
                    total_bytes = sum(
                        p.stat().st_size
                        for p in _files_under(case / PUBLISHED[method] if method in PUBLISHED else target)
                    )
                    results.append(
                        {
                            "stage": stage,
                            "size": size,
                            "method": method,
                            "repeat": repeat,
                            "seconds": seconds_all,
                            "hash_phase_s": hash_all if method in PUBLISHED else None,
                            "write_phase_s": write_all if method in PUBLISHED else None,
                            "bytes": total_bytes,
                            **overlap,
                        }
                    )
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(target, ignore_errors=True)
                        if method in PUBLISHED:
                            shutil.rmtree(case / PUBLISHED[method], ignore_errors=True)
                    dist.barrier()
            del engine
    if rank == 0:
        Path(plan["out"]).write_text(json.dumps({"results": results, "world_size": world}))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# Parent


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    started = time.perf_counter()
    hashing = hashing_gbps(args.hash_mib)
    plan = {
        "work": str(work / "checkpoints"),
        "out": str(work / "worker.json"),
        "repeats": args.repeats,
        "overlap_steps": args.overlap_steps,
        "stages": [int(s) for s in args.stages.split(",")],
        "sizes": args.sizes.split(","),
    }
    (work / "plan.json").write_text(json.dumps(plan))
    result = launch(
        deepspeed_command(args.ranks, Path(__file__).resolve(), "--worker", str(work / "plan.json")),
        env=child_env(),
        timeout=1800,
        log=work / "launch.log",
    )
    require_success(result, "the checkpoint worker launch")
    measured = json.loads((work / "worker.json").read_text())["results"]
    hashing_after = hashing_gbps(args.hash_mib)
    hashing = {
        name: max(v for v in (hashing[name], hashing_after[name]) if v is not None) if hashing[name] else None
        for name in hashing
    }
    cases = summarize_cases(measured, plan["stages"], plan["sizes"], args.repeats)
    payload = {
        "benchmark": "checkpoint_cost",
        "command": command_line(),
        "machine": info,
        "settings": vars(args),
        "hashing_gbps": hashing,
        "cases": cases,
        "runs": measured,
        "total_s": time.perf_counter() - started,
    }
    write_results(args.name, payload, render_markdown(payload), results_dir)
    return 0


def summarize_cases(measured: list[dict], stages: list[int], sizes: list[str], repeats: int) -> list[dict]:
    """Per (stage, size): each method's seconds and the ratios against the same round's baselines."""
    cases = []
    for stage in stages:
        for size in sizes:
            rows = [r for r in measured if r["stage"] == stage and r["size"] == size]
            by = {(r["method"], r["repeat"]): r for r in rows}
            case = {
                "stage": stage,
                "size": size,
                "parameters": parameter_count(model_init(size, 64)),
                "bytes": next(r["bytes"] for r in rows if r["method"] == "plain"),
            }
            for method in METHODS:
                case[method] = summarize([by[(method, k)]["seconds"] for k in range(repeats) if (method, k) in by])
            for method in METHODS[1:]:
                case[f"{method}/plain"] = summarize(
                    [by[(method, k)]["seconds"] / by[("plain", k)]["seconds"] for k in range(repeats)]
                )
            case["publish/publish_reread"] = summarize(
                [by[("publish", k)]["seconds"] / by[("publish_reread", k)]["seconds"] for k in range(repeats)]
            )
            for method in (
                "publish",
                "publish_reread",
                "publish_xxh3",
            ):  # what a crash-safe publish costs beyond durability itself
                case[f"{method}/plain+fsync"] = summarize(
                    [by[(method, k)]["seconds"] / by[("plain+fsync", k)]["seconds"] for k in range(repeats)]
                )
            asyncs = [by[("publish_async", k)] for k in range(repeats) if ("publish_async", k) in by]
            case["publish_async_durable/plain"] = summarize(
                [r["durable_s"] / by[("plain", r["repeat"])]["seconds"] for r in asyncs]
            )
            case["publish_async_durable/plain+fsync"] = summarize(
                [r["durable_s"] / by[("plain+fsync", r["repeat"])]["seconds"] for r in asyncs]
            )
            case["steps_during_async/alone"] = summarize([r["with_save_s"] / r["steps_before_s"] for r in asyncs])
            case["steps_alone_s"] = summarize([r["steps_before_s"] for r in asyncs])
            case["async_pending_ranks"] = summarize(
                [r["pending"] for r in asyncs]
            )  # ranks whose save was still in flight
            case["publish/disk"] = summarize(
                [by[("publish", k)]["seconds"] / by[("disk", k)]["seconds"] for k in range(repeats)]
            )
            case["disk_gbps"] = summarize([case["bytes"] / by[("disk", k)]["seconds"] / 1e9 for k in range(repeats)])
            for method in PUBLISHED:
                case[f"{method}_hash_phase_s"] = summarize([by[(method, k)]["hash_phase_s"] for k in range(repeats)])
                case[f"{method}_write_phase_s"] = summarize([by[(method, k)]["write_phase_s"] for k in range(repeats)])
                # what the publisher itself holds training for, beyond DeepSpeed writing the shards
                case[f"{method}_own_blocking_s"] = summarize(
                    [by[(method, k)]["seconds"] - by[(method, k)]["write_phase_s"] for k in range(repeats)]
                )
            cases.append(case)
    return cases


def render_markdown(payload: dict) -> str:
    settings, hashing = payload["settings"], payload["hashing_gbps"]
    lines = [
        f"### Checkpoint cost ({settings['ranks']} ranks, {settings['repeats']} rounds; times are the slowest rank's)",
        "",
        machine_line(payload["machine"]),
        "Hashing in memory, one thread: "
        + ", ".join(f"{name} {fmt(value)} GB/s" for name, value in hashing.items())
        + ".",
        "",
        "Ratios of times, each against a baseline of the same round: median [min–max]. Plain = DeepSpeed's own "
        "`save_checkpoint` of the same engine (page cache, no fsync); target: publish <= 1.25 x plain. Publishes "
        "stream DeepSpeed's shards (hashed as written, write-out started every 16 MiB) as the trainer does; `not "
        "streamed` is the earlier way (written, then fsynced and read back).",
        "",
    ]
    rows = []
    for case in payload["cases"]:
        rows.append(
            [
                f"ZeRO-{case['stage']} {case['size']} ({case['parameters'] / 1e6:.1f}M params, "
                f"{case['bytes'] / 2**20:.0f} MiB)",
                fmt_summary(case["plain"], 2),
                fmt_summary(case["plain+fsync/plain"]),
                fmt_summary(case["publish/plain"]),
                fmt_summary(case["publish_xxh3/plain"]),
                fmt_summary(case["publish_reread/plain"]),
                fmt_summary(case["publish/publish_reread"]),
                fmt_summary(case["publish/plain+fsync"]),
                fmt_summary(case["publish_xxh3/plain+fsync"]),
                fmt_summary(case["disk/plain"]),
                fmt_summary(case["disk_gbps"], 2),
                f"{fmt(case['publish_write_phase_s']['median'])} / {fmt(case['publish_hash_phase_s']['median'])}",
            ]
        )
    lines.append(
        markdown_table(
            [
                "case",
                "plain save (s)",
                "plain + fsync ÷ plain",
                "publish sha256 ÷ plain",
                "publish xxh3 ÷ plain",
                "publish sha256, not streamed (read back) ÷ plain",
                "publish sha256 streamed ÷ not streamed",
                "publish sha256 ÷ (plain + fsync)",
                "publish xxh3 ÷ (plain + fsync)",
                "disk write+fsync of the same bytes ÷ plain",
                "disk GB/s (both ranks, fsync)",
                "publish sha256: write / fsync+hash phase (s)",
            ],
            rows,
        )
    )
    lines += [
        "",
        f"checkpoint.async_save (sha256): training is blocked only while the shards are written; hashing, fsync, "
        f"manifest and rename run in a background thread while {settings['overlap_steps']} optimizer step(s) go on, "
        "timed against the same steps just before it with no save in flight. Durable = until the background "
        "save's rename (its report's seconds).",
        "",
    ]
    rows = []
    for case in payload["cases"]:
        rows.append(
            [
                f"ZeRO-{case['stage']} {case['size']}",
                fmt_summary(case["publish/plain"]),
                fmt_summary(case["publish_async/plain"]),
                f"{fmt(case['publish_own_blocking_s']['median'], 3)} / "
                f"{fmt(case['publish_async_own_blocking_s']['median'], 3)}",
                fmt_summary(case["publish_async_durable/plain"]),
                fmt_summary(case["publish_async_durable/plain+fsync"]),
                fmt_summary(case["steps_alone_s"], 2),
                fmt_summary(case["steps_during_async/alone"]),
                fmt(case["async_pending_ranks"]["median"], 1),
            ]
        )
    lines.append(
        markdown_table(
            [
                "case",
                "publish (sync) ÷ plain",
                "async: blocked ÷ plain",
                "publisher's own blocking beyond the shard write, sync / async (s)",
                "async: durable ÷ plain",
                "async: durable ÷ (plain + fsync)",
                "steps alone (s)",
                "steps during the async save ÷ alone",
                "ranks still publishing when the call returned",
            ],
            rows,
        )
    )
    lines += ["", f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
