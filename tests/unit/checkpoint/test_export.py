"""Hugging Face export (`astrai/export/hf.py`) of a real checkpoint written by the real trainer.

One tiny SFT run (one process, ~10 s) writes checkpoints at steps 3 and 5 for the whole module. The
reference for every logits check is independent of the export code path: DeepSpeed's consolidated
weights loaded into the model `build_policy` builds, exactly as training built it. One export runs as
the real `python -m astrai export-hf` subprocess (the fp16 one); the others call the same code in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from astrai.export import hf as export
from astrai.export.cli import export_main
from astrai.export.hf import export_checkpoint, export_finished_run
from astrai.export.weights import ExportError, resolve_checkpoint
from tests.conftest import REPO, child_env, python, run_bounded

TINY_RUN = [
    "train.max_steps=5",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=null",
    "train.micro_batch_size=4",
    "model.init.hidden_size=32",
    "model.init.intermediate_size=64",
    "model.init.num_hidden_layers=2",
    "runtime.progress_bar=false",
    "runtime.tensorboard=false",
]
NO_CRITIC = "checkpoint has no critic part (only online_ppo jobs have one)"
# fp16 keeps 11 significant bits (relative rounding <= 2**-11 ~ 4.9e-4 per weight); with the forward
# itself in fp16 the logits (|logit| < 1 here) of this 2-layer model moved by 3.5e-4 (measured; bf16:
# 2.4e-3). 2e-3 leaves room for other CPUs and is still far below what one wrong tensor does (~0.1-1).
FP16_LOGITS_ATOL = 2e-3
PHASES = ("consolidating weights", "casting to fp32", "writing shards", "flushing to disk")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """output_dir of a finished 5-step run of configs/quickstart.yaml, shrunk."""
    output_dir = tmp_path_factory.mktemp("run") / "out"
    command = [python(), "astrai/train.py", "--config", "configs/quickstart.yaml", "--set", f"output_dir={output_dir}"]
    for assignment in TINY_RUN:
        command += ["--set", assignment]
    finished = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-4000:]
    return output_dir


@pytest.fixture(scope="module")
def checkpoint(trained) -> Path:
    return trained / "checkpoints" / "step_00000005"


@pytest.fixture(scope="module")
def reference(trained, checkpoint):
    """(model, consolidated state) rebuilt without the export code: build_policy + load_state_dict."""
    from astrai.config import load_job
    from astrai.engine import consolidated_state_dict
    from astrai.models.policy import build_policy
    from astrai.models.tokenizer import load_tokenizer

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    model = build_policy(job.model, load_tokenizer(str(trained / "tokenizer")), job.train.seed)
    state = consolidated_state_dict(checkpoint / "policy")
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    return model.eval(), state


@pytest.fixture(scope="module")
def exported(tmp_path_factory, checkpoint) -> Path:
    """The default export (fp32, one shard), shared by the read-only tests."""
    return export_checkpoint(checkpoint, tmp_path_factory.mktemp("exports") / "hf")


def fixed_batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits_of(model, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch).logits.float()


def hidden_leftovers(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.parent.iterdir() if entry.name.startswith(f".{folder.name}."))


def test_export_loads_with_transformers_and_matches_the_consolidated_weights(exported, reference):
    model, _ = reference
    loaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    batch = fixed_batch(model.config.vocab_size)
    torch.testing.assert_close(logits_of(loaded, batch), logits_of(model, batch), atol=1e-5, rtol=0)
    assert sorted(os.listdir(exported)) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        ]
    )
    assert oct(os.stat(exported / "model.safetensors").st_mode & 0o044) == oct(0o044)  # readable by others


def test_tied_embeddings_stay_tied(exported):
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    assert loaded.config.tie_word_embeddings is True
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    with safe_open(exported / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()  # one copy on disk


def test_tokenizer_chat_template_and_generate(exported, trained):
    tokenizer = AutoTokenizer.from_pretrained(exported)
    trained_tokenizer = AutoTokenizer.from_pretrained(trained / "tokenizer")
    assert tokenizer.get_vocab() == trained_tokenizer.get_vocab()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+7="}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[0] == 1 and inputs["input_ids"].shape[1] < output.shape[1] <= inputs["input_ids"].shape[1] + 4


def test_bf16_export_holds_the_weights_cast_to_bf16(tmp_path, checkpoint, reference):
    _, state = reference
    destination = export_checkpoint(checkpoint, tmp_path / "hf", dtype="bf16", verify=False)
    with safe_open(destination / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(state) - {"lm_head.weight"}
        for name in weights.keys():
            tensor = weights.get_tensor(name)
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    loaded = AutoModelForCausalLM.from_pretrained(destination, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert json.loads((destination / "config.json").read_text())["dtype"] == "bfloat16"


def test_fp16_export_by_the_cli_loads_and_gives_the_fp32_logits_within_fp16_rounding(tmp_path, checkpoint, reference):
    """The real `python -m astrai export-hf` process: stdout is the destination and nothing else."""
    model, state = reference
    destination = tmp_path / "hf"
    command = [python(), "-m", "astrai", "export-hf", str(checkpoint), str(destination), "--dtype", "fp16"]
    finished = run_bounded(command, timeout=120, cwd=REPO, env=child_env())
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout == f"{destination}\n", finished.stdout  # DeepSpeed's own prints went to stderr
    assert "verified" in finished.stderr
    with safe_open(destination / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(state) - {"lm_head.weight"}
        for name in weights.keys():
            assert torch.equal(weights.get_tensor(name), state[name].to(torch.float16)), name
    loaded = AutoModelForCausalLM.from_pretrained(destination, dtype="auto").eval()
    assert loaded.dtype == torch.float16
    batch = fixed_batch(model.config.vocab_size)
    torch.testing.assert_close(logits_of(loaded, batch), logits_of(model, batch), atol=FP16_LOGITS_ATOL, rtol=0)


def test_exported_tokenizer_encodes_and_renders_chats_as_in_training(exported, checkpoint, tmp_path):
    """Against the tokenizer as training made it (`make_tokenizer`: built in memory from the data),
    through the training's own rendering (`chat_ids_and_mask`), on real rows and a multi-turn chat."""
    from astrai.config import load_job
    from astrai.data.render import chat_ids_and_mask, row_messages
    from astrai.data.sources import load_rows
    from astrai.training.build import make_tokenizer

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    rows = load_rows(str(REPO / job.data.path), job.data.format, tmp_path / "cache")
    training = make_tokenizer(job, rows, tmp_path, is_main=False)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template == training.chat_template
    special = ("eos_token_id", "pad_token_id", "bos_token_id")
    assert [getattr(tokenizer, name) for name in special] == [getattr(training, name) for name in special]
    chats = [row_messages(rows.dataset[index], index, job.data) for index in range(6)]
    multi_turn = [{"role": "system", "content": "Reply with the number."}] + [
        message for chat in chats[:3] for message in chat
    ]
    assert len(multi_turn) == 7
    for chat in [*chats, multi_turn]:
        for message in chat:
            assert tokenizer.encode(message["content"]) == training.encode(message["content"]), message
        for generation_prompt in (False, True):
            rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
            assert rendered == training.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt
            )
        assert chat_ids_and_mask(tokenizer, chat) == chat_ids_and_mask(training, chat)  # ids and loss mask as trained
    text = tokenizer.apply_chat_template(multi_turn, tokenize=False)
    assert text.count("<|im_start|>") == 7 and text.endswith("<|im_end|>\n")
    ids, mask = chat_ids_and_mask(tokenizer, multi_turn)
    assert tokenizer.unk_token_id not in tokenizer.encode(
        chats[0][0]["content"]
    )  # the data's characters are in the vocab
    assert sum(mask) == sum(
        len(tokenizer.encode(m["content"] + "<|im_end|>\n")) for m in multi_turn if m["role"] == "assistant"
    )


def test_small_max_shard_size_writes_an_index(tmp_path, checkpoint, reference):
    model, _ = reference
    code = export_main([str(checkpoint), str(tmp_path / "hf"), "--max-shard-size", "20KB", "--no-verify"])
    assert code == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    batch = fixed_batch(model.config.vocab_size)
    torch.testing.assert_close(logits_of(loaded, batch), logits_of(model, batch), atol=1e-5, rtol=0)


def test_non_empty_destination_needs_overwrite(tmp_path, checkpoint, capsys):
    destination = tmp_path / "hf"
    destination.mkdir()
    (destination / "keep.txt").write_text("mine")
    assert export_main([str(checkpoint), str(destination), "--no-verify"]) == 1
    assert "not empty (use --overwrite" in capsys.readouterr().err
    assert os.listdir(destination) == ["keep.txt"]
    assert export_main([str(checkpoint), str(destination), "--no-verify", "--overwrite"]) == 0
    assert "keep.txt" not in os.listdir(destination) and (destination / "model.safetensors").is_file()
    assert hidden_leftovers(destination) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main([str(checkpoint), str(empty), "--no-verify"]) == 0  # an empty folder is fine


def listing(folder: Path) -> dict[str, int]:
    """Every file below `folder` with its size: what a refused export must leave exactly as it was."""
    return {str(path.relative_to(folder)): path.stat().st_size for path in sorted(folder.rglob("*")) if path.is_file()}


def test_overwrite_never_replaces_a_run_folder_or_a_checkpoint(tmp_path, trained, checkpoint, capsys):
    run_copy = tmp_path / "run"
    shutil.copytree(trained, run_copy)
    before = listing(run_copy)
    assert export_main([str(checkpoint), str(run_copy), "--no-verify", "--overwrite"]) == 1
    error = capsys.readouterr().err
    assert f"destination {run_copy} is a training run's folder (it holds checkpoints, metrics.jsonl, job.yaml)" in error
    assert listing(run_copy) == before
    # A folder that only holds a checkpoint, deep down (and no run files) is refused too, naming the manifest.
    holder = tmp_path / "holder"
    shutil.copytree(checkpoint, holder / "saved" / "best")
    (holder / "notes.txt").write_text("mine")
    before = listing(holder)
    assert export_main([str(checkpoint), str(holder), "--no-verify", "--overwrite"]) == 1
    manifest = holder / "saved" / "best" / "manifest.json"
    assert f"destination {holder} holds a checkpoint ({manifest})" in capsys.readouterr().err
    assert listing(holder) == before
    # The checkpoint folder itself, and export.on_finish pointed at the output_dir: refused, nothing deleted.
    before, own = listing(run_copy), run_copy / "checkpoints" / checkpoint.name
    with pytest.raises(ExportError, match="holds a checkpoint"):
        export_checkpoint(own, run_copy / "checkpoints", verify=False, overwrite=True)
    with pytest.raises(ExportError, match="is a training run's folder"):
        export_checkpoint(own, run_copy, verify=False, overwrite=True)
    assert listing(run_copy) == before


def test_corrupt_checkpoint_is_refused_unless_no_verify(tmp_path, checkpoint, capsys):
    copy = shutil.copytree(checkpoint, tmp_path / "step_00000005")
    state_file = copy / "trainer_state.json"
    data = bytearray(state_file.read_bytes())
    data[1] ^= 0x01  # same size, different digest
    state_file.write_bytes(bytes(data))
    assert export_main([str(copy), str(tmp_path / "hf")]) == 1
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1
        and "wrong digest" in error
        and "trainer_state.json" in error
        and "Traceback" not in error
    )
    assert not (tmp_path / "hf").exists()
    assert export_main([str(copy), str(tmp_path / "hf"), "--no-verify"]) == 0


def test_legacy_checkpoint_warns_and_exports(tmp_path, checkpoint, caplog):
    copy = shutil.copytree(checkpoint, tmp_path / "step_00000005")
    (copy / "manifest.json").unlink()
    with caplog.at_level("WARNING", logger="astrai.export"):
        export_checkpoint(copy, tmp_path / "hf")
    assert "legacy checkpoint" in caplog.text
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_unknown_part_is_refused(tmp_path, checkpoint, capsys):
    assert export_main([str(checkpoint), str(tmp_path / "hf"), "--part", "foo"]) == 2  # argparse's usage error
    error = capsys.readouterr().err
    assert "argument --part: invalid choice: 'foo'" in error and "policy" in error and "critic" in error
    with pytest.raises(ExportError, match=r"--part: unknown part 'foo' \(use one of policy, critic\)"):
        export_checkpoint(checkpoint, tmp_path / "hf", part="foo")
    assert not (tmp_path / "hf").exists()


def test_critic_part_gives_a_clear_error(tmp_path, checkpoint, capsys):
    assert export_main([str(checkpoint), str(tmp_path / "hf"), "--part", "critic"]) == 1
    assert NO_CRITIC in capsys.readouterr().err
    copy = shutil.copytree(checkpoint, tmp_path / "with_critic", ignore=shutil.ignore_patterns("manifest.json"))
    (copy / "critic").mkdir()  # a critic part without DeepSpeed files (real critic exports: test_ppo_engines.py)
    with pytest.raises(ExportError, match="cannot read the DeepSpeed weights in .*critic"):
        export_checkpoint(copy, tmp_path / "hf", part="critic")
    assert not (tmp_path / "hf").exists()


def test_checkpoint_argument_may_be_an_output_dir_or_checkpoints_folder(trained, checkpoint, tmp_path, capsys):
    assert resolve_checkpoint(trained) == checkpoint  # newest of step 3 and step 5
    assert resolve_checkpoint(trained / "checkpoints") == checkpoint
    assert resolve_checkpoint(trained / "checkpoints" / "step_00000003").name == "step_00000003"
    assert export_main([str(tmp_path / "nowhere"), str(tmp_path / "hf")]) == 1
    assert "no such directory" in capsys.readouterr().err
    assert export_main([str(tmp_path), str(tmp_path / "hf")]) == 1
    assert "no published checkpoint" in capsys.readouterr().err
    assert export_main([str(checkpoint), str(tmp_path / "hf"), "--dtype", "int8"]) == 2  # argparse's usage error


def test_progress_bar_covers_consolidation_and_writing_for_large_exports(tmp_path, checkpoint, monkeypatch, capsys):
    """Off for a small export into a pipe (no terminal); on past LARGE_MODEL_BYTES (forced to 0 here),
    naming each slow phase as it runs; `progress=False` (runtime.progress_bar: false) keeps it off."""
    assert export_main([str(checkpoint), str(tmp_path / "small"), "--no-verify"]) == 0
    assert "export-hf: consolidating" not in capsys.readouterr().err
    monkeypatch.setattr(export, "LARGE_MODEL_BYTES", 0)
    assert export_main([str(checkpoint), str(tmp_path / "large"), "--no-verify"]) == 0
    error = capsys.readouterr().err
    positions = [error.find(f"export-hf: {name}") for name in PHASES]
    assert -1 not in positions and positions == sorted(positions), error
    assert "4/4 phases" in error
    export_checkpoint(checkpoint, tmp_path / "quiet", verify=False, progress=False)
    assert "export-hf: consolidating" not in capsys.readouterr().err


def test_crash_while_writing_leaves_no_destination_and_keeps_an_earlier_export(
    tmp_path, checkpoint, monkeypatch, exported
):
    real_write = export.write_files

    def write_then_fail(model, tokenizer, staging, max_shard_size):
        real_write(model, tokenizer, staging, max_shard_size)  # a complete-looking folder, even
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_files", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(checkpoint, tmp_path / "fresh", verify=False)
    assert not (tmp_path / "fresh").exists() and hidden_leftovers(tmp_path / "fresh") == []

    earlier = shutil.copytree(exported, tmp_path / "earlier")
    before = {name: (earlier / name).read_bytes() for name in os.listdir(earlier)}
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(checkpoint, earlier, verify=False, overwrite=True)
    assert {name: (earlier / name).read_bytes() for name in os.listdir(earlier)} == before
    assert hidden_leftovers(earlier) == []
    AutoModelForCausalLM.from_pretrained(earlier)


def test_failed_final_rename_puts_the_earlier_export_back(tmp_path, checkpoint, monkeypatch, exported):
    earlier = shutil.copytree(exported, tmp_path / "earlier")
    before = sorted(os.listdir(earlier))
    real_rename = os.rename

    def failing_rename(source, destination):
        if ".staging-" in str(source):
            raise OSError(5, "Input/output error")
        real_rename(source, destination)

    monkeypatch.setattr(export.os, "rename", failing_rename)
    with pytest.raises(OSError, match="Input/output"):
        export_checkpoint(checkpoint, earlier, verify=False, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(earlier)) == before and hidden_leftovers(earlier) == []


def test_stale_staging_of_a_killed_export_is_removed(tmp_path, checkpoint):
    stale = tmp_path / ".hf.staging-0123abcd"
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # what a kill -9 mid-write leaves: hidden, never "hf"
    export_checkpoint(checkpoint, tmp_path / "hf", verify=False)
    assert not stale.exists() and (tmp_path / "hf" / "config.json").is_file()


def test_model_path_job_rebuilds_from_the_model_folder(tmp_path, checkpoint, exported, reference):
    """A job that fine-tuned a local HF folder: architecture and tokenizer come from `model.path`."""
    model, _ = reference
    copy = shutil.copytree(checkpoint, tmp_path / "step_00000005", ignore=shutil.ignore_patterns("manifest.json"))
    job = yaml.safe_load((copy / "job.yaml").read_text())
    job["model"].update(path=str(exported), init=None)
    job["tokenizer"]["build"] = None
    (copy / "job.yaml").write_text(yaml.safe_dump(job))
    destination = export_checkpoint(copy, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(destination)
    batch = fixed_batch(model.config.vocab_size)
    torch.testing.assert_close(logits_of(loaded, batch), logits_of(model, batch), atol=1e-5, rtol=0)
    assert AutoTokenizer.from_pretrained(destination).get_vocab() == AutoTokenizer.from_pretrained(exported).get_vocab()


def test_export_finished_run_replaces_the_previous_export(tmp_path, trained, checkpoint, monkeypatch, capsys):
    from astrai.config import load_job

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    assert job.runtime.progress_bar is False  # TINY_RUN: so even a "large" on_finish export shows no bar
    monkeypatch.setattr(export, "LARGE_MODEL_BYTES", 0)
    with pytest.raises(ExportError, match="needs export.hf_dir"):
        export_finished_run(job.model_copy(update={"export": job.export.model_copy(update={"hf_dir": None})}))
    destination = tmp_path / "hf"
    destination.mkdir()
    (destination / "old.txt").write_text("previous export")
    job = job.model_copy(update={"export": job.export.model_copy(update={"hf_dir": str(destination), "dtype": "bf16"})})
    assert export_finished_run(job) == destination
    assert not (destination / "old.txt").exists()
    assert AutoModelForCausalLM.from_pretrained(destination, dtype="auto").dtype == torch.bfloat16
    assert "export-hf: consolidating" not in capsys.readouterr().err
