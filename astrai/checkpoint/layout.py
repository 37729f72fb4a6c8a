"""Names of checkpoint directories and how to list them.

```
<checkpoints_dir>/step_00000500/                    published, complete, immutable
<checkpoints_dir>/.step_00000500.staging-<hex>/     being written; never read as a checkpoint
<checkpoints_dir>/.step_00000500.retired-<hex>/     being deleted, or the old payload of a republish
<checkpoints_dir>/portable/step_00000500/           a derived form of step_00000500 (same names inside)
```
Hidden names start with a dot so that tools globbing `step_*` never pick them up.
Unpadded `step_500` is accepted when reading (older runs, hand-made copies); steps sort numerically.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

STEP_PREFIX = "step_"
# Folders of derived forms of a checkpoint, published as <checkpoints_dir>/<folder>/step_<N> by
# their own tools (astrai/resume/topology.py's portable form); retention removes them with step_<N>.
DERIVED_DIRS = ("portable",)
_PUBLISHED = re.compile(r"step_(\d+)")
_HIDDEN = re.compile(r"\.step_(\d+)\.(staging|retired)-([0-9A-Za-z]+)")


def step_dir_name(step: int) -> str:
    """`step_00000500` for 500: zero-padded to 8 digits so names also sort as text."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a published directory name (`step_00000500` or `step_500`), else None."""
    match = _PUBLISHED.fullmatch(name)
    return int(match.group(1)) if match else None


def staging_dir_name(step: int) -> str:
    return f".{step_dir_name(step)}.staging-{uuid.uuid4().hex}"


def retired_dir_name(step: int) -> str:
    return f".{step_dir_name(step)}.retired-{uuid.uuid4().hex}"


def parse_hidden_dir_name(name: str) -> tuple[str, int] | None:
    """("staging" | "retired", step) for a hidden work directory name, else None."""
    match = _HIDDEN.fullmatch(name)
    return (match.group(2), int(match.group(1))) if match else None


def list_published(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Published step directories as (step, path), oldest first. A missing folder lists as empty."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        step = parse_step_dir_name(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry.name, entry))
    return [(step, path) for step, _, path in sorted(found)]


def list_hidden(checkpoints_dir: Path) -> list[tuple[str, int, Path]]:
    """Staging and retired directories as (kind, step, path), sorted by step then name."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        parsed = parse_hidden_dir_name(entry.name)
        if parsed is not None and entry.is_dir():
            found.append((parsed[1], entry.name, parsed[0], entry))
    return [(kind, step, path) for step, _, kind, path in sorted(found)]
