"""Errors raised by the checkpoint package.

One base class, so a trainer can catch every checkpoint failure with one `except`, and two
subclasses for verification, so `python -m astrai verify` can tell "corrupt" from "cannot tell".
"""

from __future__ import annotations

from pathlib import Path

from astrai.errors import AstraiError


class CheckpointError(AstraiError, RuntimeError):
    """A checkpoint could not be published, read or found; the message says what and where."""


class CheckpointVerifyError(CheckpointError):
    """A checkpoint does not match its manifest.

    Attributes:
        checkpoint: the checkpoint directory.
        file: the first bad file, as a relative posix path (None when the manifest itself is bad).
        reason: short machine-friendly reason: "missing", "wrong size", "wrong digest",
            "unexpected file", "bad manifest", "legacy", "not a directory".
    """

    def __init__(self, checkpoint: Path, reason: str, detail: str, file: str | None = None):
        self.checkpoint = Path(checkpoint)
        self.file = file
        self.reason = reason
        where = f"{self.checkpoint}/{file}" if file else str(self.checkpoint)
        super().__init__(f"checkpoint {self.checkpoint} is not valid: {reason}: {where}: {detail}")


class LegacyCheckpointError(CheckpointVerifyError):
    """The directory has no manifest.json (e.g. plain DeepSpeed `save_checkpoint` output).

    It may still load, but nothing records what it should contain, so it cannot be verified.
    """

    def __init__(self, checkpoint: Path):
        super().__init__(
            checkpoint,
            "legacy",
            "no manifest.json (a legacy checkpoint, e.g. written by plain DeepSpeed); it can be loaded "
            "but cannot be verified",
        )
