"""Load a job YAML: YAML 1.2 scalars, `--set a.b.c=value` overrides, validation with located errors.

PyYAML implements YAML 1.1, where `2e-5` is a *string* and `on`/`yes` are booleans. A learning rate
that silently becomes a string is the classic config bug, so the loader swaps in the YAML 1.2 core
rules for floats and booleans.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from astrai.config.schema import JobConfig
from astrai.errors import AstraiError


class ConfigError(AstraiError):
    """A job file that cannot run; the message names the file, the key path and (when known) the line."""


class Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's float and bool rules."""


_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")

Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))


MAX_EXPANDED_NODES = 100_000  # a job file has hundreds of nodes; aliases may not multiply them past this


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """YAML 1.2 scalars; aliases are checked before anything is built (see `expanded_size`)."""
    loader = Yaml12Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node, {}, set(), source) > MAX_EXPANDED_NODES:
            raise ConfigError(
                f"{source}: aliases (*name) expand the document to more than {MAX_EXPANDED_NODES} nodes: "
                "an alias bomb, or anchors reused far too often"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    except RecursionError:  # PyYAML composes and builds recursively
        raise ConfigError(f"{source}: the YAML is nested too deeply to read") from None
    finally:
        loader.dispose()


def expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int], source: str) -> int:
    """Nodes of the document once every alias is copied out (as json, pydantic or a dump would):
    counted with one entry per distinct node, so a bomb of 10 nested 10-fold aliases costs 100 steps,
    not 10**10. A node that contains itself (a recursive anchor) has no finite expansion."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError(f"{source}:{node.start_mark.line + 1}: an anchor refers to itself (a recursive alias)")
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1
    for child in children:
        size += expanded_size(child, sizes, open_nodes, source)
        if size > MAX_EXPANDED_NODES:
            break  # big enough to refuse; the rest need not be counted
    open_nodes.discard(key)
    sizes[key] = size
    return size


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` in place; the value is parsed as YAML (so `1e-4` is a float)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key.path=value")
    key_path, value_text = assignment.split("=", 1)
    keys = key_path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"--set {assignment!r}: empty key in {key_path!r}")
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {'.'.join(keys[: depth + 1])} is not a mapping")
        node = child
    node[keys[-1]] = parse_yaml(value_text, f"--set {key_path}")


def _line_of(text: str, location: tuple) -> int | None:
    """Line (1-based) of a key path in the YAML text, or of its deepest existing parent."""
    try:
        node = yaml.compose(text, Loader=Yaml12Loader)
    except yaml.YAMLError:
        return None
    line = None
    for key in location:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _describe(error: ValidationError, text: str, source: str, overrides: list[str]) -> str:
    lines = []
    for item in error.errors():
        location = tuple(part for part in item["loc"] if not str(part).startswith("function-after"))
        dotted = ".".join(str(part) for part in location) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif item["type"] == "missing":
            message = "required key is missing"
        elif item["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        overridden = [o for o in overrides if o.split("=", 1)[0].strip() == dotted]
        where = f"--set {overridden[-1]}" if overridden else source
        line = None if overridden else _line_of(text, location)
        lines.append(f"{where}{f':{line}' if line else ''}: {dotted}: {message}")
    if len(lines) == 1:
        return f"invalid job config: {lines[0]}"
    return "invalid job config:\n  " + "\n  ".join(lines)


def _missing_folder_hint(value: str) -> str:
    """What a missing model folder most likely is: a hub name, or another job's export not made yet."""
    parts = Path(value).parts
    if len(parts) == 2 and not value.startswith((".", "/")) and not Path(parts[0]).exists():
        return " (hub names cannot be downloaded here: give a local folder)"
    if parts and parts[-1] == "hf":
        return (
            " (the Hugging Face export of another job: run that job first; "
            "configs/quickstart.yaml writes runs/quickstart/hf, configs/quickstart_rm.yaml runs/rm/hf)"
        )
    return ""


def _check_paths(job: JobConfig, source: str) -> None:
    """Fail before any rank works when a local file the job names is not there."""
    if not glob.glob(job.data.path) and not Path(job.data.path).exists():
        raise ConfigError(f"{source}: data.path: no file matches {job.data.path!r}")
    eval_path = job.eval.data_path if job.eval is not None else None
    if eval_path is not None and not glob.glob(eval_path) and not Path(eval_path).exists():
        raise ConfigError(f"{source}: eval.data_path: no file matches {eval_path!r}")
    for key, value in (
        ("model.path", job.model.path),
        ("model.reference_path", job.model.reference_path),
        ("tokenizer.path", job.tokenizer.path),
        ("critic.path", job.critic.path),
        ("model.init_from_checkpoint", job.model.init_from_checkpoint),
    ):
        if value is not None and not Path(value).is_dir():
            raise ConfigError(f"{source}: {key}: local folder {value!r} does not exist{_missing_folder_hint(value)}")
    if job.deepspeed.config is not None and resolve_template(job.deepspeed.config, source) is None:
        raise ConfigError(f"{source}: deepspeed.config: template {job.deepspeed.config!r} not found")


def resolve_template(name: str, source: str) -> Path | None:
    """A DeepSpeed template path as given, relative to the job file, or in the repo's `ds_configs/`."""
    repo = Path(__file__).resolve().parents[2]
    job_dir = Path(source).parent if source != "<string>" else Path(".")
    for candidate in (Path(name), job_dir / name, repo / name, repo / "ds_configs" / name):
        if candidate.is_file():
            return candidate
    return None


def load_job(path: str | Path, overrides: list[str] | tuple = (), check_paths: bool = True) -> JobConfig:
    """Read, override and validate a job file; raises ConfigError with file, key and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        byte = error.object[error.start]
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{byte:02x}): save the job file as UTF-8") from None
    raw = parse_yaml(text, str(path))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the job file must be a mapping of sections (output_dir, model, data, train, ...)")
    for assignment in overrides:
        apply_override(raw, assignment)
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_describe(error, text, str(path), list(overrides))) from None
    if check_paths:
        _check_paths(job, str(path))
    return job


def dump_job(job: JobConfig) -> str:
    """The resolved config as YAML (what `output_dir/job.yaml` and each checkpoint hold)."""
    return yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)
