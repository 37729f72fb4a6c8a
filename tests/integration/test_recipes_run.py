"""configs/recipes/: every recipe trains 2 steps on real gloo ranks, on a tiny stand-in of its model.

tests/unit/config/test_recipes.py loads, checks and plans each recipe against config-only model folders; here each
one runs. All recipes share ONE launch of 2 ranks (tests/integration/plan.py). Each keeps what it sets (train type,
loss, ZeRO config, packing, LoRA, gradient checkpointing, tiled MLP, sequence parallelism, clip/KL settings, reward
function, schedule, keep_best ...) except what a CPU or a tiny model cannot take, which `OVERRIDES` names per recipe
with the reason. The stand-ins: per model a 2-layer causal LM of the recipe's architecture family (the real config's
model type, rope, norms and tying; 4 heads and 2 key/value heads so sp=2 divides them) with real random weights and
the char tokenizer test_recipes builds, saved with `save_pretrained`; for the PPO recipe's reward model and critic,
a sequence classifier of the same shape with a `reward_stats.json`; data: test_recipes' rows of each train type.

Skipped: none. The multi-node recipe (qwen2.5-32b-sft-multinode) runs its training settings (ZeRO-3, zero3_init,
packing, async_save) on the 2 local ranks: its `infra` block only tells `python -m astrai launch` which hosts to
start (tests/integration/test_multinode.py covers that launcher), and nothing in a rank reads it.
"""

from __future__ import annotations

import json
import math

import pytest

from astrai.config import parse_yaml
from tests.integration.plan import launch_plan, metrics
from tests.unit.config.test_recipes import ARCHITECTURES, DATA_ROWS, RECIPES, header_field, stand_in_job

pytestmark = pytest.mark.slow
STEPS = 2
ROWS = 32  # rows of stand-in data per recipe: 2 steps and the held-out rows on 2 ranks, with room to spare
# The shape of every stand-in (its family's other config.json fields kept): small enough for seconds a step.
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # sp=2 (the long-context recipe on 2 ranks) divides 4 heads and 2 key/value heads
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
# Every recipe: what a CPU, 2 ranks and a tiny model cannot take.
COMMON = {
    "model.dtype": "fp32",  # bf16 matmuls on a CPU are slow and not what the suite compares against
    "model.attn_implementation": "sdpa",  # flash_attention_2 is a GPU package
    "train.epochs": "null",  # exclusive with max_steps (a pass over the stand-in rows is not the point)
    "train.max_steps": str(STEPS),
    "checkpoint.every_steps": str(STEPS),  # the final step checkpoints, through the recipe's checkpoint settings
    "export.on_finish": "false",  # exporting a tiny model proves nothing the export tests do not
    "runtime.progress_bar": "false",  # not a recipe key: keeps the launch log readable
}
SMALL_SFT = {
    "data.max_seq_len": "128",  # the stand-in has 256 positions; a stand-in chat is ~60 tokens
    "data.num_proc": "1",  # 2 shared cores: a tokenising pool costs more than 32 rows
    "train.micro_batch_tokens": "128",  # one packed row of ~2 chats per forward
    "train.grad_accum_steps": "2",  # 2 micro-batches per step still accumulate
    "eval.holdout": "2",  # a fraction of 32 rows holds out none
    "eval.every_steps": str(STEPS),  # evaluated once, at the last step (and keep_best sees an eval figure)
}
OVERRIDES = {
    "qwen2.5-0.5b-sft": SMALL_SFT,
    "qwen2.5-7b-sft-lora": SMALL_SFT,
    "qwen2.5-32b-sft-multinode": SMALL_SFT,
    "qwen2.5-7b-long-context-sft": {
        **{key: value for key, value in SMALL_SFT.items() if not key.startswith("eval.")},  # the recipe has no eval
        "parallel.sequence_parallel_size": "2",  # 4 GPUs per sequence -> both ranks share each row
        # 1,024 would be one chunk of a 64-token shard (chunking off): 16 takes the chunked path (which falls back to
        # full logits for the qwen2 stand-in, with a warning, at sp=2 and at sp=1 alike)
        "train.logits_chunk_size": "16",
    },
    "llama-3.1-8b-dpo": {
        "data.max_seq_len": "128",  # the stand-in's positions
        "data.num_proc": "1",
        "train.micro_batch_size": "1",  # 4 pairs -> 1 per rank per forward
        "train.grad_accum_steps": "2",  # 4 -> 2: still accumulating
        "eval.holdout": "2",  # 1,000 pairs -> 2
        "eval.every_steps": str(STEPS),
    },
    "qwen2.5-1.5b-rm": {
        "data.max_seq_len": "128",
        "data.num_proc": "1",
        "train.micro_batch_size": "1",
        "train.grad_accum_steps": "2",
        "eval.holdout": "2",  # 2,000 pairs -> 2
        "eval.every_steps": str(STEPS),
    },
    "qwen2.5-1.5b-grpo-math": {
        "data.max_seq_len": "128",  # the longest stand-in prompt is ~40 tokens
        "data.num_proc": "1",
        "rollout.prompts_per_step": "4",  # 64 -> 2 per rank
        "rollout.group_size": "4",  # 8 -> 4: 8 answers per rank per step
        "rollout.max_new_tokens": "8",  # 32 -> 8: sampling on a CPU is token by token
        "train.micro_batch_size": "2",  # 16 -> 2: with grad_accum_steps 2 kept, 2 optimizer steps per rollout as the
        # recipe has (the second slightly off-policy)
        "eval.max_samples": "2",  # 512 -> 2
        "eval.samples_per_prompt": "2",  # 4 -> 2
        "eval.every_steps": str(STEPS),  # at_start kept: eval at step 0 and at step 2
    },
    "qwen2.5-1.5b-ppo": {
        "data.max_seq_len": "128",
        "data.num_proc": "1",
        "rollout.prompts_per_step": "8",  # 512 -> 4 per rank (group_size 1 kept: the critic is the baseline)
        "rollout.max_new_tokens": "8",  # 1,024 -> 8
        "train.micro_batch_size": "1",  # 8 -> 1: with grad_accum_steps 2 kept, 2 optimizer steps per rollout
        "reward.batch_size": "2",  # 16 -> 2 responses per reward-model forward
    },
}
# Keys naming the PPO recipe's learned reward: its stand-in is a sequence classifier, not a causal LM.
CLASSIFIER_KEYS = ("reward.model_path", "critic.path")


def tiny_models(root) -> dict[str, tuple]:
    """{model name: (causal LM folder, sequence classifier folder)}, each with test_recipes' char tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from astrai.models.reward import STATS_FILE, reward_stats_text
    from astrai.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("char", ["What is 12+7? 19 20 abcdefghijklmnopqrstuvwxyz"])  # as test_recipes
    folders = {}
    for name, (fields, _) in ARCHITECTURES.items():
        settings = {**fields, **TINY, "vocab_size": len(tokenizer)}
        torch.manual_seed(0)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        causal, classifier = root / name.replace("/", "--"), root / (name.replace("/", "--") + "-rm")
        AutoModelForCausalLM.from_config(config).save_pretrained(causal)
        config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
        AutoModelForSequenceClassification.from_config(config).save_pretrained(classifier)
        (classifier / STATS_FILE).write_text(reward_stats_text(0.0, 1.0, ROWS, "stand-in"))  # reward.normalize: stored
        for folder in (causal, classifier):
            tokenizer.save_pretrained(folder)
        folders[name] = (causal, classifier)
    return folders


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipes_run")
    models = tiny_models(folder / "models")
    runs = []
    for recipe in RECIPES:
        model = header_field(recipe, "Model").split(",")[0].split()[0]
        causal, classifier = models[model]
        work = folder / recipe.stem
        work.mkdir()
        # test_recipes' writer: output_dir -> work/out, model keys -> the causal stand-in, data keys -> its rows
        # (work/data.jsonl, written again here with more of them).
        sets, _ = stand_in_job(recipe, {model: causal}, work)
        train_type = parse_yaml(recipe.read_text(), str(recipe))["train"]["train_type"]
        (work / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in DATA_ROWS[train_type] * ROWS))
        sets = [f"{entry.split('=')[0]}={classifier}" if entry.startswith(CLASSIFIER_KEYS) else entry for entry in sets]
        sets += [f"{key}={value}" for key, value in {**COMMON, **OVERRIDES[recipe.stem]}.items()]
        runs.append({"name": recipe.stem, "config": str(recipe), "set": sets})
    return folder, launch_plan(folder, runs, ranks=2, timeout=600)


def test_every_recipe_has_its_overrides_named():
    assert sorted(OVERRIDES) == sorted(recipe.stem for recipe in RECIPES)


@pytest.mark.parametrize("recipe", [recipe.stem for recipe in RECIPES])
def test_recipe_runs_two_steps_on_a_tiny_stand_in(trained, recipe):
    folder, results = trained
    outcome = results[recipe]
    assert outcome["ok"], outcome["error"]
    assert outcome["step"] == STEPS, outcome
    records = metrics(folder / recipe, "out")
    losses = [record["loss"] for record in records if "loss" in record]
    assert losses and all(math.isfinite(loss) for loss in losses), records
