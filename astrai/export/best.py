"""`python -m astrai export-hf --best`: the run's best checkpoint by `checkpoint.keep_best`, as retention keeps it
(`astrai.checkpoint.retention.best_checkpoint`: chosen from the manifests' recorded eval figures alone)."""

from __future__ import annotations

from pathlib import Path

from astrai.checkpoint import find_latest
from astrai.checkpoint.retention import best_checkpoint
from astrai.errors import AstraiError


class BestCheckpointError(AstraiError):
    """No best checkpoint can be named: the folder, the job's keep_best or the recorded figures are missing."""


def checkpoints_folder(path: Path) -> Path:
    if (path / "manifest.json").is_file():
        raise BestCheckpointError(f"{path}: --best takes an output_dir or a checkpoints folder, not a checkpoint")
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def find_best(path: str | Path) -> Path:
    """The best checkpoint under an output_dir or checkpoints folder, by the keep_best (metric, mode) of the job
    its newest checkpoint was trained with."""
    from astrai.config import ConfigError, load_job

    path = Path(path)
    if not path.is_dir():
        raise BestCheckpointError(f"{path}: no such directory")
    folder = checkpoints_folder(path)
    newest = find_latest(folder)
    if newest is None:
        raise BestCheckpointError(f"{folder}: no published checkpoint (step_<N> folder)")
    try:
        keep_best = load_job(Path(newest) / "job.yaml", check_paths=False).checkpoint.keep_best
    except (ConfigError, OSError) as error:
        raise BestCheckpointError(f"{newest}/job.yaml: {error}") from None
    if keep_best is None:
        raise BestCheckpointError(
            f"{newest}: its job has no checkpoint.keep_best, so no metric says which checkpoint is best; "
            "export a checkpoint by its path instead"
        )
    best = best_checkpoint(folder, keep_best.metric, keep_best.mode)
    if best is None:
        raise BestCheckpointError(f"{folder}: no checkpoint's manifest records {keep_best.metric}")
    return best[1]
