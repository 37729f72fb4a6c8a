"""`export-hf` of an `rm` checkpoint: the transformers sequence classifier and its reward statistics.

Kept out of hf.py (which knows no train type's data) and out of strategies/ (which export may not
import: strategies read checkpoint weights through export/weights.py).
"""

from __future__ import annotations

import glob
import logging
from functools import partial
from pathlib import Path

import torch

from astrai.data import render_rows
from astrai.data.collate import pad_right
from astrai.data.reward_pairs import reward_pair_batch

logger = logging.getLogger("astrai.export")


@torch.no_grad()
def training_reward_statistics(job, classifier, tokenizer, batch_size: int = 64) -> tuple[float, float, int]:
    """(mean, std, pairs): the reward of every chosen and rejected sequence of the job's training pairs, rendered
    as training rendered them and scored by `classifier` (a float32 transformers sequence classifier)."""
    import tempfile

    from astrai.data.sources import load_rows

    with tempfile.TemporaryDirectory(prefix="astrai-reward-stats-") as cache:
        rows = load_rows(job.data.path, job.data.format, Path(cache), skip_bad=job.data.on_bad_row == "skip")
        dataset, _ = render_rows(
            rows,
            partial(reward_pair_batch, margin_field=job.rm.margin_field),
            tokenizer=tokenizer,
            data=job.data.model_copy(update={"num_proc": 1}),
            description="scoring the training pairs",
        )
        sequences = list(dataset["chosen_ids"]) + list(dataset["rejected_ids"])
    rewards = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        input_ids = pad_right(chunk, tokenizer.pad_token_id)
        attention_mask = pad_right([[1] * len(sequence) for sequence in chunk], 0)
        rewards.append(classifier(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].double())
    values = torch.cat(rewards)
    std = float(values.std()) if values.numel() > 1 else 0.0
    return float(values.mean()), std, len(dataset)


def export_classifier(reward_model, job, tokenizer):
    """`export-hf` of an rm checkpoint: (the transformers sequence classifier holding `reward_model`'s weights,
    a function that adds reward_stats.json to the written folder).

    The statistics are measured at export, on the written folder loaded back in float32 as
    `reward.model_path` loads it, rather than tracked during training: a running mean over the steps would mix
    the rewards of every earlier version of the model (biased while it learns fast), and the loop stays
    untouched. The cost is one forward pass over the training pairs on the exporting process. Without the
    training data here the file is left out, with a warning (`reward.normalize: stored` then refuses the
    folder, naming the missing file)."""
    from astrai.models.reward import STATS_FILE, reward_stats_text, to_sequence_classifier

    classifier = to_sequence_classifier(reward_model, next(reward_model.parameters()).dtype)

    def add_statistics(folder: Path) -> None:
        from transformers import AutoModelForSequenceClassification

        if not glob.glob(job.data.path):
            logger.warning("no %s in the export: the training data %s is not here", STATS_FILE, job.data.path)
            return
        written = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
        mean, std, pairs = training_reward_statistics(job, written, tokenizer)
        logger.info("reward over %d training pairs: mean %.4f, std %.4f", pairs, mean, std)
        source = f"training pairs of {job.data.path}"
        (folder / STATS_FILE).write_text(reward_stats_text(mean, std, pairs, source))

    return classifier, add_statistics
