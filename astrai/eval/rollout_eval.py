"""Eval of the online train types (`grpo`, `online_ppo`): held-out prompts answered by the current policy,
greedily and with the training sampler, scored by the job's reward.

Figures (means over every eval prompt of every rank; `eval/` is prefixed by the caller):
    greedy_reward, greedy_reward_<component>   the greedy answer's reward (components: a `reward.components` job)
    greedy_pass                                 fraction of prompts whose greedy answer passes
    greedy_response_len, greedy_truncated_frac  tokens (EOS included) and answers without EOS in max_new_tokens
    sampled_reward, sampled_reward_<component>, sampled_response_len, sampled_truncated_frac
                                                the same over `eval.samples_per_prompt` sampled answers per prompt
    pass@<k>                                    Codex's unbiased pass@k (`eval.pass_k`) from those answers
An answer passes when its total reward is at least `eval.pass_threshold`. rl.overlong_penalty is a training
device and is not added to eval rewards.

Determinism: the sampled answers of eval prompt i are drawn from their own seed, `sampling_seed(train.seed, 0, i,
EVAL_STREAM)`, one generate call per prompt: the same prompt gets the same draws at every eval (the figures of
two steps differ by the weights, not by the luck of the draw) and on any number of ranks. Greedy answers are
batched over a rank's prompts (left padding). Generation runs in forked RNGs: the training RNG is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from astrai.algos.pass_at_k import pass_at_k
from astrai.eval.data import rank_share
from astrai.rollout import generate_rollout, reward_inputs, sampling_seed
from astrai.rollout.prompts import Prompts
from astrai.safe_write import fsync_path

EVAL_STREAM = 2**40  # seed streams: 0 samples, 1 + epoch shuffles replay, 2**32 + round is dynamic sampling's
SAMPLES_FILE = "eval_samples.jsonl"
FIXED_NAMES = (
    "greedy_reward",
    "greedy_pass",
    "greedy_response_len",
    "greedy_truncated_frac",
    "sampled_reward",
    "sampled_response_len",
    "sampled_truncated_frac",
)


def samples_per_prompt(job) -> int:
    return job.eval.samples_per_prompt or job.rollout.group_size


def online_metric_names(job) -> list[str]:
    """The figures an online eval of `job` reports (components only where `reward.components` name them)."""
    names = [*FIXED_NAMES, f"pass@{job.eval.pass_k}"]
    components = job.reward.components if job.reward is not None else None
    if components and len(components) > 1:
        names += [f"{kind}_reward_{c.name}" for kind in ("greedy", "sampled") for c in components if c.name]
    return names


class HeldModule:
    """An engine whose generation module is already held (ZeRO-3's gathered copy made once for the whole eval,
    not once per generate call); what `generate_rollout` reads of an engine when it takes no log-probs."""

    def __init__(self, engine, module):
        self.device, self.zero_stage, self.module = engine.device, engine.zero_stage, module
        self.precision = getattr(engine, "precision", None)

    @contextlib.contextmanager
    def generation_module(self, zero3_mode: str = "copy"):
        yield self.module


def _scored(strategy, rollout):
    """(total rewards [N] float64 on the CPU, {component: [N]}) of the rollout's answers, without penalties."""
    scores = strategy.reward(reward_inputs(rollout))
    return scores.total.double().cpu(), {name: values.double().cpu() for name, values in scores.components.items()}


def _add_answers(sums: dict, kind: str, rollout, total: torch.Tensor, components: dict, keep: int) -> None:
    """Add the first `keep` answers' sums of one kind (greedy or sampled) to `sums`."""
    sums[f"{kind}_reward"] += float(total[:keep].sum())
    for name, values in components.items():
        sums[f"{kind}_reward_{name}"] += float(values[:keep].sum())
    sums[f"{kind}_tokens"] += float(rollout.response_mask[:keep].sum())
    sums[f"{kind}_truncated"] += float(rollout.truncated[:keep].sum())


def online_eval_sums(run, step: int) -> tuple[dict[str, float], list[dict]]:
    """This rank's sums over its share of the eval prompts, and the records for eval_samples.jsonl (rank 0)."""
    job, strategy, policy, dataset = run.job, run.strategy, run.engines["policy"], run.eval_dataset
    settings, samples = job.eval, samples_per_prompt(job)
    greedy = job.rollout.model_copy(update={"group_size": 1, "temperature": 1.0, "top_k": 1, "top_p": 1.0})
    sampled = job.rollout.model_copy(update={"group_size": samples})
    own, per_rank = rank_share(len(dataset), run.dist.rank, run.dist.world_size)
    chunk = max(1, strategy.geometry.prompts_per_rank)
    keys = ["prompts", "sampled_responses", "greedy_pass", "pass_at_k"]
    keys += [f"{kind}_{what}" for kind in ("greedy", "sampled") for what in ("reward", "tokens", "truncated")]
    sums: dict[str, float] = defaultdict(float, dict.fromkeys(keys, 0.0))
    records: list[dict] = []
    with policy.generation_module(job.rollout.zero3_generation) as module:
        held = HeldModule(policy, module)
        for start in range(0, per_rank, chunk):
            indices = own[start : start + chunk]
            count = min(chunk, per_rank - start)  # every rank makes the same calls: ZeRO-3's may be collectives
            padded = indices + [own[0] if own else 0] * (count - len(indices))
            prompts = Prompts.from_examples([dataset[index] for index in padded])
            seed = sampling_seed(job.train.seed, 0, 0, stream=EVAL_STREAM)
            answers = generate_rollout(held, strategy.tokenizer, prompts, greedy, seed=seed)  # no behaviour log-probs
            total, components = _scored(strategy, answers)
            _add_answers(sums, "greedy", answers, total, components, len(indices))
            sums["greedy_pass"] += float((total[: len(indices)] >= settings.pass_threshold).sum())
            for position, index in enumerate(padded):
                seed = sampling_seed(job.train.seed, 0, index, stream=EVAL_STREAM)
                draws = generate_rollout(held, strategy.tokenizer, prompts[position : position + 1], sampled, seed=seed)
                sampled_total, sampled_components = _scored(strategy, draws)
                real = position < len(indices)
                _add_answers(sums, "sampled", draws, sampled_total, sampled_components, samples if real else 0)
                correct = (sampled_total >= settings.pass_threshold).sum().reshape(1)
                sums["pass_at_k"] += float(pass_at_k(correct, samples, settings.pass_k)[0]) if real else 0.0
                sums["prompts"] += float(real)
                sums["sampled_responses"] += float(samples if real else 0)
                if real and len(records) < settings.log_samples:
                    records.append(_sample_record(step, index, answers, position, total, draws, sampled_total))
    return sums, records


def _sample_record(step, index, answers, position, total, draws, sampled_total) -> dict:
    return {
        "step": step,
        "prompt_index": index,
        "prompt": answers.prompt_texts[position],
        "greedy": {
            "response": answers.response_texts[position],
            "reward": float(total[position]),
            "truncated": bool(answers.truncated[position]),
        },
        "sampled": [
            {"response": text, "reward": float(reward), "truncated": bool(cut)}
            for text, reward, cut in zip(draws.response_texts, sampled_total, draws.truncated)
        ],
    }


def online_figures(totals: dict[str, float], pass_k: int) -> dict[str, float]:
    """Global sums of `online_eval_sums` -> the figures of the module docstring."""
    prompts, responses = max(totals["prompts"], 1.0), max(totals["sampled_responses"], 1.0)
    figures = {
        "greedy_reward": totals["greedy_reward"] / prompts,  # first: the progress bar shows the first figure
        "greedy_pass": totals["greedy_pass"] / prompts,
        f"pass@{pass_k}": totals["pass_at_k"] / prompts,
        "greedy_response_len": totals["greedy_tokens"] / prompts,
        "greedy_truncated_frac": totals["greedy_truncated"] / prompts,
        "sampled_response_len": totals["sampled_tokens"] / responses,
        "sampled_truncated_frac": totals["sampled_truncated"] / responses,
    }
    for key, value in totals.items():
        if key.startswith("greedy_reward"):
            figures[key] = value / prompts
        elif key.startswith("sampled_reward"):
            figures[key] = value / responses
    return figures


def append_records(path: Path, records: list[dict]) -> None:
    """Append JSON lines durably (one write, flush, fsync); a line torn by a kill is dropped by the trim at the
    next start (`trim_metrics`, as metrics.jsonl)."""
    if not records:
        return
    created = not path.exists()
    with open(path, "ab") as handle:
        handle.write("".join(json.dumps(record) + "\n" for record in records).encode())
        handle.flush()
        os.fsync(handle.fileno())
    if created:
        fsync_path(path.parent)  # the new file's name is durable too
