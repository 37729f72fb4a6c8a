"""The portable form of one engine's checkpoint: full (unpartitioned) fp32 state, no topology.

```
<part>/fp32.safetensors        every trainable parameter, full shape, fp32 (the master weights)
<part>/exp_avg.safetensors     Adam's first moment, same names and shapes
<part>/exp_avg_sq.safetensors  Adam's second moment
<part>/portable.json           names (optimizer order), optimizer step, LR-schedule state, step counters
```
This module owns the format: `write_portable_part` writes it from what
`astrai.engine.portable_state.read_deepspeed_state` reads out of DeepSpeed's own files (any ZeRO
stage, any number of ranks); `PortablePart` opens it for `Engine.load_full_state`, whose `fill_*`
(in astrai/engine/, the only package that knows DeepSpeed's layouts) set it into a live engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from astrai.engine.portable_state import STATE_KEYS, PortableError, read_deepspeed_state

__all__ = ["INFO_FILE", "STATE_KEYS", "PartInfo", "PortableError", "PortablePart", "write_portable_part"]

PART_FORMAT = "astrai-portable-part"
PART_VERSION = 1
INFO_FILE = "portable.json"


@dataclass
class PartInfo:
    """portable.json: what is not a tensor. `names` in optimizer order; counters as DeepSpeed's engine has them."""

    names: list[str]
    optimizer_step: int
    lr_scheduler: dict | None
    global_steps: int
    global_samples: int
    skipped_steps: int
    source_zero_stage: int
    format: str = PART_FORMAT
    version: int = PART_VERSION


def write_portable_part(engine_folder: Path, destination: Path, scratch: Path, tag: str) -> PartInfo:
    """Read one engine's DeepSpeed checkpoint (any ZeRO stage, any number of ranks) and write its
    portable form into `destination` (created). `scratch` is a work folder (removed afterwards)."""
    with read_deepspeed_state(engine_folder, scratch, tag) as source:
        destination.mkdir(parents=True, exist_ok=True)
        for key in STATE_KEYS:  # one state in memory at a time
            save_file(source.tensors(key), str(destination / f"{key}.safetensors"))
    info = PartInfo(names=source.names, optimizer_step=source.step, source_zero_stage=source.stage, **source.counters)
    try:
        text = json.dumps(asdict(info), indent=1)
    except TypeError as error:
        raise PortableError(f"{engine_folder}: the LR-scheduler state is not plain data ({error})") from error
    (destination / INFO_FILE).write_text(text)
    return info


class PortablePart:
    """A portable part opened for loading: `tensor(key, name)` reads one full fp32 tensor lazily."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        try:
            document = json.loads((self.folder / INFO_FILE).read_text())
        except (OSError, ValueError) as error:
            raise PortableError(f"{self.folder}: unreadable {INFO_FILE} ({error})") from error
        if document.get("format") != PART_FORMAT or document.get("version", 0) > PART_VERSION:
            raise PortableError(f"{self.folder}: {INFO_FILE} is not a portable part this AstrAI reads")
        self.info = PartInfo(**document)
        self._files = {key: TensorFile(self.folder / f"{key}.safetensors") for key in STATE_KEYS}

    @property
    def names(self) -> list[str]:
        return self.info.names

    def tensor(self, key: str, name: str) -> torch.Tensor:
        return self._files[key].tensor(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full shape, read from the safetensors header (no tensor is read)."""
        return {name: self._files["fp32"].shape(name) for name in self.names}


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class TensorFile:
    """A safetensors file read one tensor at a time with plain reads into a fresh tensor, not through a
    memory map: every mapped page a load touches stays in the process's RSS until the file is closed, and
    a resume reads every tensor of a part's three files (weights and both Adam moments: 3x the model's
    fp32 size on every rank, on top of the engine's own state). Read this way, only the tensor being
    placed is held."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(length))
        except (OSError, ValueError) as error:
            raise PortableError(f"{self.path}: unreadable safetensors header ({error})") from error
        header.pop("__metadata__", None)
        self.header, self.data_start = header, 8 + length

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        if name not in self.header:
            raise PortableError(f"{self.path}: no tensor {name!r}")
        return self.header[name]

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        if entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise PortableError(f"{self.path}: {name} has dtype {entry.get('dtype')!r}, not a float type")
        begin, end = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        if view.nbytes != end - begin:
            raise PortableError(f"{self.path}: {name} holds {end - begin} bytes, its shape needs {view.nbytes}")
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.data_start + begin)
            done = 0
            while done < view.nbytes:
                count = handle.readinto(view[done:])
                if not count:
                    raise PortableError(f"{self.path}: truncated inside {name}")
                done += count
        return tensor
