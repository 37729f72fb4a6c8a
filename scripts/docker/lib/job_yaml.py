"""Read a job YAML on the host, with python3 and PyYAML only, and render shell for the wrappers.

GPU hosts run scripts/train.sh and scripts/serve.sh without AstrAI installed, so nothing here may
import astrai, pydantic or torch. The wrappers own the container keys of `infra:` and the whole `serve:`
section: the trainer's schema accepts them as given, and only the wrappers check them, each error naming
the key, before any container starts. Two things of astrai/config are mirrored, and
tests/unit/docker/test_runtime.py keeps them in step with the originals:
- the YAML 1.2 scalar rules of astrai/config/loader.py (`2e-5` is a float, `on` is a string), so a
  value renders here exactly as the trainer renders it;
- the key names of InfraConfig (astrai/config/sections/infra.py), whose multi-node keys
  `python -m astrai launch` validates.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

try:
    import yaml
except ImportError:  # reported by load_job_file, where the user can act on it
    yaml = None


class JobFileError(Exception):
    """A job file the wrappers cannot use; the message names the file and the key."""


_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_GPU_KEYS = ("devices", "count")


def _yaml12_loader() -> type:
    """SafeLoader with YAML 1.2 float and bool rules (a copy of astrai.config.loader.Yaml12Loader)."""

    class Yaml12Loader(yaml.SafeLoader):
        pass

    Yaml12Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
    Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))
    return Yaml12Loader


def load_job_file(path: str | Path) -> dict:
    """The job YAML as a mapping; JobFileError when PyYAML is missing or the file is not a mapping."""
    if yaml is None:
        raise JobFileError(
            f"PyYAML is not installed for {sys.executable}: the wrappers read the job YAML with it "
            "(Debian/Ubuntu: apt install python3-yaml; otherwise: python3 -m pip install --user pyyaml)"
        )
    path = Path(path)
    if not path.is_file():
        raise JobFileError(f"job file {str(path)!r} does not exist")
    try:
        document = yaml.load(path.read_text(), Loader=_yaml12_loader())
    except yaml.YAMLError as error:
        raise JobFileError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(document, dict):
        raise JobFileError(
            f"{path}: the job file must be a mapping of sections (output_dir, model, data, train, infra, ...)"
        )
    return document


def section(document: dict, dotted: str, source: Path | str) -> dict:
    """The mapping at `dotted` (e.g. "runtime.environment"); {} when absent or null, an error when not a mapping."""
    node: Any = document
    for depth, key in enumerate(dotted.split(".")):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return {}
        if not isinstance(node, dict):
            where = ".".join(dotted.split(".")[: depth + 1])
            raise JobFileError(f"{source}: {where}: expected a mapping of keys, got {type(node).__name__} {node!r}")
    return node


def check_known_keys(mapping: dict, known: tuple[str, ...], where: str, source: Path | str) -> None:
    """Unknown keys are errors, as in the trainer's schema (`extra="forbid"`): a typo never falls back silently."""
    for key in mapping:
        if key not in known:
            raise JobFileError(f"{source}: {where}.{key}: unknown key (known: {', '.join(known)})")


def text_value(mapping: dict, key: str, where: str, source: Path | str) -> str | None:
    """A non-empty string value, or None when the key is absent or null."""
    value = mapping.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise JobFileError(f"{source}: {where}.{key}: expected a non-empty string, got {value!r}")
    return value


def host_path(value: str, job_file: Path) -> str:
    """A host path from the job YAML, absolute: `~` expanded, relative paths taken from the job file's folder."""
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (job_file.resolve().parent / path).resolve())


def parse_gpu(infra: dict, source: Path | str) -> tuple[list[int] | str | None, int | None]:
    """(devices, count) of `infra.gpu`: devices is "all", a list of GPU indices, or None when not given."""
    gpu = infra.get("gpu")
    gpu = {} if gpu is None else gpu
    if not isinstance(gpu, dict):
        raise JobFileError(f"{source}: infra.gpu: expected a mapping (devices, count), got {gpu!r}")
    check_known_keys(gpu, _GPU_KEYS, "infra.gpu", source)
    devices = gpu.get("devices")
    if devices is not None and devices != "all":
        valid = (
            isinstance(devices, list)
            and devices
            and all(isinstance(index, int) and not isinstance(index, bool) and index >= 0 for index in devices)
            and len(set(devices)) == len(devices)
        )
        if not valid:
            raise JobFileError(
                f"{source}: infra.gpu.devices: expected `all` or a list of distinct GPU indices like [0, 1, 2, 3], "
                f"got {devices!r}"
            )
    count = gpu.get("count")
    if count is not None:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise JobFileError(f"{source}: infra.gpu.count: expected a positive integer, got {count!r}")
        if isinstance(devices, list) and count > len(devices):
            raise JobFileError(
                f"{source}: infra.gpu.count: {count} ranks but infra.gpu.devices lists only {len(devices)} GPUs"
            )
    return devices, count


def render_env_value(value: Any) -> str:
    """How the trainer renders a runtime.environment value (astrai/launch/environment.py): str(), null as ''."""
    return "" if value is None else str(value)


def export_line(name: str, value: str) -> str:
    """`export NAME='value'`, quoted so that eval in bash yields exactly `value` (spaces, quotes, `$` included)."""
    return f"export {name}={shlex.quote(value)}"


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines of an env file as compose reads them (comments, blank lines, optional quotes, `export `)."""
    values: dict[str, str] = {}
    path = Path(path)
    if not path.is_file():
        return values
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        key = key.strip().removeprefix("export ").strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:  # an unquoted value ends where an inline comment starts
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def run_cli(main) -> None:
    """Run a runtime's `main(argv) -> str` (shell text on stdout); JobFileError becomes one line on stderr, exit 2."""
    try:
        sys.stdout.write(main(sys.argv[1:]))
    except JobFileError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
