"""Loading checkpoint files without running code from them.

A pickle calls whatever its globals name, so `torch.load(weights_only=False)` of a crafted shard runs
its author's code. Every file AstrAI or DeepSpeed reads from a checkpoint goes through
`torch.load(weights_only=True)` instead, with exactly the extra classes DeepSpeed's own files hold
allowed by name (`astrai.checkpoint.pickles.DEEPSPEED_GLOBALS`):

- `load_tensor_file`: AstrAI's own reads (ZeRO-0 consolidation, the portable conversion).
- `SafeTorchCheckpointEngine`: DeepSpeed's engine reads every shard through `engine.checkpoint_engine.load`;
  for the length of a `load_checkpoint` its default engine is replaced by this one (`trusted_loads`).
- `weights_only_torch_load`: DeepSpeed's standalone readers (`zero_to_fp32`, `ds_to_universal`, the
  ZeRO-3 universal loader) call `torch.load(..., weights_only=False)` themselves, with no hook; inside
  this block `torch.load` is one that always loads weights-only. That is the one way short of copying
  those readers.
- `load_snapshot_pickle`: the RNG snapshots of checkpoints written before RNG states became JSON
  (a base64 pickle), unpickled with only the few globals such a snapshot holds.

A refused file raises `UnsafeCheckpointError` naming it and the globals; an unreadable one (truncated,
corrupt) `CheckpointDamagedError`, which a resume answers by falling back to the previous checkpoint. So
does a file whose bytes are not those its manifest recorded: during a resume's load (within
`astrai.checkpoint.read_check.checking_reads`) each file `load_tensor_file` reads is hashed beside the read.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from astrai.checkpoint import CheckpointError, CheckpointVerifyError
from astrai.checkpoint.pickles import DEEPSPEED_GLOBALS, TENSOR_FILE_GLOBALS, PickleScanError, globals_of_file
from astrai.checkpoint.read_check import read_checked

_TORCH_LOAD = torch.load  # the real one, whatever `weights_only_torch_load` puts in its place meanwhile


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holding a pickle that names code (anything but tensors and DeepSpeed's data types)."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint file that cannot be read: truncated, corrupt, or not what its name says."""


def _resolve(qualified: str):
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def deepspeed_globals() -> tuple:
    """DeepSpeed's classes its checkpoint files hold, resolved from their names (imports deepspeed)."""
    return tuple(_resolve(name) for name in sorted(DEEPSPEED_GLOBALS))


def _describe(source) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else f"<{type(source).__name__}>"


def _named_code(source, error: Exception) -> list[str]:
    """The globals outside the allow-list a refused file names (read statically), or torch's words for them."""
    if isinstance(source, (str, os.PathLike)):
        try:
            return sorted(set(globals_of_file(Path(source))) - TENSOR_FILE_GLOBALS)
        except (OSError, PickleScanError):
            pass
    message = str(error)
    marker = "Unsupported global: GLOBAL "
    if marker in message:
        return [message.split(marker, 1)[1].split()[0]]
    return []


def load_tensor_file(source, *, map_location=None, mmap: bool | None = None, **options):
    """`torch.load(source, weights_only=True)` with DeepSpeed's data classes allowed; `source` a path or file object.

    Raises UnsafeCheckpointError when the file names anything else (naming the file and the globals),
    CheckpointDamagedError when it cannot be read at all, or (within `read_check.checking_reads`, a
    resume's load) when its bytes are not those its manifest recorded: hashed beside the read."""
    options.pop("pickle_module", None)  # weights-only loading brings its own unpickler
    options.pop("weights_only", None)
    try:
        return read_checked(source, lambda: _load_weights_only(source, map_location, mmap, options))
    except CheckpointVerifyError as error:  # a wrong digest: damage, as an unreadable file is
        raise CheckpointDamagedError(str(error)) from None


def _load_weights_only(source, map_location, mmap: bool | None, options: dict):
    try:
        with torch.serialization.safe_globals(list(deepspeed_globals())):
            return _TORCH_LOAD(source, map_location=map_location, weights_only=True, mmap=mmap, **options)
    except pickle.UnpicklingError as error:
        code = _named_code(source, error)
        if code:
            raise UnsafeCheckpointError(
                f"{_describe(source)}: refused: holds a pickle naming {', '.join(code)}, which is code, "
                "not checkpoint data "
                "(loading it would run it)"
            ) from None
        raise CheckpointDamagedError(f"{_describe(source)}: unreadable ({_first_line(error)})") from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError) as error:
        detail = f"{type(error).__name__}: {_first_line(error)}"
        raise CheckpointDamagedError(f"{_describe(source)}: unreadable ({detail})") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def weights_only_torch_load():
    """Within the block, every `torch.load` (DeepSpeed's `weights_only=False` ones included) is `load_tensor_file`."""
    previous = torch.load

    def load(source, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **options):
        return load_tensor_file(source, map_location=map_location, mmap=mmap, **options)

    torch.load = load
    try:
        yield
    finally:
        torch.load = previous


@functools.cache
def _safe_engine_class():
    """DeepSpeed's TorchCheckpointEngine with `load` weights-only (deepspeed imported at first use, as everywhere)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """Loads every file weights-only; `inspect(path, state)` sees each loaded file before DeepSpeed uses it."""

        def __init__(self, original: TorchCheckpointEngine, inspect: Callable[[str, object], None] | None):
            CheckpointEngine.__init__(self)  # not TorchCheckpointEngine's: it logs a line per construction
            self.name = original.name
            self.zipfile_serialization = original.zipfile_serialization
            self._inspect = inspect

        def load(self, path: str, map_location=None):
            state = load_tensor_file(path, map_location=map_location)
            if self._inspect is not None:
                self._inspect(path, state)
            return state

    return TorchCheckpointEngine, SafeTorchCheckpointEngine


@contextlib.contextmanager
def trusted_loads(ds_engine, inspect: Callable[[str, object], None] | None = None):
    """For the block, `ds_engine` reads its checkpoint files weights-only: its default checkpoint engine
    replaced by `SafeTorchCheckpointEngine` (`inspect` sees each file), and any `torch.load` a
    configured engine or DeepSpeed itself calls made weights-only."""
    default_class, safe_class = _safe_engine_class()
    original = getattr(ds_engine, "checkpoint_engine", None)
    replaced = type(original) is default_class
    if replaced:
        ds_engine.checkpoint_engine = safe_class(original, inspect)
    try:
        with weights_only_torch_load():
            yield
    finally:
        if replaced:
            ds_engine.checkpoint_engine = original


# The RNG snapshot format before JSON: pickle.dumps({"python": ..., "numpy": ..., "torch": tensor[, "cuda": ...]}).


def _storage_from_bytes(data: bytes):
    """`torch.storage._load_from_bytes` (how `pickle` stores a tensor's storage), weights-only."""
    return load_tensor_file(io.BytesIO(data), map_location="cpu")


@functools.cache
def _snapshot_globals() -> dict[tuple[str, str], object]:
    import collections

    import numpy

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return {
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # written by numpy 1.x
        ("numpy", "ndarray"): numpy.ndarray,
        ("numpy", "dtype"): numpy.dtype,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }


class _RefusedGlobal(pickle.UnpicklingError):
    """A global outside the snapshot's allow-list (its "module.name" is the message)."""


class _SnapshotUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _snapshot_globals().get((module, name))
        if found is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return found


def load_snapshot_pickle(data: bytes, source: Path):
    """Unpickle an old-format RNG snapshot of `source` (trainer_state.json) with only numpy arrays and
    torch tensors allowed; UnsafeCheckpointError naming the file for anything else."""
    try:
        return _SnapshotUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as error:
        raise UnsafeCheckpointError(
            f"{source}: refused: an RNG state is a pickle naming {error}, which is code, not an RNG state "
            "(loading it would run it)"
        ) from None
    except CheckpointError as error:  # a tensor's storage inside the snapshot: refused or unreadable
        raise type(error)(f"{source}: in an RNG state: {error}") from None
    except Exception as error:  # a damaged pickle raises whatever its opcodes lead to
        detail = f"{type(error).__name__}: {error}"
        raise CheckpointDamagedError(f"{source}: an RNG state does not unpickle ({detail})") from None
