"""The portable form's tensors read with plain reads (resume/portable.py `TensorFile`), not a memory map:
the same tensors safetensors wrote, bit for bit, and a damaged file named."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from astrai.resume.portable import PortableError, TensorFile


def test_reads_every_tensor_as_safetensors_wrote_it(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(37, 5, generator=generator),
        "norm.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(3.5, dtype=torch.float64),
        "half": torch.randn(2, 3, 4, generator=generator).to(torch.float16),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "fp32.safetensors"))
    opened = TensorFile(tmp_path / "fp32.safetensors")
    for name, expected in tensors.items():
        read = opened.tensor(name)
        assert read.dtype == expected.dtype and read.shape == expected.shape and opened.shape(name) == expected.shape
        assert torch.equal(read.view(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


def test_a_truncated_file_and_an_unknown_name_are_named(tmp_path):
    path = tmp_path / "exp_avg.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.ones(10)}, str(path))
    opened = TensorFile(path)
    with pytest.raises(PortableError, match="no tensor 'c'"):
        opened.tensor("c")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # cut into the last tensor
    last = max(opened.header, key=lambda name: opened.header[name]["data_offsets"][1])
    with pytest.raises(PortableError, match=f"exp_avg.safetensors: truncated inside {last}"):
        TensorFile(path).tensor(last)
    path.write_bytes(b"\x05")
    with pytest.raises(PortableError, match="unreadable safetensors header"):
        TensorFile(path)
