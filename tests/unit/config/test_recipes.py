"""configs/recipes/: every recipe loads, passes every check train.py makes before a rank starts, and plans within
the memory its header claims, for the GPUs it names.

No weights and no hub: each model a recipe names (its `# Model:` header line) is stood in for by a folder holding
that model's real config.json fields and a tiny tokenizer, so the parameter count, the heads that
`parallel.sequence_parallel_size` must divide and the planner's figures are those of the real model; the data paths
point at a few rows of the format the recipe's train type reads. The header is checked too: what to download, the
launch command, the GPUs it assumes and the per-GPU memory `python -m astrai plan` gives, which docs/recipes.md
repeats.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from astrai.config import load_job, parse_yaml
from astrai.launch.job_checks import check_sequence_parallel, load_and_check
from astrai.launch.memory_plan import GIB, count_shapes, make_plan, model_config
from astrai.models.policy import check_model_config
from tests.conftest import REPO

RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
DOCS = REPO / "docs" / "recipes.md"
GPU_MEMORY_GIB = 80.0  # one H100 80GB
HOST_MEMORY = 128 * GIB  # per rank: a 1 TiB node of 8 GPUs
# A header's memory figure may drift this far from the planner's before the recipe and its docs row must be updated.
TOLERANCE = 0.10

# config.json of each model the recipes name (the fields that shape it), and its parameter count as built.
QWEN = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
ARCHITECTURES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (
        {**QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14}
        | {"num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
        494_032_768,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": (
        {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12}
        | {"num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
        1_543_714_304,
    ),
    "Qwen/Qwen2.5-7B-Instruct": (
        {**QWEN, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28}
        | {"num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
        7_615_616_512,
    ),
    "Qwen/Qwen2.5-32B-Instruct": (
        {**QWEN, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40}
        | {"num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
        32_763_876_352,
    ),
    "meta-llama/Llama-3.1-8B-Instruct": (
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        8_030_261_248,
    ),
}
# A few rows of each train type's data format, as the recipes' headers describe it.
CHAT = [{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "19"}]
DATA_ROWS = {
    "sft": [{"messages": CHAT}],
    "dpo": [{"prompt": "What is 12+7?", "chosen": "19", "rejected": "20"}],
    "rm": [{"prompt": "What is 12+7?", "chosen": "19", "rejected": "20"}],
    "grpo": [{"messages": CHAT[:1], "answer": "19"}],
    "online_ppo": [{"messages": CHAT[:1], "answer": "19"}],
}
# Keys that name a model folder, and keys that name data: each is pointed at its stand-in.
MODEL_KEYS = ("model.path", "model.reference_path", "tokenizer.path", "critic.path", "reward.model_path")
DATA_KEYS = ("data.path", "eval.data_path")


def header(recipe: Path) -> str:
    lines = recipe.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def header_field(recipe: Path, name: str) -> str:
    match = re.search(rf"^# {name}:\s+(.+)$", header(recipe), re.M)
    assert match, f"{recipe.name}: the header has no `# {name}:` line"
    return match.group(1)


def gpus(recipe: Path) -> int:
    match = re.match(r"(\d+) x H100 80GB", header_field(recipe, "GPUs"))
    assert match, f"{recipe.name}: `# GPUs:` must read '<N> x H100 80GB ...'"
    return int(match.group(1))


def claimed_gib(recipe: Path) -> tuple[float, float]:
    """(the planner's GiB per GPU, GiB the header adds for what the planner does not count: 0 when none)."""
    text = header_field(recipe, "Memory")
    match = re.match(r"([\d.]+) GiB per GPU(?: \+ ([\d.]+) GiB)?", text)
    assert match, f"{recipe.name}: `# Memory:` must read '<x> GiB per GPU [+ <y> GiB ...] (python -m astrai plan ...)'"
    return float(match.group(1)), float(match.group(2) or 0)


def dotted(raw: dict, key: str):
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    """A folder per model: its real config.json and a tiny tokenizer (the vocabulary's size comes from config.json)."""
    from transformers import AutoConfig

    from astrai.models.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = build_tokenizer("char", ["What is 12+7? 19 20 abcdefghijklmnopqrstuvwxyz"])
    folders = {}
    for name, (fields, _) in ARCHITECTURES.items():
        settings = dict(fields)
        folder = root / name.replace("/", "--")
        AutoConfig.for_model(settings.pop("model_type"), **settings).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = folder
    return folders


def stand_in_job(recipe: Path, stand_ins: dict[str, Path], tmp_path: Path) -> tuple[list[str], str]:
    """`--set` overrides pointing the recipe's model folders and data at stand-ins; and the recipe's model."""
    raw = parse_yaml(recipe.read_text(), str(recipe))
    model = header_field(recipe, "Model").split(",")[0].split()[0]
    assert model in ARCHITECTURES, f"{recipe.name}: `# Model: {model}` has no stand-in here: add its config.json fields"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in DATA_ROWS[raw["train"]["train_type"]] * 4))
    overrides = [f"output_dir={tmp_path / 'out'}"]
    overrides += [f"{key}={stand_ins[model]}" for key in MODEL_KEYS if dotted(raw, key) is not None]
    overrides += [f"{key}={data}" for key in DATA_KEYS if dotted(raw, key) is not None]
    return overrides, model


def test_there_are_recipes_and_docs_list_each():
    assert len(RECIPES) >= 6
    docs = DOCS.read_text()
    for recipe in RECIPES:
        row = next((line for line in docs.splitlines() if f"`configs/recipes/{recipe.name}`" in line), None)
        assert row is not None, f"docs/recipes.md has no table row for configs/recipes/{recipe.name}"
        planned, extra = claimed_gib(recipe)
        assert f"{planned:.1f} GiB" in row, f"docs/recipes.md's row of {recipe.name} must quote {planned:.1f} GiB"
        assert not extra or f"+ {extra:.1f} GiB" in row, f"docs/recipes.md's row of {recipe.name}: + {extra:.1f} GiB"
        assert f"{gpus(recipe)} x H100" in row, f"docs/recipes.md's row of {recipe.name} must name its GPUs"


def test_stand_ins_have_the_real_parameter_counts(stand_ins):
    from transformers import AutoConfig

    for name, (_, parameters) in ARCHITECTURES.items():
        assert count_shapes(AutoConfig.from_pretrained(stand_ins[name])).parameters == parameters, name


@pytest.mark.parametrize("recipe", RECIPES, ids=[recipe.stem for recipe in RECIPES])
def test_recipe_header_names_model_data_launch_and_memory(recipe):
    text = header(recipe)
    name = f"configs/recipes/{recipe.name}"
    model = header_field(recipe, "Model").split(",")[0].split()[0]
    raw = parse_yaml(recipe.read_text(), str(recipe))
    folder = raw["model"]["path"]
    assert folder.startswith(("/", "runs/")), f"{recipe.name}: model.path must be a local folder, not a hub name"
    if folder.startswith("/"):  # a downloaded model: the header says how to fetch it into that folder
        assert f"hf download {model} --local-dir {folder}" in text, f"{recipe.name}: say how to download {model}"
    header_field(recipe, "Data")
    n = gpus(recipe)
    launch = header_field(recipe, "Launch")
    assert f"--config {name}" in launch, f"{recipe.name}: the launch command must run this file"
    if launch.startswith("deepspeed"):
        assert f"--num_gpus {n} astrai/train.py" in launch, f"{recipe.name}: launch {n} ranks (# GPUs)"
    else:  # multi-node: the launcher starts infra.nodes' slots
        assert launch.startswith("python -m astrai launch"), f"{recipe.name}: launch with deepspeed or astrai launch"
        assert sum(node["slots"] for node in raw["infra"]["nodes"]) == n
    plan = header_field(recipe, "Memory")
    nodes = len(raw.get("infra", {}).get("nodes") or [None])
    assert f"python -m astrai plan --config {name}" in plan, f"{recipe.name}: give the plan command"
    assert f"--gpus-per-node {n // nodes}" in plan and (nodes == 1 or f"--nodes {nodes}" in plan), recipe.name
    assert "--gpu-memory-gib 80" in plan, recipe.name


@pytest.mark.parametrize("recipe", RECIPES, ids=[recipe.stem for recipe in RECIPES])
def test_recipe_validates_and_plans_within_its_claim(recipe, stand_ins, tmp_path, monkeypatch):
    overrides, model = stand_in_job(recipe, stand_ins, tmp_path)
    n = gpus(recipe)
    job = load_job(str(recipe), overrides)
    # flash_attention_2 is a GPU package: where it is not installed the check says exactly that, and nothing else.
    attention = job.model.attn_implementation
    problem = check_model_config(job.model)
    checked = overrides
    if problem is not None and attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        assert "is not installed here" in problem, problem
        checked = overrides + ["model.attn_implementation=sdpa"]
    else:
        assert problem is None, problem
    monkeypatch.setenv("WORLD_SIZE", str(n))  # as the launcher exports it: batch splits and sp checked for n ranks
    load_and_check(str(recipe), checked)
    check_sequence_parallel(job, n)

    plan = make_plan(job, str(recipe), n, GPU_MEMORY_GIB, host_memory=HOST_MEMORY)
    adapter = plan.shape.trainable if job.model.lora is not None else 0  # a LoRA policy counts its adapter too
    assert plan.policy_parameters - adapter == ARCHITECTURES[model][1]
    planned, extra = claimed_gib(recipe)
    actual = plan.gpu_total / GIB
    assert abs(actual - planned) <= TOLERANCE * actual, (
        f"{recipe.name}: the planner now gives {actual:.1f} GiB per GPU, the header {planned:.1f}: update the header "
        "and docs/recipes.md"
    )
    # A reward model (reward.model_path) is loaded whole in fp32 on every rank: the planner counts it.
    if job.reward is not None and job.reward.model_path is not None:
        reward_model = count_shapes(model_config(job, 0)).parameters * 4
        counted = [row for row in plan.rows if row.component.startswith("reward model")]
        assert len(counted) == 1 and abs(counted[0].gpu - reward_model) <= TOLERANCE * reward_model, counted
    assert extra == 0, f"{recipe.name}: the planner counts everything now; the header adds {extra} GiB"
    assert plan.fits and actual <= GPU_MEMORY_GIB, f"{recipe.name}: {actual:.1f} GiB per GPU does not fit an H100 80GB"
