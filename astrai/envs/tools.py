"""Tools: plain Python functions a model calls during a multi-turn episode (`env.tools`).

A tool is any importable function with type hints and a Google-style docstring (an `Args:` line per argument):
transformers' `get_json_schema` turns it into the JSON schema the chat template shows the model
(`apply_chat_template(messages, tools=[schema, ...])`). The model's calls are parsed from its text:
- with the tokenizer's own `response_template` where it has one (transformers' `tokenizer.parse_response`);
- otherwise in the documented default, the Hermes / Qwen2.5 format the Qwen2.5 template asks for, one block per
  call (several per turn allowed):

      <tool_call>
      {"name": "calculate", "arguments": {"expression": "123 * 456"}}
      </tool_call>

  `arguments` may also be a JSON string holding the object.
A malformed call (bad JSON, no name, arguments that are not an object, an unclosed tag) becomes an error entry
that goes back to the model as a tool message and is counted; it never raises. Results go back as
`{"role": "tool", "name": ..., "content": ...}` messages, the shape the Qwen2.5 / Hermes templates render inside
`<tool_response>` blocks.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

from astrai.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_KINDS = ("ok", "unknown_tool", "bad_arguments", "exception", "timeout", "malformed")
_JSON_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
_SHOWN_CHARS = 300  # how much of a bad call or a long error message goes back to the model


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call: `schema` is `get_json_schema(function)`, `{"type": "function", ...}`."""

    name: str
    function: Callable[..., Any]
    schema: dict


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn split up: `content` is the text outside the calls (stripped), `calls` the well-formed calls
    in order, `errors` one model-readable line per malformed call."""

    content: str
    calls: list[ToolCall]
    errors: list[str]


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: `kind` is one of `RESULT_KINDS` (for metrics), `content` what the model reads.
    `name` is the called tool's name ("" for a malformed call whose name could not be read)."""

    name: str
    kind: str
    content: str

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


# ----------------------------------------------------------------------------- loading


def load_tools(specs: Sequence[str], key: str = "env.tools") -> list[Tool]:
    """Each "package.module:function" imported and described by its JSON schema; a ConfigError naming
    `key[index]` and the spec for a spec that does not import, a function without type hints or without a
    docstring that describes its arguments, and two tools of one name."""
    tools: list[Tool] = []
    seen: dict[str, str] = {}
    for index, spec in enumerate(specs):
        where = f"{key}[{index}]"
        function = _import_function(spec, where)
        schema = _schema(function, spec, where)
        name = schema["function"]["name"]
        if name in seen:
            raise ConfigError(
                f"{where}: {spec!r} is a tool named {name!r}, like {seen[name]}; tool names must be unique"
            )
        seen[name] = f"{where} ({spec!r})"
        tools.append(Tool(name=name, function=function, schema=schema))
    return tools


def _import_function(spec: str, where: str) -> Callable[..., Any]:
    module_name, colon, attribute = str(spec).partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(f"{where}: {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{where}: cannot import {module_name!r} for {spec!r}: {error}") from None
    except SyntaxError as error:
        raise ConfigError(
            f"{where}: {error.filename}:{error.lineno}: {error.msg} (importing {module_name!r} for {spec!r})"
        ) from None
    except (Exception, SystemExit) as error:  # the module runs code at import; whatever it raises, it is unusable
        raise ConfigError(
            f"{where}: importing {module_name!r} for {spec!r} raised {type(error).__name__}: {_one_line(error)}"
        ) from None
    if not hasattr(module, attribute):
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {attribute!r} (from {spec!r})")
    function = getattr(module, attribute)
    if not callable(function):
        raise ConfigError(f"{where}: {spec!r} is a {type(function).__name__}, not a callable function")
    return function


def _schema(function: Callable[..., Any], spec: str, where: str) -> dict:
    """transformers' schema of the function, its failures reworded into one line."""
    name = getattr(function, "__name__", spec)
    try:
        return get_json_schema(function)
    except (TypeHintParsingException, NameError) as error:
        raise ConfigError(
            f"{where}: tool {name!r} ({spec!r}) lacks usable type hints: {_one_line(error)}; every argument needs "
            "a JSON-compatible type hint (int, float, str, bool, list[...], dict[str, ...], Literal, Optional)"
        ) from None
    except DocstringParsingException as error:
        raise ConfigError(
            f"{where}: tool {name!r} ({spec!r}) lacks a docstring describing its arguments: {_one_line(error)}; "
            "write a Google-style docstring with a description and an 'Args:' line for every argument"
        ) from None
    except Exception as error:
        raise ConfigError(
            f"{where}: tool {name!r} ({spec!r}) cannot be described as a JSON schema: "
            f"{type(error).__name__}: {_one_line(error)}"
        ) from None


def check_template_supports_tools(
    tokenizer: PreTrainedTokenizerBase, tools: Sequence[Tool], key: str = "env.tools"
) -> None:
    """Refuse a chat template that cannot show the tools to the model: it raises when given `tools`, or its
    rendering of a one-message conversation with tools is the same as without them or does not contain every
    tool's name (it ignores `tools`)."""
    if not tools:
        return
    messages = [{"role": "user", "content": "Hello."}]
    try:
        with_tools, without_tools = (
            str(tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True))
            for schemas in ([tool.schema for tool in tools], None)
        )
    except Exception as error:
        raise ConfigError(
            f"{key}: the tokenizer's chat template fails to render a conversation with tools: "
            f"{type(error).__name__}: {_one_line(error)}"
        ) from None
    missing = [tool.name for tool in tools if tool.name not in with_tools]
    if missing or with_tools == without_tools:
        unnamed = f"never names {', '.join(repr(name) for name in missing)}" if missing else "is the same without them"
        raise ConfigError(
            f"{key}: the tokenizer's chat template ignores `tools` (the rendered prompt {unnamed}), so the model "
            "would never see them; set tokenizer.chat_template to a template that renders tools (for example "
            "Qwen2.5's)"
        )


# ----------------------------------------------------------------------------- parsing


def parse_tool_calls(
    text: str, tokenizer: PreTrainedTokenizerBase | None = None, *, tools: Sequence[Tool] = (), prefix: str = ""
) -> ParsedTurn:
    """Split a model turn (decoded text) into its content, its well-formed calls and its malformed-call errors.
    With a tokenizer that has a `response_template`, transformers' `tokenizer.parse_response(text, prefix=...,
    tools=...)` parses it (`prefix`: the rendered prompt before the turn, for templates that pre-write part of
    it; `tools` cast string arguments to their schema's types); otherwise the Hermes / Qwen2.5 `<tool_call>`
    default of the module docstring. Never raises on what the model wrote."""
    template = getattr(tokenizer, "response_template", None) if tokenizer is not None else None
    if template is not None:
        return _parse_with_response_template(tokenizer, text, prefix, [tool.schema for tool in tools])
    return _parse_hermes(text)


def _parse_with_response_template(
    tokenizer: PreTrainedTokenizerBase, text: str, prefix: str, schemas: list[dict]
) -> ParsedTurn:
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=schemas or None)
    except Exception as error:  # transformers raises on a region it cannot parse (bad JSON in a call, ...)
        problem = f"the turn does not parse with the tokenizer's response_template: {_one_line(error)}"
        return ParsedTurn(content=text.strip(), calls=[], errors=[f"malformed tool call: {_clip(problem)}"])
    calls, errors = [], []
    for entry in message.get("tool_calls") or []:
        # transformers' templates shape a call as {"type": "function", "function": {"name", "arguments"}}
        inner = entry.get("function", entry) if isinstance(entry, dict) else entry
        call = _tool_call(inner)
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"malformed tool call: {call}: {_clip(json.dumps(entry, default=str))}")
    content = message.get("content") or ""
    return ParsedTurn(content=str(content).strip(), calls=calls, errors=errors)


def _parse_hermes(text: str) -> ParsedTurn:
    """Every `<tool_call>...</tool_call>` block, in order; the text between them is the content."""
    outside, calls, errors = [], [], []
    position = 0
    while True:
        start = text.find(CALL_OPEN, position)
        before = text[position:] if start < 0 else text[position:start]
        outside.append(before)
        if CALL_CLOSE in before:
            errors.append(f"malformed tool call: {CALL_CLOSE} without a {CALL_OPEN} before it")
        if start < 0:
            break
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end < 0:
            shown = _clip(text[start:].strip())
            errors.append(f"malformed tool call: {CALL_OPEN} is never closed by {CALL_CLOSE}: {shown}")
            break
        body = text[body_start:end].strip()
        try:
            call = _tool_call(json.loads(body))
        except json.JSONDecodeError as error:
            call = f"invalid JSON ({error})"
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"malformed tool call: {call}: {_clip(body)}")
        position = end + len(CALL_CLOSE)
    return ParsedTurn(content="".join(outside).strip(), calls=calls, errors=errors)


def _tool_call(entry: object) -> ToolCall | str:
    """A ToolCall from {"name": str, "arguments": object or JSON string}, or what is wrong with it."""
    if not isinstance(entry, dict):
        return f'expected a JSON object with "name" and "arguments", got {_json_type(entry)}'
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'missing "name" (the tool\'s name, a string)'
    arguments = entry.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return f'"arguments" of {name!r} is a string that is not valid JSON ({error})'
    if not isinstance(arguments, dict):
        return f'"arguments" of {name!r} must be a JSON object, got {_json_type(arguments)}'
    return ToolCall(name=name.strip(), arguments=arguments)


# ----------------------------------------------------------------------------- running


def run_tool_calls(calls: Sequence[ToolCall], tools: Sequence[Tool], timeout_s: float | None) -> list[ToolResult]:
    """Run the calls one after another (in the order written: a later call may depend on an earlier one's
    effect), each in its own daemon worker thread joined for at most `timeout_s` seconds (None: no limit).
    Never raises for what a call does: an unknown tool, arguments that do not bind to the function's
    signature, an exception inside the tool and a call past its time each become an error result.

    A Python thread cannot be killed: a call past its timeout is abandoned, not stopped, and goes on running
    (and holding whatever it holds) in the background until it returns. Tools that can hang must bound
    themselves; the sandboxed `run_python` does, its code running in a child process that is killed at its
    own wall-clock limit."""
    by_name = {tool.name: tool for tool in tools}
    return [_run_one(call, by_name, timeout_s) for call in calls]


def malformed_results(errors: Sequence[str]) -> list[ToolResult]:
    """The errors of `ParsedTurn.errors` as results, so the model reads them like any other tool reply."""
    return [ToolResult(name="", kind="malformed", content=f"error: {error}") for error in errors]


def tool_messages(results: Sequence[ToolResult]) -> list[dict]:
    """The chat messages that carry the results back: `{"role": "tool", "name": ..., "content": ...}` (no name
    for a malformed call whose name is unknown). Qwen2.5 / Hermes templates render each in a `<tool_response>`."""
    messages = []
    for result in results:
        message = {"role": "tool", "name": result.name, "content": result.content}
        if not result.name:
            del message["name"]
        messages.append(message)
    return messages


def _run_one(call: ToolCall, by_name: dict[str, Tool], timeout_s: float | None) -> ToolResult:
    tool = by_name.get(call.name)
    if tool is None:
        available = ", ".join(sorted(by_name)) or "none"
        return ToolResult(call.name, "unknown_tool", f"error: unknown tool {call.name!r} (available: {available})")
    problem = _argument_problem(tool, call.arguments)
    if problem:
        return ToolResult(call.name, "bad_arguments", f"error: bad arguments for {call.name!r}: {problem}")
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = tool.function(**call.arguments)
        except BaseException as error:  # SystemExit included: reported to the model, never raised
            outcome["error"] = error

    worker = threading.Thread(target=work, name=f"astrai-tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return ToolResult(call.name, "timeout", f"error: {call.name!r} timed out after {timeout_s:g} s")
    if "error" in outcome:
        error = outcome["error"]
        return ToolResult(call.name, "exception", f"error: {type(error).__name__}: {_clip(str(error))}")
    return ToolResult(call.name, "ok", _as_text(outcome.get("value")))


def _argument_problem(tool: Tool, arguments: dict) -> str:
    """What keeps `arguments` from binding to the tool's signature ("" when they bind): missing and unexpected
    names, and the parameters the tool takes."""
    try:
        signature = inspect.signature(tool.function)
    except (TypeError, ValueError):  # no signature to check (a builtin): the call itself will say
        return ""
    try:
        signature.bind(**arguments)
        return ""
    except TypeError as error:
        reason = str(error)
    parameters = signature.parameters.values()
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)
    named = {parameter.name for parameter in parameters}
    required = [
        parameter.name
        for parameter in parameters
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    problems = []
    if missing := [name for name in required if name not in arguments]:
        problems.append(f"missing {', '.join(repr(name) for name in missing)}")
    unexpected = [] if takes_any else [name for name in arguments if name not in named]
    if unexpected:
        problems.append(f"unexpected {', '.join(repr(name) for name in unexpected)}")
    expected = ", ".join(tool.schema["function"]["parameters"].get("properties", {})) or "no arguments"
    return f"{'; '.join(problems) or reason} (it takes: {expected})"


def _as_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as is, anything else as JSON where it can
    be, else `str()`."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _json_type(value: object) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
