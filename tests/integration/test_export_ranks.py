"""Export of checkpoints written by 2 real ranks under ZeRO-1, ZeRO-2 and ZeRO-3 (gloo on CPU).

One launch of `deepspeed --num_gpus 2 tests/integration/run_plan.py` trains four tiny jobs on the same
seed and data: ZeRO-1, ZeRO-2, ZeRO-3, and ZeRO-3 with untied embeddings. Each export must give the
logits of the consolidated weights loaded into the model `build_policy` builds (the trained model,
rebuilt without the export code), as must the `export.on_finish` export rank 0 wrote at the end of the
run; greedy `generate` on the exported model and tokenizer must give the trained model's tokens. The
ZeRO-1, ZeRO-2 and ZeRO-3 runs are the same computation sharded differently, so their exports must
agree with each other too: that checks every consolidation, not just each against itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from astrai.export.hf import export_checkpoint
from tests.conftest import launch_ranks

pytestmark = pytest.mark.slow

TINY_RUN = [
    "train.max_steps=4",
    "checkpoint.every_steps=null",
    "train.micro_batch_size=4",
    "model.init.hidden_size=32",
    "model.init.intermediate_size=64",
    "model.init.num_hidden_layers=2",
    "runtime.progress_bar=false",
    "runtime.tensorboard=false",
]
RUNS = {
    "zero1": ["deepspeed.zero_stage=1"],
    "zero2": ["deepspeed.zero_stage=2"],
    "zero3": ["deepspeed.zero_stage=3"],
    "zero3_untied": ["deepspeed.zero_stage=3", "model.init.tie_word_embeddings=false"],
}
# ZeRO-1/2 and ZeRO-3 reduce gradients in different orders (fp32 sums), so a few steps at lr 3e-3
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
    # Each run was sharded as asked (a stage silently falling back would make the agreement trivial).
    stages = {name: zero_stage_written(checkpoint) for name, checkpoint in checkpoints.items()}
    assert stages == {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_untied": 3}, stages
    return checkpoints


def zero_stage_written(checkpoint: Path) -> int:
    """The ZeRO stage DeepSpeed recorded in the policy's first optimizer shard."""
    shard = sorted((checkpoint / "policy").rglob("*optim_states.pt"))[0]
    return torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]["zero_stage"]


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
    # export.on_finish (quickstart.yaml): rank 0's export at the end of the run, unverified, same weights.
    on_finish = AutoModelForCausalLM.from_pretrained(runs[name].parent.parent / "hf").eval()
    torch.testing.assert_close(logits_of(on_finish, vocab_size), logits_of(reference, vocab_size), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_generate_on_the_export_gives_the_trained_models_tokens(name, runs, exports):
    """What a user does with the folder: its tokenizer's chat template, then greedy generation."""
    tokenizer = AutoTokenizer.from_pretrained(exports[name])
    loaded = AutoModelForCausalLM.from_pretrained(exports[name]).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+7="}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    prompt_len = inputs["input_ids"].shape[1]
    output = loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[0] == 1 and prompt_len < output.shape[1] <= prompt_len + 4, output.shape
    assert torch.equal(output[0, :prompt_len], inputs["input_ids"][0])
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    expected = trained_model(runs[name]).generate(**inputs, max_new_tokens=4, do_sample=False, **ids)
    assert torch.equal(output, expected), (tokenizer.decode(output[0]), tokenizer.decode(expected[0]))


def initial_model(checkpoint: Path):
    """The model before training: build_policy with the job's seed, as every rank built it."""
    from astrai.config import load_job
    from astrai.models.policy import build_policy
    from astrai.models.tokenizer import load_tokenizer

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    return build_policy(job.model, load_tokenizer(str(checkpoint.parent.parent / "tokenizer")), job.train.seed).eval()


def test_zero1_zero2_and_zero3_exports_agree(runs, exports):
    models = {name: AutoModelForCausalLM.from_pretrained(exports[name]).eval() for name in ("zero1", "zero2", "zero3")}
    vocab_size = models["zero2"].config.vocab_size
    logits = {name: logits_of(model, vocab_size) for name, model in models.items()}
    for name in ("zero1", "zero3"):
        torch.testing.assert_close(
            logits[name],
            logits["zero2"],
            atol=STAGES_AGREE_ATOL,
            rtol=0,
            msg=lambda text, name=name: f"{name} vs zero2: {text}",
        )
    # The agreement means something only if training moved the weights far beyond the tolerance.
    moved = (logits["zero2"] - logits_of(initial_model(runs["zero2"]), vocab_size)).abs().max().item()
    assert moved > 100 * STAGES_AGREE_ATOL, moved
