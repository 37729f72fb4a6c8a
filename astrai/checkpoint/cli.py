"""`python -m astrai verify <path>`: check checkpoints against their manifests.

<path> may be one checkpoint (`.../step_00000500`), a checkpoints folder, or a job's output_dir
(its `checkpoints/` folder is used). A folder verifies every published checkpoint, newest first,
unless `--latest`. Exit status: 0 all valid, 1 some checkpoint invalid (the first bad file is
named), 2 nothing to verify or bad arguments, 3 only legacy checkpoints (no manifest) besides valid ones.
`--quick` checks the file list, file types, sizes and the step only (what a resume checks before
loading, ~0 s); without it every digest is checked and every pickle scanned for globals that are code.

`--require-parts policy,critic` also fails (status 1, line `INCOMPLETE`) a checkpoint that lacks a part
the job needs, so a launcher can refuse a resume before any rank starts (`scripts/train.sh` does).
This module stays ignorant of train types: the caller names the parts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .errors import CheckpointError, CheckpointVerifyError, LegacyCheckpointError
from .layout import list_published, parse_hidden_dir_name, parse_step_dir_name
from .manifest import MANIFEST_NAME
from .verify import require_parts, verify_checkpoint

EXIT_VALID, EXIT_INVALID, EXIT_USAGE, EXIT_LEGACY = 0, 1, 2, 3


def resolve_targets(path: Path, *, latest: bool) -> tuple[list[Path], str | None]:
    """Checkpoint directories to verify for `path`, newest first; or ([], why there are none)."""
    if not path.is_dir():
        return [], f"{path}: no such directory"
    names_a_checkpoint = parse_step_dir_name(path.name) is not None or parse_hidden_dir_name(path.name) is not None
    if names_a_checkpoint or (path / MANIFEST_NAME).exists():
        return [path], None
    checkpoints_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    published = [checkpoint for _, checkpoint in reversed(list_published(checkpoints_dir))]
    if not published:
        return [], f"{checkpoints_dir}: no published checkpoints (step_<N> folders) found"
    return published[:1] if latest else published, None


def check_target(
    target: Path, *, hash_threads: int | None, digests: bool, required_parts: list[str]
) -> tuple[str, str]:
    """("valid" | "invalid" | "legacy", the line to print) for one checkpoint directory."""
    try:
        report = verify_checkpoint(target, hash_threads=hash_threads, digests=digests)
    except LegacyCheckpointError:
        report = None  # unverifiable, yet its top-level folders still tell which parts it has
    except CheckpointVerifyError as error:
        return "invalid", f"INVALID  {target}: {error.reason}: {error.file or '-'}\n         {error}"
    if required_parts:
        try:
            require_parts(target, required_parts)
        except CheckpointError as error:
            return "invalid", f"INCOMPLETE {target}: {error}"
    if report is None:
        return "legacy", f"LEGACY   {target}: no manifest.json (legacy checkpoint); it cannot be verified"
    checked = report.algorithm if report.digests_checked else "sizes only"
    return "valid", (
        f"OK       {target}: step {report.step}, {report.files} files, "
        f"{report.bytes / 2**20:.1f} MiB, {checked}, {report.seconds:.2f} s"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrai verify", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a checkpoint, a checkpoints folder, or a job's output_dir")
    parser.add_argument("--latest", action="store_true", help="verify only the newest published checkpoint")
    parser.add_argument(
        "--quick", action="store_true", help="file lists, types, sizes and the step only (no digests, no pickle scan)"
    )
    parser.add_argument("--hash-threads", type=int, default=None, help="hashing threads (default: min(8, CPUs))")
    parser.add_argument(
        "--require-parts",
        action="append",
        default=[],
        metavar="PART[,PART...]",
        help="also fail a checkpoint lacking any of these parts (e.g. policy,critic); repeatable",
    )
    return parser


def verify_main(argv: Sequence[str] | None = None) -> int:
    """Entry of `python -m astrai verify`; `argv` excludes the program and subcommand names."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # argparse exits on bad arguments; return its status instead
        return int(exit_request.code or 0)
    targets, problem = resolve_targets(args.path, latest=args.latest)
    if problem:
        print(f"astrai verify: {problem}")
        return EXIT_USAGE
    required = [part.strip() for group in args.require_parts for part in group.split(",") if part.strip()]
    counts = {"valid": 0, "invalid": 0, "legacy": 0}
    for target in targets:
        outcome, line = check_target(
            target, hash_threads=args.hash_threads, digests=not args.quick, required_parts=required
        )
        counts[outcome] += 1
        print(line)
    print(f"{counts['valid']} valid, {counts['invalid']} invalid, {counts['legacy']} legacy")
    if counts["invalid"]:
        return EXIT_INVALID
    return EXIT_LEGACY if counts["legacy"] else EXIT_VALID
