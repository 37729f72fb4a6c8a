"""A resume continues the same job, on a real one-rank DeepSpeed group in this process: another train
type or tokenizer is refused before anything loads (and `output_dir/tokenizer` is left as it was),
`model.init_from_checkpoint` starts a new run from a checkpoint's weights only, a larger max_steps
continues the LR schedule over the new total, and `train.seed` makes a dropout model's run repeat
bit for bit. The chat-template rule (ChatML only with its markers) needs no ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from astrai.checkpoint import CheckpointError, find_latest
from astrai.config import load_job
from astrai.config.schema import ModelConfig
from astrai.data.sources import load_rows
from astrai.engine import consolidated_state_dict, lr_lambda
from astrai.models.tokenizer import (
    CHATML_TEMPLATE,
    TokenizerError,
    build_tokenizer,
    has_chatml_markers,
    load_tokenizer,
    tokenizer_difference,
)
from astrai.training.build import build_run, make_tokenizer
from astrai.training.loops import TRAIN_LOOPS
from tests.conftest import REPO

SFT_DATA = REPO / "data/arithmetic/sft.jsonl"
TEXT_DATA = REPO / "data/arithmetic/text.jsonl"
LR = 5e-3

JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
train: {{train_type: {train_type}, max_steps: 2, micro_batch_size: 4, lr: {lr}, lr_schedule: linear, warmup_steps: 0,
         seed: 7}}
deepspeed: {{zero_stage: 0}}
checkpoint: {{every_steps: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def write_job(folder: Path, name: str, *, train_type: str = "sft", data: Path | None = None, output: str | None = None):
    """A tiny job; its sft data: 64 shipped chats copied into `folder` (rendering all 4000 takes seconds)."""
    if data is None:
        data = folder / "sft.jsonl"
        if not data.exists():
            data.write_text("".join(SFT_DATA.read_text().splitlines(keepends=True)[:64]))
    config = folder / f"{name}.yaml"
    config.write_text(JOB.format(output_dir=folder / (output or name), data=data, train_type=train_type, lr=LR))
    return config


def train(dist, config: Path, *overrides: str):
    """build_run + the loop, as astrai/train.py does; returns (run, final state)."""
    run = build_run(load_job(config, list(overrides)), dist, str(config))
    return run, TRAIN_LOOPS[run.strategy.loop](run)


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first(one_rank, tmp_path_factory):
    """An sft run of 2 steps (linear decay to 0) with its checkpoint at step 2; returns its folder."""
    folder = tmp_path_factory.mktemp("resume_job")
    train(one_rank, write_job(folder, "first"))
    return folder


def test_checkpoint_holds_its_tokenizer_and_total(first):
    checkpoint = find_latest(first / "first" / "checkpoints")
    saved = load_tokenizer(str(checkpoint / "tokenizer"))
    assert tokenizer_difference(saved, load_tokenizer(str(first / "first" / "tokenizer"))) is None
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["meta"]["total_steps"] == 2 and "tokenizer/tokenizer.json" in manifest["files"]


def test_another_train_type_is_refused_naming_both(one_rank, first):
    checkpoint = find_latest(first / "first" / "checkpoints")
    config = write_job(first, "as_seq", train_type="seq", data=TEXT_DATA)
    with pytest.raises(CheckpointError, match=r"is a sft checkpoint and this job is seq.*model.init_from_checkpoint"):
        train(
            one_rank,
            config,
            f"checkpoint.resume={checkpoint}",
            "tokenizer.build=null",
            f"tokenizer.path={checkpoint / 'tokenizer'}",
        )
    assert not (first / "as_seq" / "metrics.jsonl").exists()  # refused before any step


def test_a_rebuilt_tokenizer_that_differs_is_refused_and_the_saved_one_kept(one_rank, first):
    """The same output_dir, its data changed: the char tokenizer rebuilt from it differs."""
    copy = first / "changed"
    shutil.copytree(first / "first", copy)
    before = {path.name: path.read_bytes() for path in (copy / "tokenizer").iterdir()}
    data = first / "changed.jsonl"
    row = json.loads(SFT_DATA.read_text().splitlines()[0])
    row["messages"][0]["content"] += " \u00e9"  # a character the saved tokenizer has never seen
    data.write_text(json.dumps(row) + "\n" + (first / "sft.jsonl").read_text())
    config = write_job(first, "changed_job", data=data, output="changed")
    refusal = r"tokenizer.build: this job's tokenizer differs from .*changed/tokenizer: vocabulary"
    with pytest.raises(TokenizerError, match=refusal):
        train(one_rank, config, "train.max_steps=4")
    assert {path.name: path.read_bytes() for path in (copy / "tokenizer").iterdir()} == before


def test_a_resume_with_another_tokenizer_is_refused(one_rank, first, tmp_path):
    """tokenizer.path names a tokenizer whose ids differ from the checkpoint's: refused before loading."""
    checkpoint = find_latest(first / "first" / "checkpoints")
    other = build_tokenizer("char", [(first / "sft.jsonl").read_text() + "\u00e9"])
    other.save_pretrained(tmp_path / "other")
    config = write_job(first, "other_tokenizer")
    refusal = r"resuming from .*: this job's tokenizer differs from .*tokenizer: vocabulary"
    with pytest.raises(TokenizerError, match=refusal):
        train(
            one_rank,
            config,
            f"checkpoint.resume={checkpoint}",
            "tokenizer.build=null",
            f"tokenizer.path={tmp_path / 'other'}",
        )


@pytest.mark.parametrize("stage", [0, 2], ids=["zero0", "zero2"])
def test_larger_max_steps_continues_the_schedule_over_the_new_total(one_rank, first, stage, caplog):
    """A run of 2 steps decays linearly to lr 0 after its step 2; resumed with max_steps 4, step 3 trains
    at the new schedule's lr for 2 completed updates (lr x (1 - 3/4)), not at 0, and the log says so.
    ZeRO-0's optimizer is torch's own; ZeRO-2 wraps it (the lr is set through the schedule's optimizer)."""
    config = write_job(first, f"extended_{stage}")
    train(one_rank, config, f"deepspeed.zero_stage={stage}")
    assert [record["lr"] for record in metrics(first / f"extended_{stage}")] == [LR * 0.5, 0.0]
    train(one_rank, config, f"deepspeed.zero_stage={stage}", "train.max_steps=4")
    records = {record["step"]: record for record in metrics(first / f"extended_{stage}")}
    schedule = lr_lambda(4, 0, "linear", 0.0)
    assert records[3]["lr"] > 0
    assert records[3]["lr"] == pytest.approx(LR * schedule(2), rel=1e-12)
    assert records[4]["lr"] == pytest.approx(LR * schedule(3), rel=1e-12)
    assert "the checkpoint's run spanned 2 steps, this job 4: the schedule continues over 4 steps" in caplog.text


def test_init_from_checkpoint_takes_the_weights_only(one_rank, first):
    checkpoint = find_latest(first / "first" / "checkpoints")
    config = write_job(first, "started")
    run = build_run(load_job(config, [f"model.init_from_checkpoint={first / 'first'}"]), one_rank, str(config))
    saved = consolidated_state_dict(checkpoint / "policy")
    module = run.engines["policy"].module.state_dict()
    assert all(torch.equal(module[name], tensor) for name, tensor in saved.items())
    optimizer = run.engines["policy"]._engine.optimizer
    assert not optimizer.state  # fresh: no Adam moments yet
    state = TRAIN_LOOPS[run.strategy.loop](run)
    records = metrics(first / "started")
    assert state.step == 2 and [record["step"] for record in records] == [1, 2]  # started at step 0
    assert records[0]["lr"] == pytest.approx(LR * lr_lambda(2, 0, "linear", 0.0)(0))  # the schedule starts over


def test_init_from_checkpoint_of_another_train_type_is_the_way(one_rank, first):
    """The refused resume's alternative: seq from the sft checkpoint's weights, its tokenizer as tokenizer.path."""
    checkpoint = find_latest(first / "first" / "checkpoints")
    config = write_job(first, "seq_from_sft", train_type="seq", data=TEXT_DATA)
    _, state = train(
        one_rank,
        config,
        f"model.init_from_checkpoint={checkpoint}",
        "tokenizer.build=null",
        f"tokenizer.path={checkpoint / 'tokenizer'}",
        "train.max_steps=1",
    )
    assert state.step == 1


def test_init_from_checkpoint_is_also_the_default_reference(one_rank, first):
    """dpo from the sft checkpoint: its frozen reference is the policy's starting weights, i.e. the checkpoint's."""
    checkpoint = find_latest(first / "first" / "checkpoints")
    pairs = first / "pairs.jsonl"
    pairs.write_text("".join((REPO / "data/arithmetic/preference.jsonl").read_text().splitlines(keepends=True)[:8]))
    config = write_job(first, "dpo_from_sft", train_type="dpo", data=pairs)
    overrides = [
        f"model.init_from_checkpoint={checkpoint}",
        "tokenizer.build=null",
        f"tokenizer.path={checkpoint / 'tokenizer'}",
    ]
    run = build_run(load_job(config, overrides), one_rank, str(config))
    saved = consolidated_state_dict(checkpoint / "policy")
    reference = run.strategy.reference.module.state_dict()
    assert all(torch.equal(reference[name], tensor) for name, tensor in saved.items())
    assert run.strategy.checkpoint_meta()["reference"].startswith(f"model.init_from_checkpoint {checkpoint}")


# ----------------------------------------------------------------------------- seeding


def dropout_model(folder: Path) -> Path:
    """A GPT-2 with dropout 0.1 everywhere, saved as a `model.path` folder with a char tokenizer."""
    tokenizer = build_tokenizer("char", [TEXT_DATA.read_text()])
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder / "gpt2")
    tokenizer.save_pretrained(folder / "gpt2")
    return folder / "gpt2"


def test_a_dropout_model_run_repeats_bit_for_bit(one_rank, tmp_path):
    model = dropout_model(tmp_path)
    losses = []
    for attempt in range(2):
        torch.rand(1000)  # whatever ran before in this process must not matter
        config = write_job(tmp_path, f"dropout_{attempt}", train_type="seq", data=TEXT_DATA)
        overrides = [
            "model.init=null",
            f"model.path={model}",
            "tokenizer.build=null",
            "train.max_steps=3",
            "checkpoint.resume=never",
        ]
        if "disable_dropout" in ModelConfig.model_fields:
            overrides.append("model.disable_dropout=false")  # dropout on: its masks come from the seeded RNG
        run, _ = train(one_rank, config, *overrides)
        modules = run.engines["policy"].module.modules()
        dropouts = [module.p for module in modules if isinstance(module, torch.nn.Dropout)]
        assert dropouts and min(dropouts) > 0
        losses.append([record["loss"] for record in metrics(tmp_path / f"dropout_{attempt}")])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


# ----------------------------------------------------------------------------- chat template


def saved_tokenizer(folder: Path, *, chatml: bool) -> Path:
    """A char tokenizer without a chat template; with the ChatML markers as special tokens or not."""
    characters = sorted(set(SFT_DATA.read_text()))
    special = ["<pad>", "<unk>", "</s>"] + (["<|im_start|>", "<|im_end|>"] if chatml else [])
    vocabulary = {token: index for index, token in enumerate(special + characters)}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="</s>",
        additional_special_tokens=special[3:],
    )
    assert tokenizer.chat_template is None
    tokenizer.save_pretrained(folder)
    return folder


def tokenizer_job(tmp_path: Path, folder: Path, train_type: str, data: Path | None = None):
    config = write_job(tmp_path, "chat", train_type=train_type, data=data)
    return load_job(config, ["tokenizer.build=null", f"tokenizer.path={folder}"])


def test_without_chat_template_or_chatml_markers_a_chat_job_fails(tmp_path):
    folder = saved_tokenizer(tmp_path / "plain", chatml=False)
    assert load_tokenizer(str(folder)).chat_template is None  # no silent ChatML whose markers would be <unk>
    job = tokenizer_job(tmp_path, folder, "sft")
    rows = load_rows(job.data.path, job.data.format, tmp_path / "cache")
    with pytest.raises(TokenizerError, match=r"tokenizer.chat_template: the tokenizer of .*plain has no chat template"):
        make_tokenizer(job, rows, tmp_path / "out", True)
    # seq renders no chats: the same tokenizer trains it
    seq = tokenizer_job(tmp_path, folder, "seq", TEXT_DATA)
    seq_rows = load_rows(seq.data.path, seq.data.format, tmp_path / "cache")
    assert make_tokenizer(seq, seq_rows, tmp_path / "out", True).chat_template is None
    # and a template given in the job is used
    given = ["tokenizer.build=null", f"tokenizer.path={folder}", "tokenizer.chat_template='{{ messages }}'"]
    chat = load_job(tmp_path / "chat.yaml", given)
    assert make_tokenizer(chat, rows, tmp_path / "out", True).chat_template == "{{ messages }}"


def test_chatml_is_taken_when_its_markers_are_tokens(tmp_path):
    folder = saved_tokenizer(tmp_path / "chatml", chatml=True)
    tokenizer = load_tokenizer(str(folder))
    assert has_chatml_markers(tokenizer) and tokenizer.chat_template == CHATML_TEMPLATE
    job = tokenizer_job(tmp_path, folder, "sft")
    made = make_tokenizer(job, load_rows(job.data.path, job.data.format, tmp_path / "cache"), tmp_path / "out", True)
    ids = made.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=True)
    assert made.unk_token_id not in (ids["input_ids"] if isinstance(ids, dict) else ids)


def test_tokenizer_difference_names_what_differs():
    texts = [SFT_DATA.read_text()]
    base = build_tokenizer("char", texts)
    assert tokenizer_difference(base, build_tokenizer("char", texts)) is None
    assert tokenizer_difference(build_tokenizer("char", [texts[0] + "\u00e9"]), base).startswith("vocabulary differs")
    templated = build_tokenizer("char", texts)
    templated.chat_template = "{{ messages }}"
    assert tokenizer_difference(templated, base) == "chat_template differs"
