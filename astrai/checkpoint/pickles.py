"""Which code a checkpoint file would run if unpickled, found without unpickling it.

A pickle calls whatever its GLOBAL opcodes name (`os.system`, `builtins.eval`, ...); a checkpoint is
data, so every global it names must be a tensor or container type. This module reads the opcodes
(`pickletools.genops`, nothing executed) of torch files (the zip format's `*.pkl` members, or the
legacy format's leading pickles) and of pickles embedded in JSON as base64 (the RNG snapshots of
checkpoints written before RNG states became plain JSON), and lists the globals they name. `verify`
refuses a file naming one outside the allow-lists below; loading never unpickles anything else
either (`astrai/engine/safe_load.py` resolves the same names for `torch.load(weights_only=True)`).

Torch-free and DeepSpeed-free on purpose (`python -m astrai verify` stays quick to start): the
allow-lists are names, found by listing the globals of real ZeRO-0/1/2/3 checkpoints (fp32 and bf16)
of DeepSpeed 0.19.8 and of `ds_to_universal`'s output (tests/unit/checkpoint/test_safe_load.py checks that a
fresh save names nothing else).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import pickletools
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

# Globals torch.load(weights_only=True) allows by itself: tensors, storages and containers.
TORCH_DATA_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type_v2",  # ZeRO-3's optimizer shards
        "torch.Tensor",
        "torch.Size",
        "torch.device",
        "torch.float32",
        "torch.float16",
        "torch.bfloat16",
        "torch.float64",
        "torch.int64",
        "torch.int32",
        "torch.uint8",
        "torch.bool",
        "torch.int8",
        "torch.int16",
        "torch.FloatStorage",
        "torch.HalfStorage",
        "torch.BFloat16Storage",
        "torch.DoubleStorage",
        "torch.LongStorage",
        "torch.IntStorage",
        "torch.ByteStorage",
        "torch.BoolStorage",
        "torch.CharStorage",
        "torch.ShortStorage",
        "torch.storage.UntypedStorage",
        "torch.UntypedStorage",
    }
)
# What DeepSpeed 0.19.8's files add: ZeRO-1/2/3 optimizer shards (and ds_to_universal's output) hold the
# stage enum, the loss scaler object and (ZeRO-1/2) each parameter's fragment address. DynamicLossScaler
# is what an fp16 run's shards hold instead of LossScaler (DeepSpeed saves `self.loss_scaler` as is).
DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
TENSOR_FILE_GLOBALS = TORCH_DATA_GLOBALS | DEEPSPEED_GLOBALS

# What a `pickle.dumps({"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": ...})`
# snapshot holds (the RNG format before JSON): numpy's array rebuild, and torch tensors whose storage
# is itself a small legacy torch file (`_load_from_bytes`, scanned in turn).
RNG_SNAPSHOT_GLOBALS = frozenset(
    {
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "torch._utils._rebuild_tensor_v2",
        "torch.storage._load_from_bytes",
        "collections.OrderedDict",
        "torch.ByteStorage",
        "torch.storage.UntypedStorage",
    }
)

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin")
ZIP_MAGIC = b"PK\x03\x04"
LEGACY_TORCH_PREFIX = b"\x80\x02\x8a\x0a"  # protocol 2, then the 10-byte long of torch's legacy magic number
LEGACY_TORCH_PICKLES = 5  # magic number, protocol, system info, the object, the storage keys; raw storages follow
UNKNOWN = object()  # a stack value the scan cannot name statically
STRING_OPCODES = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
BYTES_OPCODES = {"BINBYTES", "SHORT_BINBYTES", "BYTES8", "BYTEARRAY8"}
MEMO_PUT_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
MEMO_GET_OPCODES = {"GET", "BINGET", "LONG_BINGET"}


class PickleScanError(ValueError):
    """A file that claims to be a pickle (by name or content) whose opcodes do not parse."""


class _Bounded:
    """A stream whose reads never ask for more than what is left: pickletools reads a length-prefixed
    opcode's argument in one `read(n)`, and a damaged length (up to 2**64) would allocate n bytes first."""

    def __init__(self, stream, size: int):
        self._stream, self._end = stream, size

    def read(self, count: int = -1) -> bytes:
        left = max(0, self._end - self._stream.tell())
        return self._stream.read(left if count is None or count < 0 else min(count, left))

    def readline(self) -> bytes:
        return self._stream.readline()

    def tell(self) -> int:
        return self._stream.tell()


def _globals_of_pickle(stream: io.BufferedIOBase) -> Iterator[str]:
    """The globals one pickle (read from `stream` up to its STOP) names, as "module.name".

    STACK_GLOBAL takes its names from the stack: they are followed through string opcodes and the
    memo; a name the scan cannot follow is reported as "<computed name>", which no allow-list holds.
    Extension codes (EXT1/2/4) name globals through copyreg's registry: reported the same way.
    Embedded byte strings that are torch files themselves (a storage pickled by `pickle`) are scanned too.
    """
    memo: dict[int, object] = {}
    recent: list[object] = []  # values of the last pushes (enough for STACK_GLOBAL's two operands)
    try:
        with warnings.catch_warnings():  # a protocol-0 string of arbitrary bytes warns about its escapes
            warnings.simplefilter("ignore", DeprecationWarning)
            opcodes = list(pickletools.genops(stream))
        for opcode, argument, _ in opcodes:
            name = opcode.name
            if name in MEMO_PUT_OPCODES:
                memo[len(memo) if name == "MEMOIZE" else argument] = recent[-1] if recent else UNKNOWN
                continue
            value: object = UNKNOWN
            if name in STRING_OPCODES:
                value = argument
            elif name in MEMO_GET_OPCODES:
                value = memo.get(argument, UNKNOWN)
            elif name in BYTES_OPCODES:
                yield from _globals_of_embedded(bytes(argument))
            elif name in ("GLOBAL", "INST"):
                module, _, attribute = argument.partition(" ")
                yield f"{module}.{attribute}"
            elif name == "STACK_GLOBAL":
                module, attribute = (recent[-2], recent[-1]) if len(recent) >= 2 else (UNKNOWN, UNKNOWN)
                both_known = isinstance(module, str) and isinstance(attribute, str)
                yield f"{module}.{attribute}" if both_known else "<computed name>"
            elif name.startswith("EXT"):
                yield "<computed name>"
            recent = (recent + [value])[-2:]
    except Exception as error:  # bad or truncated opcodes: pickletools raises ValueError, EOFError, UnicodeError...
        raise PickleScanError(f"{type(error).__name__}: {error}") from None


def _globals_of_embedded(data: bytes) -> Iterator[str]:
    """A byte string that is a torch file itself (a storage pickled by `pickle`: `_load_from_bytes`).
    One that does not parse is left alone: it is only ever read by `torch.load(weights_only=True)`."""
    if data.startswith(ZIP_MAGIC) or data.startswith(LEGACY_TORCH_PREFIX):
        try:
            yield from globals_of_torch_bytes(data)
        except PickleScanError:
            return


def _globals_of_zip(source) -> list[str]:
    """Torch's zip format: every `*.pkl` member's globals (only those members are read, not the tensors)."""
    try:
        with zipfile.ZipFile(source) as archive:
            members = [member for member in archive.namelist() if member.endswith(".pkl")]
            pickles = (archive.read(member) for member in members)
            return [found for data in pickles for found in _globals_of_pickle(_Bounded(io.BytesIO(data), len(data)))]
    except (zipfile.BadZipFile, EOFError) as error:
        raise PickleScanError(f"unreadable zip archive ({error})") from None


def _globals_of_stream(stream, head: bytes) -> list[str]:
    """A non-zip torch file (legacy format: its leading pickles, read in order from `stream`; the raw
    storages after them are never read) or one plain pickle, which gives [] when it is none."""
    if not head.startswith(LEGACY_TORCH_PREFIX):
        try:
            found = list(_globals_of_pickle(stream))
        except PickleScanError:
            return []  # bytes no unpickler gets past
        # A plain pickle ends at its STOP; random bytes that happen to parse (~1 in 10**4 short ones) seldom do.
        return found if stream.read(1) == b"" else []
    found: list[str] = []
    for _ in range(LEGACY_TORCH_PICKLES):
        found.extend(_globals_of_pickle(stream))
    return found


def globals_of_torch_bytes(data: bytes) -> list[str]:
    """Every global a torch file's pickles name (zip format: each `*.pkl` member; legacy format: its
    leading pickles; anything else: read as one plain pickle, and [] when it is none).
    Raises PickleScanError for a torch file whose pickles do not parse."""
    if data.startswith(ZIP_MAGIC):
        return _globals_of_zip(io.BytesIO(data))
    return _globals_of_stream(_Bounded(io.BytesIO(data), len(data)), data[: len(LEGACY_TORCH_PREFIX)])


def globals_of_file(path: Path) -> list[str]:
    """The globals a torch/pickle file names, reading only its pickles (zip: through its central directory)."""
    path = Path(path)
    with open(path, "rb") as handle:
        head = handle.read(len(LEGACY_TORCH_PREFIX))
        if head == ZIP_MAGIC:
            return _globals_of_zip(path)
        handle.seek(0)
        return _globals_of_stream(_Bounded(handle, os.fstat(handle.fileno()).st_size), head)


def embedded_pickles(document: object) -> Iterator[bytes]:
    """Base64 strings anywhere in a decoded JSON document that decode to a pickle (a PROTO opcode first)."""
    if isinstance(document, dict):
        for value in document.values():
            yield from embedded_pickles(value)
    elif isinstance(document, list):
        for value in document:
            yield from embedded_pickles(value)
    elif isinstance(document, str) and len(document) >= 8:
        try:
            data = base64.b64decode(document, validate=True)
        except (binascii.Error, ValueError):
            return
        if len(data) > 1 and data[0] == 0x80 and 2 <= data[1] <= 5:
            yield data


def disallowed_globals(path: Path) -> list[str]:
    """Globals named by `path` that no allow-list holds: a torch/pickle file (by suffix) against the
    tensor-file list, a JSON file's embedded pickles against the RNG-snapshot list. Sorted, unique.
    Raises PickleScanError for a pickle that does not parse, OSError for an unreadable file."""
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        return sorted(set(globals_of_file(path)) - TENSOR_FILE_GLOBALS)
    if path.suffix == ".json":
        try:
            document = json.loads(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return []  # not JSON after all: nothing is unpickled from it
        found = {name for data in embedded_pickles(document) for name in globals_of_torch_bytes(data)}
        return sorted(found - RNG_SNAPSHOT_GLOBALS)
    return []
