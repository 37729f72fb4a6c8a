"""Crash-safe checkpoints: staged, hashed into a manifest, published by one atomic rename.

Knows nothing of train types or DeepSpeed: the caller's `write(staging_dir)` callback writes the
payload (e.g. `policy/` from DeepSpeed, `trainer_state.json`, `job.yaml`); this package makes it
visible as `<checkpoints_dir>/step_<N>/` only once complete on every rank. See
docs/guides/checkpoints.md for the on-disk protocol and what each crash leaves behind.
"""

from .cli import verify_main
from .errors import CheckpointError, CheckpointVerifyError, LegacyCheckpointError
from .hashing import HASH_ALGORITHMS, FileDigest
from .layout import list_published, parse_step_dir_name, step_dir_name
from .manifest import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, Manifest, read_manifest
from .publisher import CheckpointPublisher, PublishReport
from .retention import CleanupReport, cleanup_stale
from .stream import StreamedFile, StreamedFiles
from .verify import VerifyReport, find_latest, require_parts, verify_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointPublisher",
    "CheckpointVerifyError",
    "CleanupReport",
    "FileDigest",
    "HASH_ALGORITHMS",
    "LegacyCheckpointError",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "PublishReport",
    "StreamedFile",
    "StreamedFiles",
    "VerifyReport",
    "cleanup_stale",
    "find_latest",
    "list_published",
    "parse_step_dir_name",
    "read_manifest",
    "require_parts",
    "step_dir_name",
    "verify_checkpoint",
    "verify_main",
]
