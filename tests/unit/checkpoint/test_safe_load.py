"""Weights-only loading and the static pickle scan (astrai/engine/safe_load.py, astrai/checkpoint/pickles.py).

The allow-list must hold exactly what DeepSpeed's files hold: real engines of every ZeRO stage (one
gloo rank in this process; ZeRO-1/2 kept as such) save, and every file they write must scan clean,
load weights-only, and load back into the engine through AstrAI's checkpoint engine.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.checkpoint.pickles import disallowed_globals, globals_of_torch_bytes
from astrai.engine import CheckpointDamagedError, UnsafeCheckpointError, load_tensor_file, weights_only_torch_load


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


STAGES = [(0, "fp32"), (0, "bf16"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")]


@pytest.mark.parametrize("stage,precision", STAGES)
def test_deepspeed_files_of_every_stage_scan_clean_and_load_weights_only(one_rank, tmp_path, stage, precision):
    from astrai.config.schema import DeepSpeedSection
    from astrai.engine import build_ds_config, make_engine

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            tie_word_embeddings=True,
        )
    )
    section = DeepSpeedSection(zero_stage=stage, single_rank_stage0=False)  # ZeRO-1/2 kept on one rank
    config = build_ds_config(
        section,
        template_path=None,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_grad_norm=1.0,
        precision=precision,
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        world_size=1,
    )
    engine = make_engine(model, config, weight_decay=0.1, schedule=lambda completed: 1.0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save(tmp_path / "part")
    files = sorted((tmp_path / "part").rglob("*.pt"))
    assert len(files) == (1 if stage == 0 else 2)
    for path in files:
        assert disallowed_globals(path) == [], path
        assert isinstance(load_tensor_file(path), dict)
    with engine.gathered_parameters():
        saved = {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.load(tmp_path / "part")  # DeepSpeed's own load, every file read weights-only
    with engine.gathered_parameters():
        assert all(torch.equal(tensor, saved[name]) for name, tensor in engine.module.state_dict().items())


def test_the_scan_names_globals_whatever_the_protocol(tmp_path):
    marker = tmp_path / "marker"
    # Protocols 0-1: GLOBAL text opcodes; 4-5: STACK_GLOBAL, the second time from memoised strings.
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps([Payload(marker), Payload(marker)], protocol=protocol)
        assert "posix.system" in globals_of_torch_bytes(data), protocol
    # STACK_GLOBAL whose names are not plain strings on the stack cannot be named: reported as such, never allowed.
    computed = b"\x80\x04" + b"K\x01K\x02\x93" + b"."
    assert globals_of_torch_bytes(computed) == ["<computed name>"]
    assert globals_of_torch_bytes(b"not a pickle at all") == []
    for zipped in (True, False):
        path = tmp_path / f"payload_{zipped}.pt"
        torch.save({"weights": torch.ones(2), "payload": Payload(marker)}, path, _use_new_zipfile_serialization=zipped)
        assert disallowed_globals(path) == ["posix.system"]
    assert not marker.exists()


def test_a_tensor_pickled_by_pickle_is_scanned_inside_its_storage_bytes():
    data = pickle.dumps({"state": torch.ones(3, dtype=torch.uint8)})
    assert any(op.name in ("BINBYTES", "SHORT_BINBYTES") for op, _, _ in pickletools.genops(io.BytesIO(data)))
    assert "torch.ByteStorage" in globals_of_torch_bytes(data)  # named only inside the embedded legacy torch file


def test_torch_load_is_weights_only_inside_the_block_and_restored_after(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "payload.pt"
    torch.save({"payload": Payload(marker)}, path)
    original = torch.load
    with weights_only_torch_load():
        with pytest.raises(UnsafeCheckpointError, match=f"{path}: refused: holds a pickle naming posix.system"):
            torch.load(path, weights_only=False)  # what DeepSpeed's readers call
    assert torch.load is original and not marker.exists()
    truncated = tmp_path / "truncated.pt"
    torch.save({"weights": torch.ones(1000)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:2000])
    with pytest.raises(CheckpointDamagedError, match=f"{truncated}: unreadable"):
        load_tensor_file(truncated)
