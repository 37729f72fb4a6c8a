"""Packed vs padded on real DeepSpeed ranks (gloo, ZeRO-0: DeepSpeed all-reduces the gradients in backward),
for tests/integration/test_packing_ranks.py. For each job of the plan, every rank takes the same rows both
ways (sft, dpo: its rows of the plan; seq: its block with data.document_mask against the block's documents
as padded rows; grpo, online_ppo: its rollout of step 1, reference / critic targets computed both ways),
divides by the same global normaliser as the loop (`all_reduce_sum` of loss_weight), backpropagates through
the engine and records the rank-averaged gradients. Rank 0 writes, per job, the largest loss and gradient
difference and both global normalisers.

    deepspeed --num_gpus 2 tests/integration/packing_rank_worker.py --plan plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def length_reward(responses: list[str]) -> list[float]:
    """A reward that differs between the responses of a group, so advantages and gradients are not 0."""
    return [float(len(response)) for response in responses]


def gradients(engine) -> dict[str, torch.Tensor]:
    found = {name: p.grad.detach().clone() for name, p in engine.module.named_parameters() if p.grad is not None}
    for parameter in engine.module.parameters():
        parameter.grad = None
    return found


def backward(engine, strategy, compute, batch, all_reduce_sum):
    """One micro-batch as the loop runs it: global normaliser, loss, engine backward. Returns
    (global loss sum, normaliser, gradients averaged over ranks)."""
    world = torch.distributed.get_world_size()
    weight = all_reduce_sum(strategy.loss_weight(batch), engine.device)
    normalizer = max(weight, 1.0) / world
    output = compute(engine, batch, normalizer)
    engine.backward(output.loss)
    loss = all_reduce_sum(float(output.loss.detach()), engine.device)
    return loss, weight, gradients(engine)


def split_documents(block: list[int], eos: int) -> list[list[int]]:
    pieces, current = [], []
    for token in block:
        current.append(token)
        if token == eos:
            pieces.append(current)
            current = []
    return pieces + ([current] if current else [])


def offline_batches(run, rank: int) -> list[tuple[str, dict]]:
    """(setting to toggle, the rank's batch both ways) for sft / dpo / seq."""
    job, strategy = run.job, run.strategy
    rows = [run.dataset[i] for i in range(rank * 3, rank * 3 + 3)]
    if job.train.train_type == "seq":
        job.data.document_mask = True
        masked = strategy.collate(rows[:1])
        job.data.document_mask = False
        pieces = split_documents(rows[0]["input_ids"], run.tokenizer.eos_token_id)
        padded = strategy.collate([{"input_ids": piece, "loss_mask": [1] * len(piece)} for piece in pieces])
        return [("padded", padded), ("packed", masked)]
    job.data.packing = False
    padded = strategy.collate(rows)
    job.data.packing = True
    return [("padded", padded), ("packed", strategy.collate(rows))]


def minibatch_backward(engine, strategy, compute, micro_batches, all_reduce_sum):
    """One optimizer step's micro-batches as train_online runs them: one global normaliser (/ ranks x A),
    DeepSpeed's accumulation boundary marked on the last (ZeRO-0 then averages the gradients over the ranks),
    no update. Returns (global loss, normaliser units, gradients averaged over ranks)."""
    world, accumulation = torch.distributed.get_world_size(), strategy.job.train.grad_accum_steps
    weight = all_reduce_sum(sum(strategy.loss_weight(batch) for batch in micro_batches), engine.device)
    normalizer = max(weight, 1.0) / (world * accumulation)
    loss = 0.0
    for index, batch in enumerate(micro_batches):
        engine.set_accumulation_boundary(index == len(micro_batches) - 1)
        output = compute(engine, batch, normalizer)
        engine.backward(output.loss)
        loss += float(output.loss.detach()) / accumulation
    engine.set_accumulation_boundary(None)
    return all_reduce_sum(loss, engine.device) / world, weight, gradients(engine)


def online_results(run, all_reduce_sum, all_gather_objects) -> dict[str, dict]:
    """rl.packing off and on: frozen targets, then the policy (and critic) update of the first minibatch
    (with packing cut by train.micro_batch_tokens), and each rank's micro-batches (with loss tokens, in all)."""
    import copy

    job, strategy, policy = run.job, run.strategy, run.engines["policy"]
    sample = strategy.sample(policy, run.data.batches(), step=1, policy_version=0)
    results = {}
    for name, packing in (("padded", False), ("packed", True)):
        job.rl.packing = packing
        targets = strategy.frozen_targets(copy.copy(sample.rollout))
        micro_batches = next(iter(strategy.minibatches(targets, step=1, epoch=0)))
        results[name] = {"targets": targets}
        for part in strategy.engine_parts:  # the policy, and online_ppo's critic
            compute = strategy.compute_loss if part == "policy" else strategy.compute_critic_loss
            results[name][part] = minibatch_backward(
                run.engines[part], strategy, compute, micro_batches, all_reduce_sum
            )
        with_tokens = sum(int(batch["response_mask"].sum() > 0) for batch in micro_batches)
        results[name]["micro_batches"] = all_gather_objects([with_tokens, len(micro_batches)])
        results[name]["tokens"] = all_gather_objects(sorted(targets["attention_mask"].sum(dim=1).tolist()))
    return results


def train_one_step(run) -> dict:
    """rl.packing's real loop (astrai/training/loops.py) for the job's step: the optimizer steps DeepSpeed took."""
    from astrai.training.loops import train_online

    run.job.rl.packing = True
    before = run.engines["policy"].global_steps
    train_online(run)
    return {
        "optimizer_steps": run.engines["policy"].global_steps - before,
        "expected": run.strategy.optimizer_steps_per_step(torch.distributed.get_world_size()),
        "zero_stage": run.engines["policy"].zero_stage,
    }


def largest_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys(), (sorted(first), sorted(second))
    return max(float((first[key].float() - second[key].float()).abs().max()) for key in first)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    plan = json.loads(open(args.plan).read())

    from astrai.data.packing import attention_of
    from astrai.engine import (
        all_gather_objects,
        all_reduce_sum,
        set_log_format,
        setup_distributed,
        shutdown_distributed,
    )
    from astrai.launch.job_checks import load_and_check
    from astrai.training.build import build_run

    dist = setup_distributed(120)
    set_log_format(dist.rank, "WARNING")
    report = {}
    for entry in plan["runs"]:
        run = build_run(load_and_check(entry["config"], entry.get("set", [])), dist, entry["config"])
        for engine in run.engines.values():
            engine.train()
        if entry.get("loop_only"):  # the real loop alone (ZeRO-3: gradients are partitioned, not compared)
            report[entry["name"]] = {"loop": train_one_step(run)}
            run = None
            continue
        if run.strategy.loop == "offline":
            outcome = {}
            for setting, batch in offline_batches(run, dist.rank):
                batch = {k: v.to(dist.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                outcome[setting] = {
                    "policy": backward(
                        run.engines["policy"], run.strategy, run.strategy.compute_loss, batch, all_reduce_sum
                    )
                }
        else:
            outcome = online_results(run, all_reduce_sum, all_gather_objects)
        padded, packed = outcome["padded"], outcome["packed"]
        summary = {}
        for part in padded:
            if part in ("micro_batches", "tokens"):
                summary[part] = {"padded": padded[part], "packed": packed[part]}
                continue
            if part == "targets":
                summary["targets"] = largest_difference(padded["targets"], packed["targets"])
                continue
            (loss_a, weight_a, grads_a), (loss_b, weight_b, grads_b) = padded[part], packed[part]
            summary[part] = {
                "loss": abs(loss_a - loss_b),
                "loss_value": loss_a,
                "gradients": largest_difference(grads_a, grads_b),
                "gradient_scale": max(float(g.abs().max()) for g in grads_a.values()),
                "weights": [weight_a, weight_b],
            }
        summary["attention"] = attention_of(run.engines["policy"])
        if run.strategy.loop == "online":
            summary["loop"] = train_one_step(run)
        report[entry["name"]] = summary
        run = None
    if dist.is_main:
        with open(plan["results"], "w") as handle:
            json.dump(report, handle, indent=1)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
