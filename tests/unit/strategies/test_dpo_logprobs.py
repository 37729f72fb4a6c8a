"""`dpo`'s completion log-probs with a real tiny transformers model: IPO scores each completion by
its per-token average log-prob (the IPO paper's length normalisation), the other losses by the sum."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.config import load_job
from astrai.models.tokenizer import build_tokenizer
from astrai.strategies.dpo import DpoStrategy, completion_logprobs

JOB = """\
output_dir: {folder}/out
model: {{init: {{model_type: llama}}}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {folder}/pairs.jsonl}}
train: {{train_type: dpo, micro_batch_size: 2, max_steps: 1}}
dpo: {{beta: 0.5}}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo_logprobs")
    (folder / "job.yaml").write_text(JOB.format(folder=folder))
    tokenizer = build_tokenizer("char", ["0123456789+-= \n"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    ).eval()
    # Two pairs; completions of 1, 3, 2 and 4 tokens, so an average differs from a sum.
    rows = [
        {
            "chosen_ids": [5, 6, 7, 8],
            "chosen_mask": [0, 0, 0, 1],
            "rejected_ids": [5, 6, 9, 10, 11],
            "rejected_mask": [0, 0, 1, 1, 1],
        },
        {
            "chosen_ids": [7, 8, 12, 13],
            "chosen_mask": [0, 0, 1, 1],
            "rejected_ids": [7, 8, 14, 15, 16, 17],
            "rejected_mask": [0, 0, 1, 1, 1, 1],
        },
    ]
    return folder, tokenizer, model, rows


def by_hand(model, rows, average: bool) -> list[float]:
    """Each sequence alone (no padding): log p(token t | tokens < t) over its masked tokens, summed or averaged."""
    values = []
    for ids, mask in [(r["chosen_ids"], r["chosen_mask"]) for r in rows] + [
        (r["rejected_ids"], r["rejected_mask"]) for r in rows
    ]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        terms = [float(torch.log_softmax(logits[t - 1], -1)[ids[t]]) for t in range(1, len(ids)) if mask[t]]
        values.append(sum(terms) / len(terms) if average else sum(terms))
    return values


def strategy(folder, tokenizer, loss):
    return DpoStrategy(load_job(folder / "job.yaml", [f"dpo.loss={loss}"], check_paths=False), tokenizer)


@pytest.mark.parametrize("average", [False, True])
def test_completion_logprobs_sum_or_average(setup, average):
    folder, tokenizer, model, rows = setup
    batch = strategy(folder, tokenizer, "sigmoid").collate(rows)  # padded to 6 tokens
    with torch.no_grad():
        got = completion_logprobs(model, batch, average=average)
    assert got.tolist() == pytest.approx(by_hand(model, rows, average), abs=1e-5)


def test_ipo_loss_uses_average_logprobs(setup):
    """compute_loss with `dpo.loss: ipo` against the paper's formula on per-token averages; the
    reference log-probs come precomputed with the batch (as `dpo.precompute_reference` gives them)."""
    folder, tokenizer, model, rows = setup
    reference = [-2.0, -1.5, -3.0, -2.5]  # chosen 0, chosen 1, rejected 0, rejected 1
    for row, chosen, rejected in zip(rows, reference[:2], reference[2:]):
        row.update(reference_chosen_logps=chosen, reference_rejected_logps=rejected)
    averages, sums = by_hand(model, rows, average=True), by_hand(model, rows, average=False)
    assert all(abs(a - s) > 1e-3 for a, s in zip(averages[1:], sums[1:]))  # lengths > 1: the two scorings differ
    beta = 0.5
    for loss_name, scores in (("ipo", averages), ("sigmoid", sums)):
        dpo = strategy(folder, tokenizer, loss_name)
        with torch.no_grad():
            output = dpo.compute_loss(model, dpo.collate(rows), normalizer=2)
        margins = [(scores[i] - scores[2 + i]) - (reference[i] - reference[2 + i]) for i in range(2)]
        if loss_name == "ipo":
            expected = [(h - 1 / (2 * beta)) ** 2 for h in margins]
        else:
            expected = [-math.log(1 / (1 + math.exp(-beta * h))) for h in margins]
        assert float(output.loss) == pytest.approx(sum(expected) / 2, rel=1e-5), loss_name
        assert output.sums["logps_chosen"] == pytest.approx(scores[0] + scores[1], rel=1e-5)
        assert output.sums["logps_rejected"] == pytest.approx(scores[2] + scores[3], rel=1e-5)
        assert (
            output.sums["reward_margin"] == pytest.approx(beta * sum(margins), rel=1e-5) and output.sums["weight"] == 2
        )
