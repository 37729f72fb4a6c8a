"""astrai/versions.py: the floors of pyproject.toml, checked against the installed versions before any rank works.

The installed versions are the real ones (importlib.metadata), made older for one package at a time through
`check_versions(version_of=...)`; the floors are the ones this checkout's pyproject.toml declares.
"""

from __future__ import annotations

import logging
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from astrai import versions
from astrai.versions import (
    CHECKED,
    VersionError,
    allowed_below_floor,
    check_versions,
    declared_requirements,
    floor_of,
    install_spec,
    installed_version,
    pyproject_dependencies,
)

PYPROJECT_FLOORS = {Requirement(line).name: floor_of(Requirement(line)) for line in pyproject_dependencies()}


def older(name: str, version: str):
    """The real installed-version lookup, except that `name` reports `version`."""
    return lambda asked: version if asked == name else installed_version(asked)


def test_the_installed_versions_pass():
    check_versions()
    check_versions(version_of=installed_version, allowed=())


def test_floors_read_at_run_time_are_pyprojects():
    """What the check holds the packages to is what pyproject.toml declares (read from the installed metadata,
    which `pip install -e .` writes from it: a floor raised there without a reinstall shows here)."""
    declared = declared_requirements()
    for name in CHECKED:
        assert floor_of(declared[name]) == PYPROJECT_FLOORS[name], f"{name}: reinstall, pip install --no-deps -e ."
    assert str(PYPROJECT_FLOORS["transformers"]) == "5.24.0" and str(PYPROJECT_FLOORS["torch"]) == "2.13.0"


def test_an_older_transformers_is_refused_with_one_line_naming_it():
    with pytest.raises(VersionError) as caught:
        check_versions(version_of=older("transformers", "5.10.0"), allowed=())
    spec = install_spec(declared_requirements()["transformers"])
    message = str(caught.value)
    assert message == f"transformers 5.10.0 is older than AstrAI supports (>= 5.24.0): pip install '{spec}'"
    assert "\n" not in message
    assert install_spec(Requirement("transformers>=5.24.0,<6")) == "transformers>=5.24.0,<6"


@pytest.mark.parametrize("name, version", [("torch", "2.12.1"), ("deepspeed", "0.18.9"), ("torch", "1.13.0+cu117")])
def test_each_checked_package_below_its_floor_is_refused(name, version):
    with pytest.raises(VersionError, match=rf"^{name} {re.escape(version)} is older than AstrAI supports"):
        check_versions(version_of=older(name, version), allowed=())


@pytest.mark.parametrize("version", ["2.13.0+cu128", "2.13.0a0+git5f3e2a1", "2.13.1", "2.14.0.dev20261101", "3.0.0"])
def test_builds_of_the_floors_release_and_newer_pass(version):
    """A local or pre-release build of 2.13.0 (NGC's 2.13.0a0+git...) counts as 2.13.0; the cap is pip's to hold."""
    check_versions(version_of=older("torch", version), allowed=())


def test_a_missing_package_is_named():
    def without_deepspeed(name: str) -> str:
        if name == "deepspeed":
            raise metadata.PackageNotFoundError(name)
        return installed_version(name)

    with pytest.raises(VersionError, match=r"^deepspeed is not installed; AstrAI needs deepspeed >= 0\.19\.8: pip"):
        check_versions(version_of=without_deepspeed, allowed=())


def test_a_package_allowed_below_its_floor_only_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="astrai"):
        check_versions(version_of=older("torch", "2.11.0+cu130"), allowed=["torch"])
    assert "torch 2.11.0+cu130 is older than AstrAI supports (>= 2.13.0)" in caplog.text
    assert "ASTR_ALLOW_BELOW_FLOOR" in caplog.text
    with pytest.raises(VersionError, match="^transformers 5.17.0"):  # only the named ones
        check_versions(version_of=older("transformers", "5.17.0"), allowed=["torch"])
    assert allowed_below_floor({"ASTR_ALLOW_BELOW_FLOOR": "torch, Transformers"}) == {"torch", "transformers"}
    assert allowed_below_floor({}) == set()


def test_floor_of_reads_every_lower_bound():
    assert str(floor_of(Requirement("torch>=2.13.0,<3"))) == "2.13.0"
    assert str(floor_of(Requirement("torch==2.13.0"))) == "2.13.0"  # metadata of an install before the ranges
    assert str(floor_of(Requirement("peft~=0.21.2"))) == "0.21.2"
    assert floor_of(Requirement("regex")) is None and floor_of(Requirement("numpy<3")) is None


def test_the_entry_points_refuse_before_anything_else(monkeypatch, capsys):
    """astrai/train.py and the `python -m astrai` tools that load torch stop at once, with one line, exit 1."""
    from astrai.__main__ import main as tools_main
    from astrai.train import main as train_main

    monkeypatch.setattr(versions, "installed_version", older("transformers", "5.10.0"))
    monkeypatch.delenv("ASTR_ALLOW_BELOW_FLOOR", raising=False)
    assert train_main(["--config", "no/such/job.yaml"]) == 1  # refused before the job file is read
    line = capsys.readouterr().err.strip()
    assert line.startswith("astrai: transformers 5.10.0 is older than AstrAI supports (>= 5.24.0): pip install")
    assert "\n" not in line
    assert tools_main(["plan", "--config", "no/such/job.yaml"]) == 1
    assert capsys.readouterr().err.startswith("astrai plan: transformers 5.10.0 is older")
