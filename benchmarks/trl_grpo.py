"""TRL's GRPOTrainer over the benchmark's model, prompts and reward; run by grpo_vs_trl.py with the python of
benchmarks/.venv-trl (TRL never enters the project's own environment).

Same model (built from the same init block and seed), same tokenizer and chat template, same prompts (the
shipped arithmetic prompts as one user message each), same exact-match reward, group size, new tokens,
prompts per step, temperature, clip range and KL coefficient as AstrAI's job; one optimizer step per
generation batch (num_iterations 1, steps_per_generation = gradient_accumulation_steps); fp32, no vLLM,
no saving, no eval, no logging. Writes the wall time of every step (end to end: generation, reward,
reference log-probs, update) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def exact_match(completions, answer, **_):
    """AstrAI's `astrai.rollout.rewards:arithmetic_exact_match`, in TRL's reward signature. Conversational prompts
    give conversational completions ([{"role": "assistant", "content": text}]): the text is the last message's."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(str(text).strip() == str(expected).strip()) for text, expected in zip(texts, answer)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the init block (JSON)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--prompts", required=True, help="jsonl of {prompt, answer}")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--kl-coef", type=float, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.common import build_model

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": row["prompt"]}] for row in rows],
            "answer": [row["answer"] for row in rows],
        }
    )
    # Saved and passed by path: with beta > 0 TRL loads its reference model from the policy's path.
    model_dir = os.path.join(os.path.dirname(args.out), "trl_model")
    model = build_model(json.loads(args.model), 42)
    # Stop at the tokenizer's EOS only, as AstrAI does: TRL also stops at the model config's eos_token_id, which is
    # Llama's default (2) here, another token of this char tokenizer (<|im_start|>).
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    responses = args.prompts_per_step * args.group_size
    if responses % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} does not divide {responses} responses")
    accumulation = responses // args.micro_batch
    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, _args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, _args, state, control, **kwargs):
            ends.append(time.perf_counter())
            print(f"BENCH step {state.global_step}", flush=True)

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(args.out), "trl_output"),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,  # one generation batch = one optimizer step
        num_iterations=1,
        num_generations=args.group_size,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=args.kl_coef,
        epsilon=0.2,
        loss_type="dapo",  # token mean over the whole batch, as AstrAI's loss_aggregation: token_mean
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_vllm=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=10**9,
        log_completions=False,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    with open(args.out, "w") as handle:
        json.dump(
            {
                "mode": "trl",
                "trl": trl.__version__,
                "threads": torch.get_num_threads(),
                "setup_s": setup_s,
                "step_seconds": [b - a for a, b in zip(ends, ends[1:])],
            },
            handle,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
