"""Export of checkpoints written by 2 real ranks under ZeRO-2 and ZeRO-3 (gloo on CPU).

One launch of `deepspeed --num_gpus 2 tests/integration/run_plan.py` trains three tiny jobs on the same
seed and data: ZeRO-2, ZeRO-3, and ZeRO-3 with untied embeddings. Each export must give the logits of
the consolidated weights loaded into the model `build_policy` builds (the trained model, rebuilt
without the export code). The ZeRO-2 and ZeRO-3 runs are the same computation sharded differently,
so their exports must agree with each other too: that checks both consolidations, not just one
against itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from astrai.export import export_checkpoint
from tests.conftest import launch_ranks

pytestmark = pytest.mark.slow

TINY_RUN = [
    "train.max_steps=4", "checkpoint.every_steps=null", "train.micro_batch_size=4",
    "model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_hidden_layers=2",
    "runtime.progress_bar=false", "runtime.tensorboard=false",
]
RUNS = {
    "zero2": ["deepspeed.zero_stage=2"],
    "zero3": ["deepspeed.zero_stage=3"],
    "zero3_untied": ["deepspeed.zero_stage=3", "model.init.tie_word_embeddings=false"],
}
# ZeRO-2 and ZeRO-3 reduce gradients in different orders (fp32 sums), so a few steps at lr 3e-3
# drift by rounding only: logits agree to ~1e-7 (measured). 1e-4 leaves room for other platforms
# and is still 100x below how far training moves the logits (checked), so a wrong shard cannot hide.
STAGES_AGREE_ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """{run name: its newest checkpoint}, all from one 2-rank launch."""
    root = tmp_path_factory.mktemp("ranks")
    plan = {"results": str(root / "results.json"), "runs": []}
    for name, settings in RUNS.items():
        overrides = [f"output_dir={root / name}", *TINY_RUN, *settings]
        plan["runs"].append({"name": name, "config": "configs/quickstart.yaml", "set": overrides})
    (root / "plan.json").write_text(json.dumps(plan))
    finished = launch_ranks(["tests/integration/run_plan.py", "--plan", root / "plan.json"], ranks=2, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    assert all(result["ok"] and result["step"] == 4 for result in results.values()), results
    checkpoints = {name: root / name / "checkpoints" / "step_00000004" for name in RUNS}
    for checkpoint in checkpoints.values():
        assert json.loads((checkpoint / "manifest.json").read_text())["world_size"] == 2
    return checkpoints


def trained_model(checkpoint: Path):
    """The trained model, independent of the export: consolidated weights into build_policy's model."""
    from astrai.config import load_job
    from astrai.engine import consolidated_state_dict
    from astrai.models.policy import build_policy
    from astrai.models.tokenizer import load_tokenizer

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    model = build_policy(job.model, load_tokenizer(str(checkpoint.parent.parent / "tokenizer")), job.train.seed)
    result = model.load_state_dict(consolidated_state_dict(checkpoint / "policy"), strict=False)
    allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not result.unexpected_keys and set(result.missing_keys) <= allowed_missing, result
    return model.eval()


@torch.no_grad()
def logits_of(model, vocab_size: int) -> torch.Tensor:
    batch = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=batch).logits.float()


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("exports")
    return {name: export_checkpoint(checkpoint, folder / name) for name, checkpoint in runs.items()}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_export_gives_the_trained_models_logits(name, runs, exports):
    reference = trained_model(runs[name])
    loaded = AutoModelForCausalLM.from_pretrained(exports[name]).eval()
    vocab_size = reference.config.vocab_size
    torch.testing.assert_close(logits_of(loaded, vocab_size), logits_of(reference, vocab_size), atol=1e-5, rtol=0)
    tied = loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    assert tied == (name != "zero3_untied") == loaded.config.tie_word_embeddings


def initial_model(checkpoint: Path):
    """The model before training: build_policy with the job's seed, as every rank built it."""
    from astrai.config import load_job
    from astrai.models.policy import build_policy
    from astrai.models.tokenizer import load_tokenizer

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    return build_policy(job.model, load_tokenizer(str(checkpoint.parent.parent / "tokenizer")), job.train.seed).eval()


def test_zero2_and_zero3_exports_agree(runs, exports):
    zero2 = AutoModelForCausalLM.from_pretrained(exports["zero2"]).eval()
    zero3 = AutoModelForCausalLM.from_pretrained(exports["zero3"]).eval()
    vocab_size = zero2.config.vocab_size
    torch.testing.assert_close(logits_of(zero2, vocab_size), logits_of(zero3, vocab_size), atol=STAGES_AGREE_ATOL, rtol=0)
    # The agreement means something only if training moved the weights far beyond the tolerance.
    moved = (logits_of(zero2, vocab_size) - logits_of(initial_model(runs["zero2"]), vocab_size)).abs().max().item()
    assert moved > 100 * STAGES_AGREE_ATOL, moved
