"""The config reference (`docs/guides/config.md`) generated from the schema, so docs cannot drift.

python -m astrai config-docs > docs/guides/config.md
"""

from __future__ import annotations

import json
import re
import typing

from pydantic import BaseModel

from astrai.config.schema import JobConfig

HEADER = """# Job config reference

Generated from `astrai/config/schema.py` by `python -m astrai config-docs`; a test fails when this file
and the schema disagree. Every key can be overridden on the command line with `--set key.path=value`
(the value is parsed as YAML 1.2, so `--set train.lr=2e-5` is a float).

Unknown keys are errors. Paths are relative to the directory the command runs in.
"""


def _section_model(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "null")
    # A section class by its import path: schema.py re-exports each one from its module in sections/.
    text = re.sub(r"astrai\.config\.sections\.\w+\.", "astrai.config.schema.", text)
    return text.replace("<class '", "").replace("'>", "").replace(" | ", " or ")


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
        return "`{}`" if value == {} else "(section defaults)" if isinstance(value, BaseModel) else f"`{value}`"
    return f"`{json.dumps(field.default)}`"


def _summary(model: type[BaseModel]) -> str:
    own = model.__doc__ if "__doc__" in vars(model) else None
    return (own or "").strip()


def iter_keys(model: type[BaseModel] = JobConfig, prefix: str = ""):
    """(dotted key, field) for every key of the schema, depth first."""
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        yield dotted, field
        nested = _section_model(field.annotation)
        if nested is not None:
            yield from iter_keys(nested, dotted + ".")


def render_reference() -> str:
    lines = [HEADER]
    for dotted, field in iter_keys():
        nested = _section_model(field.annotation)
        if nested is not None and "." not in dotted:
            lines += [
                "",
                f"## `{dotted}`",
                "",
                field.description or _summary(nested),
                "",
                "| key | type | default | meaning |",
                "| --- | --- | --- | --- |",
            ]
            continue
        if nested is not None:
            lines.append(f"| `{dotted}` | section | {_default(field)} | {field.description or ''} |")
            continue
        if "." not in dotted:
            lines += [
                "",
                f"## `{dotted}`",
                "",
                field.description or "",
                "",
                "| key | type | default | meaning |",
                "| --- | --- | --- | --- |",
            ]
        lines.append(
            f"| `{dotted}` | `{_type_name(field.annotation)}` | {_default(field)} | "
            f"{(field.description or '').replace('|', '/')} |"
        )
    return "\n".join(line for line in lines) + "\n"
