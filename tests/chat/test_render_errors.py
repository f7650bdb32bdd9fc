"""Malformed conversations and options -> ChatFormatError (a ValueError) naming the field."""

from __future__ import annotations

import pytest

from k3.chat import ChatFormatError, render_text


def call(id_: str | None, name: str = "f", arguments: object = "{}") -> dict:
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id_ is not None:
        c["id"] = id_
    return c


ASSISTANT = {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b", "g")]}

BAD = [
    ("unknown_role", [{"role": "wizard", "content": "x"}], {}, r"messages\[0\]\.role: unknown role 'wizard'"),
    ("missing_role", [{"content": "x"}], {}, r"unknown role None"),
    ("developer_role", [{"role": "developer", "content": "x"}], {}, r"unknown role 'developer'"),
    ("not_a_list", {"role": "user", "content": "x"}, {}, r"messages must be a list"),
    ("not_an_object", ["hello"], {}, r"messages\[0\] must be an object"),
    ("tool_without_call", [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "r"}], {},
     r"messages\[1\]: tool result has no preceding assistant message with tool_calls"),
    ("tool_first", [{"role": "tool", "name": "f", "content": "r"}], {}, r"no preceding assistant"),
    ("unmatched_id", [ASSISTANT, {"role": "tool", "tool_call_id": "zzz", "content": "r"}], {},
     r"messages\[1\]\.tool_call_id 'zzz' matches no tool call"),
    ("too_many_results", [ASSISTANT] + [{"role": "tool", "content": str(k)} for k in range(3)], {},
     r"3 tool results for 2 tool calls"),
    ("too_many_across_runs", [ASSISTANT, {"role": "tool", "content": "1"}, {"role": "user", "content": "u"},
                              {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}], {}, r"3 tool results for 2"),
    ("args_json_array", [{"role": "assistant", "content": "", "tool_calls": [call("a", arguments="[1, 2]")]}], {},
     r"tool_calls\[0\]\.function\.arguments must encode a JSON object, got list"),
    ("args_json_number", [{"role": "assistant", "content": "", "tool_calls": [call("a", arguments="5")]}], {}, r"got int"),
    ("args_wrong_type", [{"role": "assistant", "content": "", "tool_calls": [call("a", arguments=[1])]}], {},
     r"arguments must be a JSON object or a string, got list"),
    ("call_without_name", [{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}], {},
     r"messages\[0\]\.tool_calls\[0\]\.function\.name must be a non-empty string"),
    ("tool_calls_not_list", [{"role": "assistant", "content": "", "tool_calls": "f()"}], {}, r"tool_calls must be a list"),
    ("effort_invalid", [{"role": "user", "content": "x"}], {"thinking_effort": "extreme"}, r"thinking_effort: invalid value 'extreme'"),
    ("effort_none_string", [{"role": "user", "content": "x"}], {"thinking_effort": "none"}, r"thinking_effort: invalid value 'none'"),
    ("effort_invalid_non_thinking", [{"role": "user", "content": "x"}], {"thinking": False, "thinking_effort": "MAX"}, r"invalid value 'MAX'"),
    ("tool_choice_invalid", [{"role": "user", "content": "x"}], {"tool_choice": "always"}, r"tool_choice: invalid value 'always'"),
    ("response_format_invalid", [{"role": "user", "content": "x"}], {"response_format": {"type": "yaml"}}, r"response_format\.type: invalid value 'yaml'"),
    ("json_schema_missing", [{"role": "user", "content": "x"}], {"response_format": {"type": "json_schema"}}, r"response_format\.json_schema must be an object"),
    ("content_wrong_type", [{"role": "user", "content": 42}], {}, r"messages\[0\]\.content must be a string, a list of parts or null"),
    ("content_part_unknown", [{"role": "user", "content": [{"type": "video_url", "video_url": "v"}]}], {},
     r"messages\[0\]\.content\[0\]: unsupported content part type 'video_url'"),
    ("content_part_not_object", [{"role": "user", "content": ["text"]}], {}, r"content\[0\] must be an object"),
    ("reasoning_not_string", [{"role": "assistant", "content": "", "reasoning_content": ["x"]}], {}, r"reasoning_content must be a string"),
    ("too_few_image_prompts", [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], {"image_prompts": ["<p>"]},
     r"more images than image_prompts \(1\)"),
    ("too_many_image_prompts", [{"role": "user", "content": "no image"}], {"image_prompts": ["<p>"]}, r"1 image_prompts given but 0 images"),
    ("tools_not_list", [{"role": "user", "content": "x"}], {"tools": {"name": "f"}}, r"tools must be a list"),
    ("tools_not_json", [{"role": "user", "content": "x"}], {"tools": [{"f": object()}]}, r"tools is not JSON-serialisable"),
    ("arg_value_not_json", [{"role": "assistant", "content": "", "tool_calls": [call("a", arguments={"x": object()})]}], {},
     r"is not a JSON value"),
]


@pytest.mark.parametrize("messages,kwargs,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_chat_format_error(messages, kwargs, match) -> None:
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    with pytest.raises(ChatFormatError, match=match):
        render_text(messages, tools, **kwargs)


def test_chat_format_error_is_value_error() -> None:
    assert issubclass(ChatFormatError, ValueError)


def test_documented_fallbacks_do_not_raise() -> None:
    # non-JSON argument string -> json block; empty / null / missing arguments -> empty call;
    # tool_choice auto / named -> no message; response_format text -> no message
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call("a", arguments="not json"), call("b", "g", arguments=None)]},
            {"role": "tool", "tool_call_id": "b", "content": "r"}, {"role": "tool", "tool_call_id": "a", "content": "r"}]
    text = render_text(msgs, tool_choice={"type": "function", "function": {"name": "f"}}, response_format={"type": "text"})
    assert '<|open|>json type="object"<|sep|>not json<|close|>json<|sep|>' in text
    assert "tool-choice" not in text and "response-format" not in text
    assert render_text(msgs, tool_choice="auto", response_format="text") == render_text(msgs)


def test_positional_names_with_explicit_tool_name() -> None:
    # a run that cannot be fully matched by id keeps its order; an explicit name wins over position
    msgs = [ASSISTANT, {"role": "tool", "name": "custom", "content": "1"}, {"role": "tool", "content": "2"}]
    text = render_text(msgs, thinking_effort=None)
    assert 'role="tool" tool="custom" index="1"' in text and 'role="tool" tool="g" index="2"' in text
