"""Tools (astrai/envs/tools.py): loading and schemas through transformers' `get_json_schema`, the one-line
refusals (bad spec, untyped, no docstring, duplicate names, a chat template that ignores tools), parsing the
model's calls (the Hermes / Qwen2.5 default and a tokenizer's own `response_template`), and running them (ok,
unknown tool, bad arguments, an exception, a timeout) into tool messages a Qwen2.5-style template renders."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from astrai.config import ConfigError
from astrai.envs.tools import (
    ParsedTurn,
    ToolCall,
    check_template_supports_tools,
    load_tools,
    malformed_results,
    parse_tool_calls,
    run_tool_calls,
    tool_messages,
)
from astrai.models.tokenizer import build_tokenizer

# A Qwen2.5-style ChatML template that renders `tools` in the system turn and tool results in <tool_response>.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call one or more functions.\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'For each call, answer <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The Hermes format as a transformers `response_template` (the shape transformers' serving uses for Qwen2).
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}
RELEASE = threading.Event()  # lets the sleeping tool of the timeout test finish once the test is done


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def greet(name: str, punctuation: str = "!") -> str:
    """Greet someone.

    Args:
        name: Who to greet.
        punctuation: What ends the greeting.
    """
    return f"hello {name}{punctuation}"


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def sleepy(seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: How long to sleep.
    """
    RELEASE.wait(seconds)
    return "awake"


def untyped(a, b: int) -> int:
    """Untyped.

    Args:
        a: The first.
        b: The second.
    """
    return b


def undocumented(a: int) -> int:
    return a


def half_documented(a: int, b: int) -> int:
    """Only a is described.

    Args:
        a: The first.
    """
    return a


@pytest.fixture
def tool_module(monkeypatch):
    """An importable module `tool_fixtures` holding the functions above and a non-callable."""
    module = types.ModuleType("tool_fixtures")
    for function in (add, greet, divide, sleepy, untyped, undocumented, half_documented):
        setattr(module, function.__name__, function)
    module.NUMBER = 3
    monkeypatch.setitem(sys.modules, "tool_fixtures", module)
    other = types.ModuleType("tool_fixtures_other")
    other.add = add
    monkeypatch.setitem(sys.modules, "tool_fixtures_other", other)
    return module


@pytest.fixture
def tools(tool_module):
    return load_tools([f"tool_fixtures:{name}" for name in ("add", "greet", "divide", "sleepy")])


def _tokenizer(template: str):
    tokenizer = build_tokenizer("char", ["abc"])
    tokenizer.chat_template = template
    return tokenizer


# ----------------------------------------------------------------------------- loading


def test_schema_of_a_typed_documented_function(tools):
    assert [tool.name for tool in tools] == ["add", "greet", "divide", "sleepy"]
    assert tools[0].function is add
    assert tools[0].schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }
    assert tools[1].schema["function"]["parameters"]["required"] == ["name"]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tool_fixtures.add", "env.tools[0]: 'tool_fixtures.add' must look like 'package.module:function'"),
        ("no_such_module_xyz:f", "env.tools[0]: cannot import 'no_such_module_xyz'"),
        ("tool_fixtures:missing", "env.tools[0]: module 'tool_fixtures' has no attribute 'missing'"),
        ("tool_fixtures:NUMBER", "env.tools[0]: 'tool_fixtures:NUMBER' is a int, not a callable function"),
        ("tool_fixtures:untyped", "env.tools[0]: tool 'untyped' ('tool_fixtures:untyped') lacks usable type hints"),
        ("tool_fixtures:undocumented", "tool 'undocumented' ('tool_fixtures:undocumented') lacks a docstring"),
        ("tool_fixtures:half_documented", "no description for the argument 'b'"),
    ],
)
def test_bad_tools_are_refused_in_one_line(tool_module, spec, expected):
    with pytest.raises(ConfigError) as caught:
        load_tools([spec])
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message and message.startswith("env.tools[0]: ")


def test_duplicate_names_are_refused(tool_module):
    with pytest.raises(ConfigError, match=r"^env\.tools\[1\]: 'tool_fixtures_other:add' is a tool named 'add', like "):
        load_tools(["tool_fixtures:add", "tool_fixtures_other:add"])


def test_the_key_is_the_callers(tool_module):
    with pytest.raises(ConfigError, match=r"^agent\.tools\[0\]: "):
        load_tools(["tool_fixtures:untyped"], key="agent.tools")


# ----------------------------------------------------------------------------- template check


def test_a_template_that_renders_tools_passes(tools):
    check_template_supports_tools(_tokenizer(TOOLS_TEMPLATE), tools)


def test_a_template_that_ignores_tools_is_refused(tools):
    tokenizer = build_tokenizer("char", ["abc"])  # AstrAI's plain ChatML template: no tools
    with pytest.raises(ConfigError) as caught:
        check_template_supports_tools(tokenizer, tools)
    message = str(caught.value)
    assert message.startswith("env.tools: the tokenizer's chat template ignores `tools`") and "'add'" in message
    assert "\n" not in message


def test_a_template_that_names_the_tools_anyway_is_refused(tools):
    """A template that ignores `tools` but happens to print their names (here: in a fixed system prompt)."""
    tokenizer = _tokenizer("system: add greet divide sleepy\n" + TOOLS_TEMPLATE.replace("{% if tools %}", "{% if 0 %}"))
    with pytest.raises(ConfigError, match=r"ignores `tools` \(the rendered prompt is the same without them\)"):
        check_template_supports_tools(tokenizer, tools)


def test_a_template_that_raises_is_refused(tools):
    tokenizer = _tokenizer("{{ raise_exception('no tools here') }}")
    with pytest.raises(ConfigError, match=r"^env\.tools: the tokenizer's chat template fails .*no tools here"):
        check_template_supports_tools(tokenizer, tools)


# ----------------------------------------------------------------------------- parsing (Hermes default)


def test_one_call():
    parsed = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert parsed == ParsedTurn(content="", calls=[ToolCall("add", {"a": 1, "b": 2})], errors=[])


def test_two_calls_with_surrounding_text():
    text = (
        "Let me compute both.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "greet", "arguments": {"name": "Ada"}}\n</tool_call>\n'
        "Done."
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("greet", {"name": "Ada"})]
    assert parsed.content == "Let me compute both.\n\n\nDone."
    assert parsed.errors == []


def test_arguments_as_a_json_string_are_decoded():
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}</tool_call>')
    assert parsed.calls == [ToolCall("add", {"a": 4, "b": 5})] and parsed.errors == []


def test_no_call_at_all():
    assert parse_tool_calls("  The answer is 42.  ") == ParsedTurn(content="The answer is 42.", calls=[], errors=[])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "add", "arguments": {"a": 1,}}', "invalid JSON (Expecting property name"),
        ('{"arguments": {"a": 1}}', 'missing "name"'),
        ('{"name": "", "arguments": {}}', 'missing "name"'),
        ('{"name": "add", "arguments": [1, 2]}', "\"arguments\" of 'add' must be a JSON object, got an array"),
        ('{"name": "add", "arguments": "{not json"}', "\"arguments\" of 'add' is a string that is not valid JSON"),
        ('["add", 1]', 'expected a JSON object with "name" and "arguments", got an array'),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(body, expected):
    text = f'before <tool_call>{body}</tool_call> <tool_call>{{"name": "add", "arguments": {{}}}}</tool_call> after'
    parsed = parse_tool_calls(text)
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("malformed tool call: "), parsed.errors
    assert expected in parsed.errors[0] and parsed.errors[0].endswith(f": {body}")
    assert parsed.calls == [ToolCall("add", {})]  # the well-formed call next to it still counts
    assert parsed.content == "before   after"


def test_an_unclosed_tag_is_an_error():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and parsed.content == "ok"
    assert parsed.errors == [
        'malformed tool call: <tool_call> is never closed by </tool_call>: <tool_call>{"name": "add", '
        '"arguments": {"a": 1, "b": 2}}'
    ]


def test_a_close_without_an_open_is_an_error():
    parsed = parse_tool_calls('{"name": "add"}</tool_call>')
    assert parsed.calls == [] and parsed.errors == ["malformed tool call: </tool_call> without a <tool_call> before it"]


def test_a_tokenizer_without_a_response_template_uses_the_default():
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    assert getattr(tokenizer, "response_template", None) is None
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', tokenizer)
    assert parsed.calls == [ToolCall("add", {"a": 1})]


# ----------------------------------------------------------------------------- parsing (response_template)


def test_a_response_template_parses_through_transformers(tools):
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    text = (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "greet", "arguments": {"name": "Ada"}}\n</tool_call><|im_end|>'
    )
    parsed = parse_tool_calls(text, tokenizer, tools=tools)
    # tools= lets transformers cast "2" to the schema's integer
    assert parsed == ParsedTurn(
        content="Sure.", calls=[ToolCall("add", {"a": 2, "b": 3}), ToolCall("greet", {"name": "Ada"})], errors=[]
    )


def test_a_response_template_failure_is_an_error_not_an_exception():
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {</tool_call>', tokenizer)
    assert parsed.calls == [] and len(parsed.errors) == 1
    assert parsed.errors[0].startswith("malformed tool call: the turn does not parse with the tokenizer's response")


def test_a_response_template_call_without_a_name_is_an_error():
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    parsed = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', tokenizer)
    assert parsed.calls == [] and parsed.errors[0].startswith('malformed tool call: missing "name"')


# ----------------------------------------------------------------------------- running


def test_an_ok_call(tools):
    results = run_tool_calls([ToolCall("add", {"a": 2, "b": 3}), ToolCall("greet", {"name": "Ada"})], tools, 5)
    assert [(r.name, r.kind, r.content) for r in results] == [("add", "ok", "5"), ("greet", "ok", "hello Ada!")]
    assert all(result.ok for result in results)


def test_an_unknown_tool(tools):
    (result,) = run_tool_calls([ToolCall("multiply", {"a": 1})], tools, 5)
    assert result.kind == "unknown_tool"
    assert result.content == "error: unknown tool 'multiply' (available: add, divide, greet, sleepy)"


def test_a_missing_argument(tools):
    (result,) = run_tool_calls([ToolCall("add", {"a": 1})], tools, 5)
    assert result.kind == "bad_arguments"
    assert result.content == "error: bad arguments for 'add': missing 'b' (it takes: a, b)"


def test_an_extra_argument(tools):
    (result,) = run_tool_calls([ToolCall("greet", {"name": "Ada", "mood": "happy"})], tools, 5)
    assert result.kind == "bad_arguments"
    assert result.content == "error: bad arguments for 'greet': unexpected 'mood' (it takes: name, punctuation)"


def test_an_exception_in_the_tool(tools):
    (result,) = run_tool_calls([ToolCall("divide", {"a": 1, "b": 0})], tools, 5)
    assert result.kind == "exception" and result.content == "error: ZeroDivisionError: division by zero"


def test_a_call_past_its_timeout(tools):
    started = time.monotonic()
    try:
        results = run_tool_calls([ToolCall("sleepy", {"seconds": 30}), ToolCall("add", {"a": 1, "b": 1})], tools, 0.2)
    finally:
        RELEASE.set()  # the abandoned thread cannot be killed; let it return
    assert time.monotonic() - started < 5
    assert [(r.kind, r.content) for r in results] == [("timeout", "error: 'sleepy' timed out after 0.2 s"), ("ok", "2")]


def test_tool_messages_render_in_a_tools_template(tools):
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><tool_call>x')
    results = run_tool_calls(parsed.calls, tools, 5) + malformed_results(parsed.errors)
    assert [result.kind for result in results] == ["ok", "malformed"]
    messages = tool_messages(results)
    assert messages[0] == {"role": "tool", "name": "add", "content": "5"}
    assert messages[1] == {"role": "tool", "content": f"error: {parsed.errors[0]}"}
    rendered = _tokenizer(TOOLS_TEMPLATE).apply_chat_template(messages, tokenize=False)
    assert "<tool_response>\n5\n</tool_response>" in rendered
