"""One rank's RNG states (Python's `random`, numpy, torch, CUDA) as plain JSON data, for trainer_state.json.

```
{"python": [version, [625 ints], gauss_next | null],           random.getstate()
 "numpy":  ["MT19937", [624 uint32], pos, has_gauss, cached],   numpy.random.get_state()
 "torch":  "<base64 of the uint8 state tensor's bytes>",        torch.get_rng_state()
 "cuda":   "<base64 ...>"}                                       torch.cuda.get_rng_state(), when there is a GPU
```
No pickle: a checkpoint holds data, never code. Checkpoints written before this format hold each
rank's state as a base64 pickle of the same objects; `decode_rng` still reads those, unpickling with
only numpy arrays and torch tensors allowed (`engine.load_snapshot_pickle`), and refuses any other
payload naming the file.
"""

from __future__ import annotations

import base64
import binascii
import random
from pathlib import Path

import numpy
import torch

from astrai.checkpoint import CheckpointError
from astrai.engine import load_snapshot_pickle

PYTHON_STATE_WORDS = 625  # Mersenne Twister: 624 words and the position
NUMPY_STATE_WORDS = 624


def _tensor_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def capture_rng() -> dict:
    """This rank's RNG states as JSON-ready data (module docstring)."""
    version, words, gauss_next = random.getstate()
    name, keys, position, has_gauss, cached = numpy.random.get_state()
    snapshot = {
        "python": [version, list(words), gauss_next],
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached)],
        "torch": _tensor_text(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        snapshot["cuda"] = _tensor_text(torch.cuda.get_rng_state())
    return snapshot


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _words(value, count: int, bound: int) -> bool:
    """`count` integers in [0, bound]."""
    if not isinstance(value, list) or len(value) != count:
        return False
    return all(_is_int(item) and 0 <= item <= bound for item in value)


def _python_state_ok(state) -> bool:
    """[version, 625 words, gauss_next or null] (random.getstate())."""
    return (
        isinstance(state, list)
        and len(state) == 3
        and _is_int(state[0])
        and _words(state[1], PYTHON_STATE_WORDS, 2**32)
        and (state[2] is None or isinstance(state[2], (int, float)))
    )


def _numpy_state_ok(state) -> bool:
    """[name, 624 uint32, pos, has_gauss, cached_gaussian] (numpy.random.get_state())."""
    return (
        isinstance(state, list)
        and len(state) == 5
        and isinstance(state[0], str)
        and _words(state[1], NUMPY_STATE_WORDS, 2**32 - 1)
        and _is_int(state[2])
        and _is_int(state[3])
        and isinstance(state[4], (int, float))
    )


def _from_pickle(entry: str, source: Path, rank: int) -> dict:
    """An old-format entry (base64 pickle of the native states) converted to the JSON format."""
    try:
        data = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        raise CheckpointError(f"{source}: rng[{rank}] is neither an RNG state nor a base64 string") from None
    snapshot = load_snapshot_pickle(data, source)
    try:
        version, words, gauss_next = snapshot["python"]
        name, keys, position, has_gauss, cached = snapshot["numpy"]
        converted = {
            "python": [version, list(words), gauss_next],
            "numpy": [name, numpy.asarray(keys).tolist(), int(position), int(has_gauss), float(cached)],
            "torch": _tensor_text(snapshot["torch"]),
        }
        if "cuda" in snapshot:
            converted["cuda"] = _tensor_text(snapshot["cuda"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        detail = f"{type(error).__name__}: {error}"
        raise CheckpointError(f"{source}: rng[{rank}] (an old-format RNG state) is not one: {detail}") from None
    return converted


def decode_rng(entry, source: Path, rank: int) -> dict:
    """Rank `rank`'s entry of trainer_state.json `rng`, validated, in the JSON format (old ones converted).
    CheckpointError naming `source` and the bad key; UnsafeCheckpointError for a pickle naming code."""
    where = f"{source}: rng[{rank}]"
    if isinstance(entry, str):
        entry = _from_pickle(entry, source, rank)
    if not isinstance(entry, dict) or not {"python", "numpy", "torch"} <= set(entry):
        found = type(entry).__name__
        raise CheckpointError(f"{where} must be an object with python, numpy and torch states, got {found}")
    if not _python_state_ok(entry["python"]):
        raise CheckpointError(f"{where}.python must be [version, {PYTHON_STATE_WORDS} integers, gauss_next or null]")
    if not _numpy_state_ok(entry["numpy"]):
        raise CheckpointError(f"{where}.numpy must be [name, {NUMPY_STATE_WORDS} uint32, pos, has_gauss, cached]")
    for key in ("torch", "cuda"):
        if key in entry:
            try:
                base64.b64decode(entry[key], validate=True)
            except (binascii.Error, ValueError, TypeError):
                raise CheckpointError(f"{where}.{key} must be a base64 string of the state's bytes") from None
    return entry


def _state_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def restore_rng(entry, source: Path = Path("trainer_state.json"), rank: int = 0) -> None:
    """Set this process's RNGs from one rank's saved entry (either format; see `decode_rng`)."""
    snapshot = decode_rng(entry, source, rank)
    version, words, gauss_next = snapshot["python"]
    name, keys, position, has_gauss, cached = snapshot["numpy"]
    try:
        random.setstate((version, tuple(words), gauss_next))
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached))
        torch.set_rng_state(_state_tensor(snapshot["torch"]))
        if "cuda" in snapshot and torch.cuda.is_available():
            torch.cuda.set_rng_state(_state_tensor(snapshot["cuda"]))
    except (ValueError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"{source}: rng[{rank}] does not restore: {type(error).__name__}: {error}") from None
