"""pyproject.toml declares ranges, constraints.txt pins the exact set inside them, and the installers use it.

AstrAI installs like a library into an environment that already has its own torch or transformers (ranges),
while scripts/setup.sh, CI and docker/Dockerfile install the exact, reproducible set the suite passed with.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
DECLARED = [Requirement(line) for line in PROJECT["dependencies"]] + [
    Requirement(line) for extra in PROJECT["optional-dependencies"].values() for line in extra
]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.!]*)$")  # name==version, no local label


def pins() -> dict[str, str]:
    found = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"constraints.txt: {line!r} is not name==version"
        name = canonicalize_name(match.group(1))
        assert name not in found, f"constraints.txt pins {name} twice"
        found[name] = match.group(2)
    return found


def test_every_dependency_is_a_range_with_a_floor():
    for requirement in DECLARED:
        operators = {specifier.operator for specifier in requirement.specifier}
        assert not operators & {"==", "==="}, f"pyproject.toml: {requirement} is pinned; declare a range"
        assert ">=" in operators, f"pyproject.toml: {requirement} has no floor (>= the version the suite passed with)"


def test_constraints_pin_every_dependency_inside_its_range():
    pinned = pins()
    assert "astrai" not in pinned
    for requirement in DECLARED:
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"constraints.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(Version(pinned[name])), (
            f"constraints.txt pins {name}=={pinned[name]}, outside pyproject.toml's {requirement}"
        )
    assert pinned["torch"] == "2.13.0"  # the CPU wheel on the build machines (no +cpu: a CUDA build satisfies it)


def test_the_installers_use_the_constraints():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "pip install --quiet -c constraints.txt -e '.[dev]'" in setup
    assert "bash scripts/setup.sh" in (REPO / ".ci" / "run").read_text()
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert dockerfile.count("COPY pyproject.toml README.md constraints.txt ./") == 2  # both stages
    for install in re.findall(r"pip install [^\n]*", dockerfile):
        if "/tmp/torch.txt" not in install and "--no-deps" not in install:  # torch: from PyTorch's own index
            assert "-c constraints.txt" in install, install
    for extra in re.findall(r'optional-dependencies"\]\["([^"]+)"\]', dockerfile):  # the image names real extras
        assert extra in PROJECT["optional-dependencies"], f"docker/Dockerfile reads a missing extra {extra!r}"
