"""Evaluation during training on real one-rank DeepSpeed runs (in this process): figures recomputed by hand
from the eval rows and the run's weights, a run with eval follows exactly the trajectory of one without, the
online eval's figures and eval_samples.jsonl agree with each other, keep_best keeps and `export-hf --best`
exports the best checkpoint, and bad eval settings are refused before any rank works.
"""

from __future__ import annotations

import copy
import json
import math
from math import comb

import pytest
import torch
import torch.nn.functional as F

from astrai.config import ConfigError
from astrai.data.sources import load_rows
from astrai.export.cli import export_main
from astrai.export.weights import load_checkpoint_weights
from astrai.launch.job_checks import load_and_check
from astrai.strategies.dpo import completion_logprobs
from astrai.training.build import build_run
from astrai.training.loops import TRAIN_LOOPS
from tests.conftest import REPO

LLAMA = (
    "{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}"
)
GPT2 = "{model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 4, n_positions: 64}"  # dropouts 0.1: the RNG matters
JOB = """\
output_dir: {output_dir}
model: {{init: {model}, disable_dropout: {disable_dropout}}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
train: {{train_type: {train_type}, max_steps: {steps}, micro_batch_size: 2, lr: 5e-3, lr_schedule: constant, seed: 7}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
ONLINE = """\
rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 4}
reward: {function: "tests.unit.eval.test_eval:length_reward"}
"""
FILES = {"sft": "sft", "seq": "text", "dpo": "preference", "rm": "preference", "grpo": "prompts"}


def length_reward(responses: list[str]) -> list[float]:
    """Quarter of the response's characters: varies with every answer, passes (>= 1) from 4 characters."""
    return [len(text) / 4 for text in responses]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    for name in FILES.values():
        lines = (REPO / f"data/arithmetic/{name}.jsonl").read_text().splitlines(keepends=True)
        (folder / f"{name}.jsonl").write_text("".join(lines[:40]))
        (folder / f"{name}_eval.jsonl").write_text("".join(lines[100:106]))
    return folder


def write_job(folder, name, train_type, *, steps=3, model=LLAMA, disable_dropout="true", extra=""):
    config = folder / f"{name}.yaml"
    data = folder / f"{FILES[train_type]}.jsonl"
    text = JOB.format(
        output_dir=folder / name,
        model=model,
        disable_dropout=disable_dropout,
        data=data,
        train_type=train_type,
        steps=steps,
    )
    if "checkpoint:" not in extra:
        text += "checkpoint: {resume: never}\n"  # every test run starts fresh, whatever an earlier one left
    config.write_text(text + (ONLINE if train_type == "grpo" else "") + extra)
    return str(config)


def train(dist, config, *overrides):
    job = load_and_check(config, list(overrides))
    run = build_run(job, dist, config)
    TRAIN_LOOPS[run.strategy.loop](run)
    return run


def records(folder, name):
    return [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]


def eval_records(folder, name):
    return {record["step"]: record for record in records(folder, name) if "eval_s" in record}


def hand_loss(module, dataset) -> float:
    """Token-mean next-token cross-entropy of `module` over the loss tokens of every row, one row at a time."""
    module.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in dataset:
            ids, mask = torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"])
            logits = module(input_ids=ids[None]).logits[0, :-1]
            losses = F.cross_entropy(logits.float(), ids[1:], reduction="none")
            total += float(losses[mask[1:].bool()].sum())
            tokens += int(mask[1:].sum())
    assert tokens > 0
    return total / tokens


@pytest.mark.parametrize("train_type", ["sft", "seq"])
def test_eval_loss_is_the_token_mean_over_the_eval_rows(one_rank, folder, train_type):
    name = f"{train_type}_loss"
    extra = "eval: {holdout: 5, every_steps: 2}\ncheckpoint: {resume: never, every_steps: 2}\n"
    run = train(one_rank, write_job(folder, name, train_type, extra=extra))
    figures = eval_records(folder, name)
    assert sorted(figures) == [2, 3] and len(run.eval_dataset) == 5  # every 2 steps and the last
    final = hand_loss(run.engines["policy"].module, run.eval_dataset)  # the step-3 weights
    assert figures[3]["eval/loss"] == pytest.approx(final, rel=1e-5)
    assert figures[3]["eval/perplexity"] == pytest.approx(math.exp(final), rel=1e-5)
    # Step 2: its checkpoint's weights in a copy of the model.
    module = copy.deepcopy(run.engines["policy"].module)
    load_checkpoint_weights(module, folder / name / "checkpoints" / "step_00000002", run.tokenizer)
    assert figures[2]["eval/loss"] == pytest.approx(hand_loss(module, run.eval_dataset), rel=1e-5)
    assert figures[2]["eval/loss"] != figures[3]["eval/loss"]  # measured on other weights
    # The held-out examples are not trained on: the run's data is the rest of the prepared examples.
    rows = load_rows(str(folder / f"{FILES[train_type]}.jsonl"), "auto", folder / "cache")
    assert len(run.dataset) + len(run.eval_dataset) == len(run.strategy.prepare_data(rows)[0])


@pytest.mark.parametrize("precompute", ["false", "true"])
def test_dpo_eval_figures_by_hand(one_rank, folder, precompute):
    name = f"dpo_eval_{precompute}"
    extra = f"dpo: {{precompute_reference: {precompute}}}\neval: {{data_path: {folder / 'preference_eval.jsonl'}}}\n"
    config = write_job(folder, name, "dpo", extra=extra)
    run = train(one_rank, config)
    figures = eval_records(folder, name)[3]
    strategy, policy = run.strategy, run.engines["policy"]
    batch = strategy.collate([run.eval_dataset[i] for i in range(len(run.eval_dataset))])
    pairs = batch["input_ids"].shape[0] // 2
    with torch.no_grad():
        policy.module.eval()
        logps = completion_logprobs(policy.module, batch, vocab_size=len(strategy.tokenizer))
        if precompute == "true":
            reference = batch["reference_logps"]
        else:
            reference = completion_logprobs(strategy.reference.module, batch, vocab_size=len(strategy.tokenizer))
    beta = run.job.dpo.beta
    chosen = beta * (logps[:pairs] - reference[:pairs])
    rejected = beta * (logps[pairs:] - reference[pairs:])
    assert pairs == 6
    assert figures["eval/loss"] == pytest.approx(float(-F.logsigmoid(chosen - rejected).mean()), rel=1e-5)
    assert figures["eval/accuracy"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert figures["eval/margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5, abs=1e-7)


def test_rm_eval_figures_by_hand(one_rank, folder):
    """rm's held-out accuracy, margin and Bradley-Terry loss over the eval pairs, scored by the trained head."""
    name = "rm_eval"
    extra = f"eval: {{data_path: {folder / 'preference_eval.jsonl'}}}\n"
    run = train(one_rank, write_job(folder, name, "rm", extra=extra))
    figures = eval_records(folder, name)[3]
    batch = run.strategy.collate([run.eval_dataset[i] for i in range(len(run.eval_dataset))])
    module = run.engines["policy"].module.eval()
    with torch.no_grad():
        rewards = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).float()
    pairs = batch["input_ids"].shape[0] // 2
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    assert pairs == 6 and not torch.equal(chosen, rejected)  # a trained head tells the answers apart
    assert figures["eval/loss"] == pytest.approx(float(-F.logsigmoid(chosen - rejected).mean()), rel=1e-5)
    assert figures["eval/accuracy"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert figures["eval/margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5, abs=1e-7)
    assert figures["eval/chosen_reward"] == pytest.approx(float(chosen.mean()), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("train_type", ["sft", "grpo"])
def test_a_run_with_eval_follows_the_trajectory_of_one_without(one_rank, folder, train_type):
    """GPT-2 with its dropout on: any draw the eval took from the training RNG would change the losses."""
    eval_file = folder / f"{FILES[train_type]}_eval.jsonl"
    common = dict(steps=4, model=GPT2, disable_dropout="false")
    plain = write_job(folder, f"{train_type}_plain", train_type, **common)
    evaluated = write_job(
        folder,
        f"{train_type}_evaluated",
        train_type,
        **common,
        extra=f"eval: {{data_path: {eval_file}, every_steps: 1, at_start: true, pass_k: 2}}\n",
    )
    without, with_eval = train(one_rank, plain), train(one_rank, evaluated)
    losses = [(r["step"], r["loss"], r["grad_norm"]) for r in records(folder, f"{train_type}_plain")]
    same = [(r["step"], r["loss"], r["grad_norm"]) for r in records(folder, f"{train_type}_evaluated") if r["step"]]
    assert losses == same  # bit for bit
    assert sorted(eval_records(folder, f"{train_type}_evaluated")) == [0, 1, 2, 3, 4]
    weights = without.engines["policy"].module.state_dict()
    for key, value in with_eval.engines["policy"].module.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert with_eval.engines["policy"].module.training  # back in train mode after the evals


def test_online_figures_agree_with_eval_samples(one_rank, folder):
    name = "grpo_samples"
    extra = f"eval: {{data_path: {folder / 'prompts_eval.jsonl'}, at_start: true, pass_k: 2, samples_per_prompt: 3, "
    extra += "log_samples: 10, max_samples: 5}\n"
    run = train(one_rank, write_job(folder, name, "grpo", steps=2, extra=extra))
    samples = [json.loads(line) for line in (folder / name / "eval_samples.jsonl").read_text().splitlines()]
    assert [record["step"] for record in samples] == [0] * 5 + [2] * 5  # at start and at the end, 5 prompts each
    questions = [json.loads(line)["prompt"] for line in (folder / "prompts_eval.jsonl").read_text().splitlines()]
    for record in samples[5:]:
        assert questions[record["prompt_index"]] in record["prompt"]
        assert record["greedy"]["reward"] == len(record["greedy"]["response"]) / 4
        assert len(record["sampled"]) == 3
        for answer in record["sampled"]:
            assert answer["reward"] == len(answer["response"]) / 4
    figures = eval_records(folder, name)[2]
    last = samples[5:]
    sampled = [answer for record in last for answer in record["sampled"]]
    assert figures["eval/greedy_reward"] == pytest.approx(sum(r["greedy"]["reward"] for r in last) / 5)
    assert figures["eval/greedy_pass"] == pytest.approx(sum(r["greedy"]["reward"] >= 1 for r in last) / 5)
    assert figures["eval/sampled_reward"] == pytest.approx(sum(a["reward"] for a in sampled) / 15)
    assert figures["eval/sampled_truncated_frac"] == pytest.approx(sum(a["truncated"] for a in sampled) / 15)
    passes = [sum(a["reward"] >= 1 for a in record["sampled"]) for record in last]
    assert figures["eval/pass@2"] == pytest.approx(sum(1 - comb(3 - c, 2) / comb(3, 2) for c in passes) / 5)
    assert 0 < figures["eval/greedy_response_len"] <= 4
    assert len(run.eval_dataset) == 5


def test_keep_best_keeps_the_best_checkpoint_and_export_best_exports_it(one_rank, folder, tmp_path, capsys):
    name = "sft_best"
    extra = "eval: {holdout: 4, every_steps: 1}\n"
    extra += "checkpoint: {resume: never, every_steps: 1, keep_last: 1, keep_best: {metric: loss, mode: max}}\n"
    config = write_job(folder, name, "sft", steps=4, extra=extra)
    train(one_rank, config)
    figures = eval_records(folder, name)
    best_step = max(figures, key=lambda step: figures[step]["eval/loss"])
    assert best_step != 4  # the loss falls: the highest eval loss is an early checkpoint
    checkpoints = folder / name / "checkpoints"
    kept = sorted(path.name for path in checkpoints.glob("step_*"))
    assert kept == [f"step_{best_step:08d}", "step_00000004"]
    manifest = json.loads((checkpoints / f"step_{best_step:08d}" / "manifest.json").read_text())
    assert manifest["meta"]["eval"] == {k: v for k, v in figures[best_step].items() if k.startswith("eval/")}
    assert export_main([str(folder / name), str(tmp_path / "best"), "--best", "--no-verify"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "best")
    assert (tmp_path / "best" / "config.json").is_file()
    # Without keep_best in its job, --best names the problem.
    assert export_main([str(folder / "sft_loss"), str(tmp_path / "none"), "--best"]) == 1
    assert "no checkpoint.keep_best" in capsys.readouterr().err


def test_a_holdout_larger_than_the_data_is_refused(one_rank, folder):
    config = write_job(folder, "too_big", "sft", extra="eval: {holdout: 100}\n")
    with pytest.raises(ConfigError, match="eval.holdout 100 holds out 100 of the 40 prepared"):
        build_run(load_and_check(config, []), one_rank, config)


@pytest.mark.parametrize(
    ("train_type", "extra", "message"),
    [
        ("sft", "eval: {every_steps: 2}", "an eval section needs data: give exactly one of `eval.data_path`"),
        ("sft", "eval: {holdout: 2, data_path: x.jsonl}", "give exactly one of `eval.data_path` or `eval.holdout`"),
        ("sft", "eval: {holdout: 1.5}", "neither a fraction (< 1) nor a count"),
        ("sft", "eval: {data_path: /nowhere/eval.jsonl}", "eval.data_path: no file matches '/nowhere/eval.jsonl'"),
        ("sft", "eval: {holdout: 0}", "greater than 0"),
        ("sft", "eval: {holdout: 2, pass_k: 3, samples_per_prompt: 2}", "pass@k needs at least k"),
        (
            "sft",
            "eval: {holdout: 2}\ncheckpoint: {keep_best: {metric: accuracy, mode: max}}",
            "keep_best.metric 'eval/accuracy' is not one this job's eval reports (eval/loss, eval/perplexity)",
        ),
        ("dpo", "checkpoint: {keep_best: {metric: eval/loss, mode: min}}", "add an `eval:` section"),
        (
            "sft",
            "eval: {holdout: 2, every_steps: 2}\ncheckpoint: {every_steps: 3, keep_best: {metric: loss, mode: min}}",
            "checkpoint.every_steps (3) must be a multiple of eval.every_steps (2)",
        ),
        ("sft", "eval: {holdout: 2}\ncheckpoint: {keep_best: {metric: loss, mode: lowest}}", "'min' or 'max'"),
        ("grpo", "eval: {holdout: 2, pass_k: 3}", "eval.pass_k 3 > the 2 answers sampled per eval prompt"),
    ],
)
def test_bad_eval_settings_are_refused_before_any_rank_works(folder, train_type, extra, message):
    config = write_job(folder, "bad", train_type, extra=extra + "\n")
    with pytest.raises(ConfigError) as error:
        load_and_check(config, [])
    assert message in str(error.value), str(error.value)


def test_a_resumed_run_holds_out_the_same_examples_and_reports_the_same_evals(one_rank, folder):
    extra = "eval: {holdout: 0.1, every_steps: 2}\ncheckpoint: {every_steps: 2}\n"
    straight = train(one_rank, write_job(folder, "straight", "sft", steps=4, extra=extra))
    split = write_job(folder, "split", "sft", steps=4, extra=extra)
    train(one_rank, split, "train.max_steps=2")
    resumed = train(one_rank, split)  # resumes from step 2
    assert resumed.eval_dataset["input_ids"] == straight.eval_dataset["input_ids"]
    figures = {
        name: {
            step: {k: v for k, v in record.items() if k.startswith("eval/")}
            for step, record in eval_records(folder, name).items()
        }
        for name in ("straight", "split")
    }
    assert sorted(figures["split"]) == [2, 4] and figures["split"] == figures["straight"]  # bit for bit


def test_a_resume_drops_eval_samples_written_after_its_checkpoint(one_rank, folder):
    name = "grpo_resume"
    extra = f"eval: {{data_path: {folder / 'prompts_eval.jsonl'}, every_steps: 1, log_samples: 1}}\n"
    extra += "checkpoint: {every_steps: 1}\n"
    config = write_job(folder, name, "grpo", steps=3, extra=extra)
    train(one_rank, config, "train.max_steps=2")
    samples = folder / name / "eval_samples.jsonl"
    with open(samples, "a") as handle:  # what a run killed after step 3's eval, before its checkpoint, left
        handle.write(json.dumps({"step": 3, "prompt": "lost"}) + "\n" + '{"step": 3, "pro')
    train(one_rank, config)
    steps = [json.loads(line)["step"] for line in samples.read_text().splitlines()]
    assert steps == [1, 2, 3] and "lost" not in samples.read_text()


def test_the_progress_bar_keeps_showing_the_last_eval_figure(tmp_path):
    from astrai.observability.metrics import MetricsLog

    log = MetricsLog(tmp_path, is_main=True, total_steps=3, start_step=0, tensorboard=False, progress_bar=True)
    log.log(1, {"loss": 2.5, "eval/loss": 2.25, "eval/perplexity": 9.49, "eval_s": 0.1})
    log.log(2, {"loss": 2.0})
    assert "eval/loss=2.25" in log._bar.postfix and "loss=2" in log._bar.postfix
    log.log(3, {"loss": 1.5, "eval/loss": 1.75})
    assert "eval/loss=1.75" in log._bar.postfix
    log.close()
