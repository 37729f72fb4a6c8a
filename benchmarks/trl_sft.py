"""TRL's SFTTrainer over the benchmark's model and data; run by trainer_overhead.py with the python of
benchmarks/.venv-trl (TRL never enters the project's own environment).

Same model (built from the same init block and seed), same pre-tokenised rows and loss mask, same
batch, AdamW betas and clipping; fp32 (bf16 off), gradient checkpointing off, no saving, no eval.
Prints `BENCH step N` after each step and writes per-step times to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from benchmarks.common import build_model

    data = torch.load(args.tokens)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(args.tokens), "tokenizer"))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.Dataset.from_dict(
        {"input_ids": data["input_ids"].tolist(), "completion_mask": data["loss_mask"].tolist()}
    )
    model = build_model(json.loads(args.model), 42)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):
            self.begun = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            times.append(time.perf_counter() - self.begun)
            print(f"BENCH step {state.global_step}", flush=True)

    config = SFTConfig(
        output_dir=os.path.join(os.path.dirname(args.out), "trl_output"),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        max_length=data["input_ids"].shape[1],
        packing=False,
        completion_only_loss=True,
        dataloader_num_workers=0,
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()]
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    tokens = args.micro_batch * data["input_ids"].shape[1]
    with open(args.out, "w") as handle:
        json.dump(
            {
                "mode": "trl",
                "trl": trl.__version__,
                "threads": torch.get_num_threads(),
                "setup_s": setup_s,
                "steps": [
                    {
                        "step": i + 1,
                        "seconds": s,
                        "tokens": tokens,
                        "tokens_per_s": tokens / s,
                        "forward_s": 0.0,
                        "backward_s": s,
                        "optimizer_step_s": 0.0,
                    }
                    for i, s in enumerate(times)
                ],
            },
            handle,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
