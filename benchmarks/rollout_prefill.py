"""Rollout with one prefill per prompt group (`rollout.share_prefill`) against the same rollout prefilling every
copy of each prompt, and against plain transformers `generate` (KV cache, its own sampling) on the repeated
prompts, which is what TRL's GRPOTrainer runs: same model, prompts, group size and sampling knobs, one process.

    python benchmarks/rollout_prefill.py                               # small model, 8 prompts x 8, prompts 64/256
    python benchmarks/rollout_prefill.py --size tiny --new-tokens 4 --prompt-lens 8 --repeats 1   (smoke size)

Methods, alternated round by round (`--repeats` rounds after one warm-up each), for every prompt length:
    generate          model.generate(do_sample=True) on prompts x group_size rows (each prompt repeated)
    rollout_unshared  astrai.rollout.generate_rollout with rollout.share_prefill: false (every copy prefilled)
    rollout_shared    generate_rollout with rollout.share_prefill: true (the default): each prompt prefilled once
Both rollouts keep the behaviour log-probs from the sampler (`auto` in fp32). The engine is a stand-in around the
plain module (what `Engine.generation_module` yields below ZeRO-3), so no ranks are launched. Prompt lengths vary
between half of and the full `--prompt-lens` value (left padding in every batch). Per round the two rollouts draw
the same seed; the benchmark records whether their tokens are identical. Measured: generated tokens/s (tokens up
to and including the first EOS) and the rollout's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    build_model,
    command_line,
    fmt_summary,
    fresh_workspace,
    machine_line,
    markdown_table,
    model_init,
    parameter_count,
    prepare_sft_data,
    summarize,
    write_results,
)

METHODS = ("generate", "rollout_unshared", "rollout_shared")
RATIOS = [
    ("rollout_shared", "rollout_unshared", "rollout, one prefill per group vs every copy prefilled"),
    ("rollout_shared", "generate", "rollout with shared prefill vs plain generate (TRL's way)"),
    ("rollout_unshared", "generate", "rollout without shared prefill vs plain generate"),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts per rollout")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-lens", default="64,256", help="comma-separated longest prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default="rollout_prefill")
    return parser.parse_args(argv)


class PlainEngine:
    """What generate_rollout needs of `astrai.engine.Engine` below ZeRO-3, around a bare fp32 module."""

    zero_stage = 0
    precision = "fp32"

    def __init__(self, module):
        import torch

        self.module, self.device = module, torch.device("cpu")

    def __call__(self, **inputs):
        return self.module(**inputs)

    @contextlib.contextmanager
    def generation_module(self, zero3_mode: str = "copy"):
        yield self.module


def measure(args, prompt_len: int, data: dict, model, tokenizer) -> tuple[list[dict], list[bool]]:
    import torch

    from astrai.rollout import PlainForward, Prompts, generate_rollout
    from astrai.rollout.generation import sampling_config
    from astrai.rollout.sequences import left_pad, response_mask

    rows = torch.load(data["tokens"])["input_ids"]
    generator = torch.Generator().manual_seed(prompt_len)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (args.prompts,), generator=generator).tolist()
    prompt_ids = [rows[index][:length].tolist() for index, length in enumerate(lengths)]
    knobs = dict(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, behaviour_logprobs="auto")
    settings = {
        share: SimpleNamespace(group_size=args.group_size, share_prefill=share, **knobs) for share in (True, False)
    }
    repeated_ids, repeated_mask = left_pad(
        [ids for ids in prompt_ids for _ in range(args.group_size)], tokenizer.pad_token_id
    )
    engine = PlainEngine(model)
    scoring = PlainForward(temperature=1.0, vocab_size=len(tokenizer))  # all sequences in one forward

    def rollout(share: bool, seed: int):
        prompts = Prompts(prompt_ids, [[] for _ in prompt_ids], [{} for _ in prompt_ids])
        result = generate_rollout(engine, tokenizer, prompts, settings[share], seed=seed, scoring=scoring)
        assert result.behaviour_logprobs is not None
        return result.response_ids

    @torch.no_grad()
    def generate(seed: int):
        torch.manual_seed(seed)
        output = model.generate(
            input_ids=repeated_ids,
            attention_mask=repeated_mask,
            generation_config=sampling_config(settings[False], tokenizer),
        )
        return output[:, repeated_ids.shape[1] :]

    methods = {
        "generate": generate,
        "rollout_unshared": lambda seed: rollout(False, seed),
        "rollout_shared": lambda seed: rollout(True, seed),
    }
    for name in METHODS:  # warm-up, not measured
        methods[name](0)
    records, identical = [], []
    for repeat in range(args.repeats):
        responses = {}
        for name in METHODS[repeat % 3 :] + METHODS[: repeat % 3]:
            started = time.perf_counter()
            responses[name] = methods[name](1000 + repeat)
            seconds = time.perf_counter() - started
            tokens = float(response_mask(responses[name], tokenizer.eos_token_id).sum())
            records.append(
                {
                    "prompt_len": prompt_len,
                    "method": name,
                    "repeat": repeat,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                }
            )
        identical.append(torch.equal(responses["rollout_shared"], responses["rollout_unshared"]))
        print(f"prompt {prompt_len}, round {repeat + 1}/{args.repeats} done", flush=True)
    return records, identical


def main(argv=None) -> int:
    import torch

    from astrai.models.tokenizer import load_tokenizer

    args = parse_args(argv)
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    started = time.perf_counter()
    prompt_lens = [int(value) for value in args.prompt_lens.split(",")]
    longest = max(prompt_lens)
    data = prepare_sft_data(work / "data", args.prompts, max(longest, 32))
    tokenizer = load_tokenizer(str(data["tokenizer"]))
    init = model_init(args.size, longest + args.new_tokens)
    model = build_model(init, 0).eval()
    records, identical = [], {}
    with torch.no_grad():
        for prompt_len in prompt_lens:
            measured, same = measure(args, prompt_len, data, model, tokenizer)
            records += measured
            identical[prompt_len] = same
    by = {(r["prompt_len"], r["method"], r["repeat"]): r for r in records}
    summary, ratios = {}, []
    for prompt_len in prompt_lens:
        for method in METHODS:
            values = [r["tokens_per_s"] for r in records if r["prompt_len"] == prompt_len and r["method"] == method]
            summary[f"{method} (prompt {prompt_len})"] = summarize(values)
        for method, baseline, label in RATIOS:
            values = [
                by[(prompt_len, method, k)]["tokens_per_s"] / by[(prompt_len, baseline, k)]["tokens_per_s"]
                for k in range(args.repeats)
            ]
            ratios.append({"prompt_len": prompt_len, "label": label, **summarize(values)})
    payload = {
        "benchmark": "rollout_prefill",
        "command": command_line(),
        "machine": info,
        "settings": vars(args),
        "model": init,
        "parameters": parameter_count(init),
        "summary": summary,
        "ratios": ratios,
        "identical_tokens": identical,
        "runs": records,
        "total_s": time.perf_counter() - started,
    }
    lines = [
        f"### Rollout prefill sharing ({payload['parameters'] / 1e6:.1f}M-parameter Llama, {args.prompts} prompts x "
        f"group {args.group_size}, {args.new_tokens} new tokens, prompts L/2..L tokens, fp32, {args.repeats} rounds)",
        "",
        machine_line(info),
        "",
        markdown_table(
            ["longest prompt L", "comparison", "ratio of generated tokens/s", "rounds"],
            [[r["prompt_len"], r["label"], fmt_summary(r), r["n"]] for r in ratios],
        ),
        "",
        markdown_table(["method", "generated tokens/s"], [[m, fmt_summary(s, 0)] for m, s in summary.items()]),
        "",
        "Shared and unshared rollouts sampled identical tokens in "
        f"{sum(map(sum, identical.values()))} of {sum(map(len, identical.values()))} rounds (same seed).",
        "",
        f"Command: `{payload['command']}` ({payload['total_s'] / 60:.1f} min).",
    ]
    write_results(args.name, payload, "\n".join(lines), results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
