"""DeepSpeed's checkpoint files written through a file object of the caller's (for the publisher: a
`checkpoint.stream.StreamedFile`, hashed as written and sent to the disk while serialising).

DeepSpeed writes every checkpoint file through its engine's `checkpoint_engine.save(state_dict, path)`;
the default one, `TorchCheckpointEngine`, is `torch.save(state_dict, path)`. For the length of one
`save_checkpoint` it is replaced by the same engine saving to `open_file(path)` instead. Any other
checkpoint engine a user configured in the DeepSpeed config (Nebula, the fast or decoupled writers)
is left alone: it has its own writer, and the publisher then hashes those files by reading them back.
"""

from __future__ import annotations

import contextlib
import errno
import functools
from collections.abc import Callable
from typing import BinaryIO

import torch

OpenFile = Callable[[str], BinaryIO]


@functools.cache
def _streaming_engine_classes():
    """(DeepSpeed's TorchCheckpointEngine, its streaming subclass); deepspeed is imported at first use,
    like everywhere in this package, so that `python -m astrai` tools stay quick to start."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class StreamingTorchCheckpointEngine(TorchCheckpointEngine):
        """`TorchCheckpointEngine` (same serialisation, same loading) whose `save` writes into `open_file(path)`."""

        def __init__(self, original: TorchCheckpointEngine, open_file: OpenFile):
            CheckpointEngine.__init__(self)  # not TorchCheckpointEngine's: it logs a line per construction
            self.name = original.name
            self.zipfile_serialization = original.zipfile_serialization
            self._open_file = open_file

        def save(self, state_dict, path: str) -> None:
            with self._open_file(path) as handle:
                try:
                    torch.save(state_dict, handle, _use_new_zipfile_serialization=self.zipfile_serialization)
                except RuntimeError as error:
                    cause = error.__context__  # torch's zip writer reports a failed write as "unexpected pos"
                    if isinstance(cause, OSError) and cause.errno:  # the file's own error: ENOSPC, EDQUOT, EIO
                        name = errno.errorcode.get(cause.errno, "OSError")
                        raise OSError(cause.errno, f"{name}: {cause.strerror}", path) from error
                    raise

    return TorchCheckpointEngine, StreamingTorchCheckpointEngine


@contextlib.contextmanager
def streamed_writes(ds_engine, open_file: OpenFile | None):
    """Within the block, `ds_engine`'s checkpoint files go through `open_file` (when given and when the
    engine uses DeepSpeed's default torch checkpoint engine). Yields whether they do."""
    original = getattr(ds_engine, "checkpoint_engine", None)
    if open_file is None:
        yield False
        return
    default_class, streaming_class = _streaming_engine_classes()
    if type(original) is not default_class:
        yield False
        return
    ds_engine.checkpoint_engine = streaming_class(original, open_file)
    try:
        yield True
    finally:
        ds_engine.checkpoint_engine = original
