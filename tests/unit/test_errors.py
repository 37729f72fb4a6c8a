"""One error family: every error class AstrAI raises to its user derives from AstraiError, so the entry
points (astrai/train.py, export-hf) catch the family once and a new room's error cannot slip past them
as a traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import astrai
from astrai.errors import AstraiError

# Raised and caught inside one module, never shown as they are: each is turned into a family member there.
INTERNAL = {
    "astrai.data.render.RowError": "a malformed row; sources.py reports it as a DataError naming file and row",
    "astrai.checkpoint.pickles.PickleScanError": "a pickle that does not parse; verify reports it as damage",
    "astrai.engine.safe_load._RefusedGlobal": "a refused pickle global; raised again as UnsafeCheckpointError",
}


def error_classes() -> dict[str, type]:
    found = {}
    for module_info in pkgutil.walk_packages(astrai.__path__, "astrai."):
        if module_info.name in ("astrai.train", "astrai.__main__", "astrai._script_path"):
            continue  # entry points and the scripts' path fix: they define no errors
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_error_astrai_defines_is_in_the_family():
    classes = error_classes()
    assert len(classes) >= 20  # the walk really found the package's errors
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, AstraiError) and name not in INTERNAL)
    assert outside == [], f"derive these from astrai.errors.AstraiError (or list them as internal): {outside}"
    assert set(INTERNAL) <= set(classes), "an internal error listed here no longer exists"


def test_the_family_keeps_the_builtin_bases_callers_catch():
    from astrai.checkpoint import CheckpointError
    from astrai.engine.ds_config import DeepSpeedConfigError
    from astrai.resume.portable import PortableError

    assert issubclass(CheckpointError, RuntimeError) and issubclass(DeepSpeedConfigError, ValueError)
    assert issubclass(PortableError, ValueError) and issubclass(PortableError, AstraiError)
