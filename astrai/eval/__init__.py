"""Held-out evaluation during training (`eval:` in the job) and the best checkpoint it ranks (`keep_best`).

evaluator.py  when an eval runs and what the loops get (Evaluator), the checks of keep_best before any rank starts
data.py       the eval examples: eval.data_path prepared like the training data, or eval.holdout held out of it
offline.py    seq/sft/dpo (any offline train type): Strategy.eval_sums summed over every rank, Strategy.eval_metrics
rollout_eval.py grpo/online_ppo: greedy and sampled answers to held-out prompts, rewards, pass@k, eval_samples.jsonl
isolation.py  no gradients, eval mode, every RNG restored: the run's trajectory is untouched
"""
