"""Run several training jobs inside ONE launch of ranks (imports and process start cost 10-20 s
per launch, so integration tests batch their runs here).

    deepspeed --num_gpus 2 tests/integration/run_plan.py --plan plan.json

plan.json: {"results": "<path>", "runs": [{"name": ..., "config": ..., "set": [...], "expect_error": "substring"?,
                                       "prepare": ["module:function", arg, ...]?}]}
`prepare`: called by rank 0 (with the args) before the run, the other ranks waiting (e.g. to damage a checkpoint).
Rank 0 writes `results`: {name: {"ok": bool, "error": str | None, "step": int}}.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    plan = json.loads(open(args.plan).read())

    from astrai.engine import barrier, set_log_format, setup_distributed, shutdown_distributed
    from astrai.export.hf import export_finished_run
    from astrai.launch.job_checks import load_and_check
    from astrai.training.build import build_run
    from astrai.training.loops import TRAIN_LOOPS

    dist = setup_distributed(120)
    set_log_format(dist.rank, "WARNING")
    results = {}
    for entry in plan["runs"]:
        if "prepare" in entry:  # every rank reads the same plan: all wait here, or none
            if dist.is_main:
                target, *arguments = entry["prepare"]
                module, _, function = target.partition(":")
                getattr(importlib.import_module(module), function)(*arguments)
            barrier()
        try:
            job = load_and_check(entry["config"], entry.get("set", []))  # WORLD_SIZE is set: batch splits are checked
            run = build_run(job, dist, entry["config"])
            state = TRAIN_LOOPS[run.strategy.loop](run)
            if job.export.on_finish and dist.is_main:  # as astrai/train.py does, so a later job can load it
                export_finished_run(job)
            results[entry["name"]] = {"ok": True, "error": None, "step": state.step}
        except Exception as error:  # recorded for the test to judge; an unexpected one fails it there
            results[entry["name"]] = {"ok": False, "error": f"{type(error).__name__}: {error}", "step": None}
            if "expect_error" not in entry:
                traceback.print_exc()
        barrier()  # rank 0's export (above) is complete before any rank starts the next job
        run = None
        gc.collect()
    if dist.is_main:
        with open(plan["results"], "w") as handle:
            json.dump(results, handle, indent=1)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
