"""The versions AstrAI runs on: the floors pyproject.toml declares, checked before any rank works.

pyproject.toml declares each dependency as a range whose floor is the version the test suite passed with
(constraints.txt pins the exact set that scripts/setup.sh, CI and the Docker image install). The floors are read
here at run time, from the installed distribution's metadata (`importlib.metadata.requires("astrai")`, written
from pyproject.toml at install) or, where AstrAI runs from a checkout it was never installed from, from that
checkout's pyproject.toml: they live in one place only.

    check_versions()    # astrai/train.py, astrai/launch/preflight.py and `python -m astrai` tools, first thing:
                        # VersionError naming a torch, deepspeed or transformers below its floor (or missing)

A pre-release or local build of the floor's own release counts as that release (NGC's torch 2.13.0a0+git...
is 2.13.0). `ASTR_ALLOW_BELOW_FLOOR=torch[,name...]` turns the refusal for the named packages into a warning:
for a machine whose own torch cannot be replaced (scripts/gpu_check.sh on the device machines), never a default.
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from astrai.errors import AstraiError

logger = logging.getLogger("astrai")

CHECKED = ("torch", "deepspeed", "transformers")  # what AstrAI reaches deepest into: refused below the floor
ALLOW_VARIABLE = "ASTR_ALLOW_BELOW_FLOOR"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # a source checkout's, when not installed


class VersionError(AstraiError):
    """A package AstrAI needs is missing or older than the floor pyproject.toml declares."""


def pyproject_dependencies(path: Path = PYPROJECT) -> list[str]:
    """`project.dependencies` of a pyproject.toml (its extras not included)."""
    with open(path, "rb") as file:
        return list(tomllib.load(file)["project"]["dependencies"])


def declared_requirements() -> dict[str, Requirement]:
    """AstrAI's own dependencies (not its extras), by canonical name: from the installed metadata, else from
    the pyproject.toml of the checkout this module runs from."""
    try:
        lines = metadata.requires("astrai") or []
    except metadata.PackageNotFoundError:
        lines = pyproject_dependencies() if PYPROJECT.is_file() else []
    requirements = [Requirement(line) for line in lines]
    return {
        canonicalize_name(requirement.name): requirement
        for requirement in requirements
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""})
    }


def floor_of(requirement: Requirement) -> Version | None:
    """The lowest version a requirement admits: its highest >=, >, ~= or == bound (None: no lower bound)."""
    bounds = [
        Version(specifier.version.removesuffix(".*"))
        for specifier in requirement.specifier
        if specifier.operator in (">=", ">", "~=", "==", "===")
    ]
    return max(bounds, default=None)


def install_spec(requirement: Requirement) -> str:
    """`name>=floor,<cap`: the range to hand pip, floor first."""
    specifiers = sorted(map(str, requirement.specifier), key=lambda text: not text.startswith(">"))
    return requirement.name + ",".join(specifiers)


def installed_version(name: str) -> str:
    """The installed version of a distribution; PackageNotFoundError when it is not installed."""
    return metadata.version(name)


def allowed_below_floor(environ: Mapping[str, str] = os.environ) -> set[str]:
    """The packages `ASTR_ALLOW_BELOW_FLOOR` (comma- or space-separated names) lets run below their floor."""
    return {canonicalize_name(name) for name in re.split(r"[\s,]+", environ.get(ALLOW_VARIABLE, "")) if name}


def check_versions(
    version_of: Callable[[str], str] | None = None,
    names: Iterable[str] = CHECKED,
    allowed: Iterable[str] | None = None,
) -> None:
    """Refuse (VersionError, one line naming the package and the pip command that fixes it) the first of
    `names` that is not installed or older than its floor in pyproject.toml; a package named in `allowed`
    (default: ASTR_ALLOW_BELOW_FLOOR) only warns. `version_of(name)` reads an installed version."""
    version_of = version_of or installed_version
    allowed = allowed_below_floor() if allowed is None else {canonicalize_name(name) for name in allowed}
    requirements = declared_requirements()
    for name in names:
        requirement = requirements.get(canonicalize_name(name))
        floor = None if requirement is None else floor_of(requirement)
        if floor is None:  # not declared (or with no floor): nothing to hold it to
            continue
        spec = install_spec(requirement)
        try:
            installed = version_of(name)
        except metadata.PackageNotFoundError:
            raise VersionError(
                f"{name} is not installed; AstrAI needs {name} >= {floor}: pip install '{spec}'"
            ) from None
        try:
            release = Version(Version(installed).base_version)  # 2.13.0a0+git1234 and 2.13.0+cu128 are 2.13.0
        except InvalidVersion:
            logger.warning("%s reports version %r, which is not a version number: not checked", name, installed)
            continue
        if release >= floor:
            continue
        problem = f"{name} {installed} is older than AstrAI supports (>= {floor}): pip install '{spec}'"
        if canonicalize_name(name) not in allowed:
            raise VersionError(problem)
        logger.warning("%s; running anyway (%s)", problem, ALLOW_VARIABLE)
