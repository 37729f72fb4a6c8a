"""LoRA adapters (`model.lora`, astrai/models/lora.py) on a real one-rank DeepSpeed group in this process:
only the adapter trains and is optimised under every ZeRO stage, its checkpoints hold the adapter alone and
name their base, the reference of dpo is the policy with its adapter disabled, and bad settings are refused
before any rank starts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.config import ConfigError, load_job
from astrai.engine import consolidated_state_dict, load_tensor_file
from astrai.launch.job_checks import load_and_check
from astrai.models.lora import LoraError, check_same_base, default_target_modules
from astrai.models.policy import load_causal_lm
from astrai.models.tokenizer import build_tokenizer
from astrai.strategies.dpo import completion_logprobs
from astrai.strategies.frozen_reference import DisabledAdapterReference
from astrai.training.build import build_run
from astrai.training.loops import TRAIN_LOOPS
from tests.conftest import REPO
from tests.unit.rollout_fixtures import LLAMA_SHAPE

JOB = """\
output_dir: {output_dir}
model: {{path: {model}, lora: {{r: 4, alpha: 8, init: {init}}}}}
data: {{path: {data}, max_seq_len: 32}}
train: {{train_type: {train_type}, max_steps: 3, micro_batch_size: 2, lr: 1e-2, lr_schedule: constant,
         warmup_steps: 0, seed: 3}}
deepspeed: {{zero_stage: {stage}}}
checkpoint: {{every_steps: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
# A tied lm_head is an alias of a frozen weight: never saved by a LoRA run.
TINY = dict(**LLAMA_SHAPE, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """sft.jsonl and pairs.jsonl (16 shipped rows each) and two tiny Llama folders with one char tokenizer:
    `base` (what the adapter adapts) and `other` (another base of the same shapes)."""
    folder = tmp_path_factory.mktemp("lora")
    texts = []
    for source, name in (("sft.jsonl", "sft.jsonl"), ("preference.jsonl", "pairs.jsonl")):
        lines = (REPO / "data/arithmetic" / source).read_text().splitlines(keepends=True)[:16]
        (folder / name).write_text("".join(lines))
        texts.append("".join(lines))
    tokenizer = build_tokenizer("char", texts)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **TINY,
    )
    for seed, name in ((0, "base"), (1, "other")):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder


def write_job(folder, name, *, stage=2, train_type="sft", init="default", model="base"):
    data = folder / ("pairs.jsonl" if train_type == "dpo" else "sft.jsonl")
    config = folder / f"{name}.yaml"
    config.write_text(
        JOB.format(
            output_dir=folder / name, model=folder / model, data=data, train_type=train_type, stage=stage, init=init
        )
    )
    return config


def make_run(dist, folder, name, *overrides, **job):
    config = write_job(folder, name, **job)
    return build_run(load_job(config, list(overrides)), dist, str(config))


def tensor_elements(value) -> int:
    """Elements of every tensor in a loaded checkpoint file (nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, dict):
        return sum(tensor_elements(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_elements(item) for item in value)
    return 0


def optimised_elements(engine) -> int:
    """Elements the torch optimizer under DeepSpeed updates (ZeRO-1/2/3: flat fp32 partitions)."""
    flat = getattr(engine._engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 sets groups per step
    if flat is not None:
        return sum(tensor.numel() for tensor in flat)
    groups = engine._engine.basic_optimizer.param_groups
    return sum(parameter.numel() for group in groups for parameter in group["params"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_the_adapter_trains_and_is_checkpointed(one_rank, folder, stage):
    run = make_run(one_rank, folder, f"sft_z{stage}", stage=stage)
    engine = run.engines["policy"]
    module = engine.module
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    trainable_elements = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    assert trainable_elements < total / 5
    # Only the adapter is in the optimizer (ZeRO's flat partitions may pad a few elements for alignment).
    assert trainable_elements <= optimised_elements(engine) < trainable_elements + 64
    with engine.gathered_parameters():
        before = {name: p.detach().clone() for name, p in module.named_parameters()}
    state = TRAIN_LOOPS[run.strategy.loop](run)
    assert state.step == 3
    with engine.gathered_parameters():
        after = {name: p.detach().clone() for name, p in module.named_parameters()}
    for name in before:
        changed = not torch.equal(before[name], after[name])
        # B starts at 0; every adapter matrix moves after 3 steps, no base weight does
        assert changed == (name in trainable or False), name
    checkpoint = run.output_dir / "checkpoints" / "step_00000003"
    saved = consolidated_state_dict(checkpoint / "policy")
    assert set(saved) == trainable
    for name in trainable:
        torch.testing.assert_close(saved[name], after[name].float())
    # The policy part holds the adapter, its fp32 copy and its Adam moments: tensors a few times the adapter's
    # size (ZeRO-3's empty placeholders aside), nothing of the size of the base model.
    saved_elements = sum(tensor_elements(load_tensor_file(file)) for file in (checkpoint / "policy").rglob("*.pt"))
    assert 3 * trainable_elements <= saved_elements <= 4 * trainable_elements + 64 < total
    for file in (checkpoint / "policy").rglob("*model_states.pt"):  # no frozen weight, nor a tied alias of one
        assert set(load_tensor_file(file)["module"]) <= trainable, file
    meta = json.loads((checkpoint / "manifest.json").read_text())["meta"]
    base = meta["lora"]["policy"]["base"]
    assert base["path"] == str((folder / "base").resolve()) and len(base["hash"]) == 64
    assert meta["lora"]["policy"]["settings"]["r"] == 4


def test_zero3_reference_is_the_base_model_without_a_second_model(one_rank, folder):
    """dpo under ZeRO-3: the reference is the policy engine itself with the adapter disabled, and its
    log-probs are a separately loaded base model's. init false (random B): the adapted policy differs."""
    run = make_run(one_rank, folder, "dpo_z3", stage=3, train_type="dpo", init="false")
    reference, policy = run.strategy.reference, run.engines["policy"]
    assert isinstance(reference, DisabledAdapterReference) and reference.module is policy.module
    assert "adapter disabled" in run.strategy.checkpoint_meta()["reference"]
    batch = run.strategy.collate([run.dataset[i] for i in range(2)])
    vocab = len(run.tokenizer)
    base = load_causal_lm(folder / "base").eval()
    with torch.no_grad():
        expected = completion_logprobs(base, batch, vocab_size=vocab)
        adapted = completion_logprobs(policy, batch, vocab_size=vocab)
    got = completion_logprobs(reference, batch, vocab_size=vocab)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter is on outside the reference's forward
    assert policy.module.training  # the reference's forward leaves the policy in train mode


def test_resume_onto_another_base_is_refused(one_rank, folder):
    run = make_run(one_rank, folder, "resume_base")
    TRAIN_LOOPS[run.strategy.loop](run)
    # Same output_dir (resume: auto), model.path now the other base: refused naming both.
    other = make_run(one_rank, folder, "resume_base", f"model.path={folder / 'other'}", "train.max_steps=4")
    with pytest.raises(LoraError, match="trained on the base model .*base.* this job's base is .*other"):
        TRAIN_LOOPS[other.strategy.loop](other)


def test_check_same_base_names_full_and_adapter_checkpoints():
    record = {"policy": {"base": {"path": "/m", "hash": "a" * 64}}}
    check_same_base(record, record, "ckpt")
    with pytest.raises(LoraError, match="full fine-tuning checkpoint"):
        check_same_base(None, record, "ckpt")
    with pytest.raises(LoraError, match="LoRA adapter only"):
        check_same_base(record, None, "ckpt")


def test_default_targets_are_the_linear_layers_of_the_blocks():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, **TINY))
    targets = default_target_modules(model)
    assert targets == [
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    assert "lm_head" not in targets


def test_unmatched_target_modules_fail_before_any_rank_lists_linear_names(folder):
    config = write_job(folder, "bad_targets")
    with pytest.raises(ConfigError) as caught:
        load_and_check(str(config), ["model.lora.target_modules=[qkv, q_proj]"])
    message = str(caught.value)
    assert "model.lora.target_modules: ['qkv'] match no linear module" in message
    assert "q_proj" in message and "down_proj" in message and "lm_head" in message
    assert "\n" not in message


def test_export_merged_and_adapter_give_the_adapted_logits(one_rank, folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from astrai.export.hf import export_checkpoint
    from astrai.export.weights import ExportError

    run = make_run(one_rank, folder, "export_lora", stage=1)
    TRAIN_LOOPS[run.strategy.loop](run)
    checkpoint = run.output_dir / "checkpoints" / "step_00000003"
    ids = torch.tensor([run.dataset[0]["input_ids"]])
    with torch.no_grad():
        adapted = run.engines["policy"].module.eval()(input_ids=ids).logits
        base_logits = load_causal_lm(folder / "base")(input_ids=ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapter changed the model: the checks below mean something

    merged_folder = export_checkpoint(checkpoint, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_folder)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=0)

    adapter_folder = export_checkpoint(checkpoint, tmp_path / "adapter", adapter=True)
    assert (adapter_folder / "adapter_config.json").is_file()
    assert not list(adapter_folder.glob("model*.safetensors"))  # the adapter alone, no base weights
    loaded = PeftModel.from_pretrained(load_causal_lm(folder / "base"), adapter_folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, adapted, atol=1e-4, rtol=0)

    # A new run starting from the LoRA checkpoint (e.g. grpo after a LoRA sft) starts from the merged weights.
    started = make_run(one_rank, folder, "from_lora", "model.lora=null", f"model.init_from_checkpoint={checkpoint}")
    with torch.no_grad():
        torch.testing.assert_close(started.engines["policy"].module(input_ids=ids).logits, adapted, atol=1e-4, rtol=0)

    full = make_run(one_rank, folder, "export_full", "model.lora=null")
    TRAIN_LOOPS[full.strategy.loop](full)
    with pytest.raises(ExportError, match="has no LoRA adapter .*export it without --adapter"):
        export_checkpoint(full.output_dir / "checkpoints" / "step_00000003", tmp_path / "refused", adapter=True)
    assert not (tmp_path / "refused").exists()


def test_export_cli_takes_adapter():
    from astrai.export.cli import parse_args

    assert parse_args(["ckpt", "dest", "--adapter"]).adapter and not parse_args(["ckpt", "dest"]).adapter


@pytest.mark.parametrize(
    "stage, settings",
    [
        (3, ["model.lora.use_dora=true"]),
        (2, ["model.lora.modules_to_save=[lm_head]", "model.lora.use_rslora=true"]),
        (0, ["model.gradient_checkpointing=true"]),
    ],
)
def test_lora_options_train_and_export_merged(one_rank, folder, tmp_path, stage, settings):
    """DoRA under ZeRO-3, a fully trained lm_head beside the adapter, rank-stabilised scaling, gradient
    checkpointing: each trains 3 steps and its merged export computes what the adapted policy computes."""
    from transformers import AutoModelForCausalLM

    from astrai.export.hf import export_checkpoint

    name = f"options_z{stage}"
    run = make_run(one_rank, folder, name, *settings, stage=stage)
    engine = run.engines["policy"]
    trainable = [name for name, p in engine.module.named_parameters() if p.requires_grad]
    if "model.lora.modules_to_save=[lm_head]" in settings:
        assert any("lm_head.modules_to_save" in name for name in trainable)
    assert TRAIN_LOOPS[run.strategy.loop](run).step == 3
    ids = torch.tensor([run.dataset[0]["input_ids"]])
    with engine.gathered_parameters(), torch.no_grad():
        adapted = engine.module.eval()(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(
        export_checkpoint(run.output_dir / "checkpoints" / "step_00000003", tmp_path / name)
    )
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=0)
