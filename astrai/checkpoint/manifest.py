"""manifest.json: what a published checkpoint must contain, written last, read first.

```
{"format": "astrai-checkpoint", "version": 1, "step": 500, "parts": ["policy"],
 "hash": "sha256", "files": {"policy/mp_rank_00_model_states.pt": {"size": 123, "digest": "ab.."}},
 "created": "2025-01-01T00:00:00+00:00", "world_size": 2, "meta": {...}}
```
manifest.json itself is not listed in "files". Reading is strict: a manifest from a newer
AstrAI, of another format or with an unknown hash is an error, never mistaken for "legacy"
(legacy means the file is absent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from . import fs
from .errors import CheckpointError
from .hashing import HASH_ALGORITHMS, FileDigest

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "astrai-checkpoint"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """The parsed contents of manifest.json (`hash_algorithm` is stored under the key "hash")."""

    step: int
    parts: tuple[str, ...]
    hash_algorithm: str
    files: dict[str, FileDigest]
    world_size: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    version: int = MANIFEST_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json_bytes(self) -> bytes:
        document = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "step": self.step,
            "parts": list(self.parts),
            "hash": self.hash_algorithm,
            "files": {path: {"size": entry.size, "digest": entry.digest} for path, entry in sorted(self.files.items())},
            "created": self.created,
            "world_size": self.world_size,
            "meta": self.meta,
        }
        return (json.dumps(document, indent=1) + "\n").encode()


def is_safe_relative_path(path: str) -> bool:
    """True for a relative posix path that stays inside the checkpoint ("a/b.pt", not "../x" or "/x")."""
    if not path or "\\" in path or path.startswith("/"):
        return False
    parts = PurePosixPath(path).parts
    return all(part not in ("", ".", "..") for part in parts) and "/".join(parts) == path


def parse_manifest(document: Any, source: Path) -> Manifest:
    """Validate a decoded manifest.json; CheckpointError naming `source` and the bad field."""

    def fail(detail: str) -> CheckpointError:
        return CheckpointError(f"{source}: {detail}")

    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise fail(f"not an AstrAI checkpoint manifest (format {found!r}, expected {MANIFEST_FORMAT!r})")
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise fail(f"invalid manifest version {version!r}")
    if version > MANIFEST_VERSION:
        raise fail(
            f"written by a newer AstrAI (manifest version {version}; this AstrAI reads up to version "
            f"{MANIFEST_VERSION}): upgrade AstrAI to load it"
        )
    algorithm = document.get("hash")
    if algorithm not in HASH_ALGORITHMS:
        raise fail(f"unknown hash algorithm {algorithm!r} in manifest; this AstrAI knows {', '.join(HASH_ALGORITHMS)}")
    step, parts, files = document.get("step"), document.get("parts"), document.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise fail(f"invalid step {step!r}")
    if not isinstance(parts, list) or not all(isinstance(part, str) for part in parts):
        raise fail(f"invalid parts {parts!r}: expected a list of names")
    if not isinstance(files, dict):
        raise fail("invalid files: expected an object of path -> {size, digest}")
    entries = {}
    for path, entry in files.items():
        if not is_safe_relative_path(path) or path == MANIFEST_NAME:
            raise fail(f"invalid file path {path!r} in manifest")
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("digest") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
            raise fail(f"invalid entry for {path!r}: {entry!r}")
        entries[path] = FileDigest(size=size, digest=digest)
    world_size, meta, created = document.get("world_size"), document.get("meta"), document.get("created")
    if not isinstance(world_size, int) or world_size < 1:
        raise fail(f"invalid world_size {world_size!r}")
    if not isinstance(meta, dict) or not isinstance(created, str):
        raise fail("invalid meta or created field")
    return Manifest(
        step=step,
        parts=tuple(parts),
        hash_algorithm=algorithm,
        files=entries,
        world_size=world_size,
        meta=meta,
        created=created,
        version=version,
    )


def read_manifest(checkpoint_dir: Path) -> Manifest | None:
    """The manifest of a checkpoint directory; None when it has none (a legacy checkpoint).

    Raises CheckpointError when the directory is missing or the manifest is unreadable,
    corrupt, of another format, from a newer AstrAI or names an unknown hash.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: not a checkpoint directory (missing or not a folder)")
    path = checkpoint_dir / MANIFEST_NAME
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read the manifest: {error}") from error
    try:
        document = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt manifest (not valid JSON: {error})") from error
    return parse_manifest(document, path)


def write_manifest(checkpoint_dir: Path, manifest: Manifest) -> None:
    """Write manifest.json atomically and durably (temporary name, fsync, rename, fsync dir)."""
    fs.write_bytes_atomic(Path(checkpoint_dir) / MANIFEST_NAME, manifest.to_json_bytes())
