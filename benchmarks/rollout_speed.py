"""Rollout speed: generated tokens/s of AstrAI's rollout (`astrai.rollout.generate_rollout`) against plain
transformers `generate` with KV cache on the same model and prompts, and, under ZeRO-3 on 2 ranks,
AstrAI's ZeRO-3 sampling (a plain copy, or one gather) against generating through DeepSpeed's per-module gathers.

    python benchmarks/rollout_speed.py                       # small model, 8 prompts x 64 new tokens
    python benchmarks/rollout_speed.py --size tiny --new-tokens 8 --repeats 1   (smoke size)

Launch 1 (1 rank, methods alternated in one process, `--repeats` rounds):
    generate          model.generate(do_sample, KV cache), the same sampling knobs as AstrAI
    generate_nocache  the same with use_cache=False (what the cache is worth)
    astrai_sampling   AstrAI's sampling step alone (sample_responses: generate on the engine's module)
    astrai_rollout    generate_rollout as a job runs it by default (rollout.behaviour_logprobs: auto, which
                      in fp32 keeps the behaviour log-probs from the sampling logits: no extra forward)
    astrai_rollout_recompute  generate_rollout with rollout.behaviour_logprobs: recompute (sampling, then
                      the behaviour log-probs recomputed by a forward of the engine; auto's choice in bf16)
Launch 2 (2 ranks, ZeRO-3):
    zero3_astrai_copy         AstrAI's default sampling step (rollout.zero3_generation: copy): a plain copy
                              allocated per rollout and filled one gathered parameter at a time
    zero3_gather_once         AstrAI with rollout.zero3_generation: gather (one gather of every parameter,
                              generate on the partitioned module, hooks still run)
    zero3_gather_per_forward  generate on the ZeRO-3 module, DeepSpeed gathering each module at each forward
    zero3_astrai_rollout      generate_rollout (sampling + behaviour log-probs), for reference
    zero3_plain_copy          the benchmark's own copy: state_dict under one gather into a prebuilt plain module
Tokens counted: generated tokens up to and including the first EOS, summed over ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_launch_arguments,
    child_env,
    command_line,
    deepspeed_command,
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
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rank")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-zero3", action="store_true")
    add_launch_arguments(parser, "rollout_speed")
    return parser.parse_args(argv)


def rollout_api_available() -> str | None:
    """None when astrai.rollout has the API this benchmark calls, else why not."""
    try:
        from astrai.rollout import PlainForward, Prompts, generate_rollout  # noqa: F401
        from astrai.rollout.generation import sample_responses, sampling_config  # noqa: F401
        from astrai.rollout.sequences import left_pad, response_mask  # noqa: F401
    except ImportError as error:
        return f"astrai.rollout has no usable API yet ({error})"
    return None


def worker(plan: dict) -> int:
    import torch
    import torch.distributed as dist

    from astrai.config.schema import DeepSpeedSection
    from astrai.engine import build_ds_config, make_engine, setup_distributed
    from astrai.models.tokenizer import load_tokenizer
    from astrai.rollout import PlainForward, Prompts, generate_rollout
    from astrai.rollout.generation import sample_responses, sampling_config
    from astrai.rollout.sequences import left_pad, response_mask
    from benchmarks.common import build_model

    info = setup_distributed(600)
    rank, world = info.rank, info.world_size
    tokenizer = load_tokenizer(plan["tokenizer"])
    tokens = torch.load(plan["tokens"])["input_ids"]
    first = rank * plan["prompts"]
    prompt_ids = [row[: plan["prompt_len"]].tolist() for row in tokens[first : first + plan["prompts"]]]
    settings = SimpleNamespace(group_size=1, max_new_tokens=plan["new_tokens"], temperature=1.0, top_p=1.0, top_k=0)
    init = model_init(plan["size"], plan["prompt_len"] + plan["new_tokens"])
    stage = plan["stage"]
    config = build_ds_config(
        DeepSpeedSection(zero_stage=stage),
        template_path=None,
        micro_batch_size=plan["prompts"],
        grad_accum_steps=1,
        max_grad_norm=1.0,
        precision="fp32",
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        world_size=world,
    )
    engine = make_engine(build_model(init, 0), config, weight_decay=0.0, schedule=lambda _: 1.0)
    plain_model = build_model(init, 0).eval() if stage != 3 else None
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)

    def count(responses) -> float:
        local = float(response_mask(responses, tokenizer.eos_token_id).sum())
        if world > 1:
            tensor = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(tensor)
            return float(tensor.item())
        return local

    @torch.no_grad()
    def plain_generate(model, use_cache: bool, synced: bool = False):
        generation = sampling_config(settings, tokenizer)
        generation.use_cache = use_cache
        torch.manual_seed(1234 + rank)
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=generation, synced_gpus=synced)[
            :, ids.shape[1] :
        ]

    def astrai_rollout(source: str = "auto"):
        result = generate_rollout(
            engine,
            tokenizer,
            Prompts(prompt_ids, [[] for _ in prompt_ids], [{} for _ in prompt_ids]),
            SimpleNamespace(**vars(settings), behaviour_logprobs=source),
            seed=1234 + rank,
            scoring=PlainForward(settings.temperature, len(tokenizer)),  # the rank's prompts in one forward
        )
        assert result.behaviour_logprobs is not None
        return result.response_ids

    def zero3_plain_copy():
        # What a hook-free ZeRO-3 rollout could do: gather once, copy the full weights into a plain
        # (non-ZeRO) module, generate there; DeepSpeed's per-module hooks never run.
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            copy_model.load_state_dict(engine.module.state_dict())
        return plain_generate(copy_model, True)

    if stage == 3:
        copy_model = build_model(init, 0).eval()
        gather_settings = SimpleNamespace(**vars(settings), zero3_generation="gather")
        methods = {
            "zero3_gather_once": lambda: sample_responses(engine, ids, mask, gather_settings, tokenizer),
            "zero3_astrai_copy": lambda: sample_responses(engine, ids, mask, settings, tokenizer),
            "zero3_gather_per_forward": lambda: plain_generate(engine.module, True, synced=world > 1),
            "zero3_astrai_rollout": astrai_rollout,
            "zero3_plain_copy": zero3_plain_copy,
        }
    else:
        methods = {
            "generate": lambda: plain_generate(plain_model, True),
            "generate_nocache": lambda: plain_generate(plain_model, False),
            "astrai_sampling": lambda: sample_responses(engine, ids, mask, settings, tokenizer),
            "astrai_rollout": astrai_rollout,
            "astrai_rollout_recompute": lambda: astrai_rollout("recompute"),
        }
    names = list(methods)
    for name in names:  # warm-up of each method (allocations, first-call paths); not measured
        if "nocache" not in name:
            methods[name]()
    records = []
    for repeat in range(plan["repeats"]):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            if world > 1:
                dist.barrier()
            started = time.perf_counter()
            responses = methods[name]()
            seconds = time.perf_counter() - started
            if world > 1:
                tensor = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
                seconds = float(tensor.item())
            generated = count(responses)
            records.append(
                {
                    "method": name,
                    "repeat": repeat,
                    "seconds": seconds,
                    "tokens": generated,
                    "tokens_per_s": generated / seconds,
                }
            )
    if rank == 0:
        Path(plan["out"]).write_text(json.dumps({"world_size": world, "stage": stage, "records": records}))
    dist.destroy_process_group()
    return 0


RATIOS = [
    (
        "astrai_rollout",
        "generate",
        "AstrAI rollout (sampling + behaviour log-probs; the default, auto: sampler in fp32) vs generate with KV "
        "cache (target >= 1.0)",
    ),
    (
        "astrai_rollout_recompute",
        "generate",
        "AstrAI rollout with rollout.behaviour_logprobs: recompute vs generate with KV cache",
    ),
    (
        "astrai_rollout",
        "astrai_rollout_recompute",
        "behaviour log-probs kept from the sampler vs recomputed by a forward",
    ),
    (
        "astrai_rollout",
        "astrai_sampling",
        "AstrAI rollout (default) vs its sampling alone: the cost of keeping the log-probs",
    ),
    ("astrai_sampling", "generate", "AstrAI sampling alone vs generate with KV cache"),
    ("generate_nocache", "generate", "generate without KV cache vs with"),
    (
        "zero3_gather_once",
        "zero3_gather_per_forward",
        "ZeRO-3, 2 ranks: sampling with one gather per rollout vs per-module gathers at every forward",
    ),
    (
        "zero3_plain_copy",
        "zero3_gather_per_forward",
        "ZeRO-3, 2 ranks: gather once into a plain copy (no hooks) vs per-module gathers",
    ),
    ("zero3_plain_copy", "zero3_gather_once", "ZeRO-3, 2 ranks: plain copy vs AstrAI's gather-once sampling"),
    (
        "zero3_astrai_copy",
        "zero3_gather_per_forward",
        "ZeRO-3, 2 ranks: AstrAI's default sampling (plain copy, filled per parameter) vs per-module gathers (target "
        ">= 1.0)",
    ),
    (
        "zero3_astrai_copy",
        "zero3_plain_copy",
        "ZeRO-3, 2 ranks: AstrAI's plain copy vs the benchmark's own (state_dict under one gather)",
    ),
    (
        "zero3_astrai_rollout",
        "zero3_gather_per_forward",
        "ZeRO-3, 2 ranks: whole AstrAI rollout vs generate with per-module gathers",
    ),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    unavailable = rollout_api_available()
    if unavailable:
        payload = {"benchmark": "rollout_speed", "command": command_line(), "machine": info, "skipped": unavailable}
        write_results(args.name, payload, f"### Rollout speed\n\nSkipped: {unavailable}.", results_dir)
        return 0
    started = time.perf_counter()
    data = prepare_sft_data(work / "data", 2 * args.prompts, max(args.prompt_len, 32))
    records = []
    launches = [(1, 0)] + ([] if args.skip_zero3 else [(2, 3)])
    for ranks, stage in launches:
        plan = {
            "size": args.size,
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "stage": stage,
            "tokenizer": str(data["tokenizer"]),
            "tokens": str(data["tokens"]),
            "out": str(work / f"z{stage}.json"),
        }
        (work / f"plan_z{stage}.json").write_text(json.dumps(plan))
        result = launch(
            deepspeed_command(ranks, Path(__file__).resolve(), "--worker", str(work / f"plan_z{stage}.json")),
            env=child_env(),
            timeout=1800,
            log=work / f"z{stage}.log",
        )
        require_success(result, f"the rollout launch ({ranks} ranks, ZeRO-{stage})")
        records += json.loads(Path(plan["out"]).read_text())["records"]
    by = {(r["method"], r["repeat"]): r for r in records}
    methods = sorted({r["method"] for r in records}, key=lambda m: [r["method"] for r in records].index(m))
    summary = {m: summarize([r["tokens_per_s"] for r in records if r["method"] == m]) for m in methods}
    ratios = []
    for method, baseline, label in RATIOS:
        values = [
            by[(method, k)]["tokens_per_s"] / by[(baseline, k)]["tokens_per_s"]
            for k in range(args.repeats)
            if (method, k) in by and (baseline, k) in by
        ]
        if values:
            ratios.append({"method": method, "baseline": baseline, "label": label, **summarize(values)})
    init = model_init(args.size, args.prompt_len + args.new_tokens)
    payload = {
        "benchmark": "rollout_speed",
        "command": command_line(),
        "machine": info,
        "settings": vars(args),
        "model": init,
        "parameters": parameter_count(init),
        "summary": summary,
        "ratios": ratios,
        "runs": records,
        "total_s": time.perf_counter() - started,
    }
    lines = [
        f"### Rollout speed ({payload['parameters'] / 1e6:.1f}M-parameter Llama, {args.prompts} prompts per rank x "
        f"{args.new_tokens} new tokens, prompt {args.prompt_len} tokens, fp32, {args.repeats} rounds)",
        "",
        machine_line(info),
        "",
        markdown_table(
            ["comparison", "ratio of generated tokens/s", "rounds"],
            [[r["label"], fmt_summary(r), r["n"]] for r in ratios],
        ),
        "",
        markdown_table(
            ["method", "generated tokens/s (all ranks)"], [[m, fmt_summary(s, 0)] for m, s in summary.items()]
        ),
        "",
        f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min).",
    ]
    write_results(args.name, payload, "\n".join(lines), results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
