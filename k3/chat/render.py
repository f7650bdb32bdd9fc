"""XTML renderer: OpenAI-style messages -> the exact prompt text / token ids K3 was trained on.

Prompt order: request-level tool declaration, thinking-effort message (thinking mode only), the
conversation, tool-choice message, response-format message, generation prompt. See
docs/chat.md and the spec (shared/spec/k3_chat_and_serving.md §2) for the grammar.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from k3.chat.errors import ChatFormatError
from k3.chat.xtml import IMAGE_PLACEHOLDER, Segment, SegmentBuilder

THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")

_TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_TOOL_DECLARE_DYNAMIC = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n```json\n{}\n```"
)
_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
_TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
_FORMAT_OBJECT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_FORMAT_SCHEMA = (
    "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON + "\n"
    "The JSON data must match the following schema:\n```json\n{}\n```"
)


# ----------------------------------------------------------------------------- JSON helpers


def deep_sort(obj: Any) -> Any:
    """Recursively sort dict keys (the official tool/schema normalisation)."""
    if isinstance(obj, dict):
        try:
            items = sorted(obj.items())
        except TypeError as e:
            raise ChatFormatError(f"JSON object keys must all be strings: {list(obj)!r}") from e
        return {k: deep_sort(v) for k, v in items}
    if isinstance(obj, (list, tuple)):
        return [deep_sort(v) for v in obj]
    return obj


def compact_sorted_json(obj: Any, what: str) -> str:
    """Compact (no spaces), key-sorted, non-ASCII kept: how tools and schemas are declared."""
    try:
        return json.dumps(deep_sort(obj), ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"{what} is not JSON-serialisable: {e}") from e


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ChatFormatError(f"tool-call argument value {value!r} is not a JSON value")


def _value_text(value: Any) -> str:
    # strings raw; everything else ordinary JSON with default ", " / ": " spacing, keys unsorted
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------- validation


def message_list(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatFormatError(f"messages must be a list of message objects, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    return list(messages)


def _call_function(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise ChatFormatError(f"{where} must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ChatFormatError(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where}.function.name must be a non-empty string")
    return fn


def _tool_calls(message: dict, i: int) -> list[dict]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, (list, tuple)):
        raise ChatFormatError(f"messages[{i}].tool_calls must be a list")
    for k, call in enumerate(calls):
        _call_function(call, f"messages[{i}].tool_calls[{k}]")
    return list(calls)


def parse_arguments(arguments: Any, where: str) -> tuple[dict, str | None]:
    """Normalise a call's arguments -> (argument dict, raw text for the json fallback or None).

    A string that is not valid JSON renders verbatim inside a `json` block (the official
    fallback); JSON that is not an object, or a non-string non-dict value, is an error.
    """
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        raise ChatFormatError(f"{where}.arguments must be a JSON object or a string, got {type(arguments).__name__}")
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ChatFormatError(f"{where}.arguments must encode a JSON object, got {type(parsed).__name__}")
    return parsed, None


# ----------------------------------------------------------------------------- tool results


def order_tool_results(messages: list[dict]) -> list[dict]:
    """Re-sort each run of tool results into call order by `tool_call_id` and validate them.

    Every result must match a call of the latest assistant message: by id, or (when some result
    of the run carries no id) by position. A fully id-matched run is sorted by call position and
    takes the called function's name; otherwise the run keeps its order.
    """
    out: list[dict] = []
    calls: list[dict] = []
    since_assistant = 0
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        if m["role"] != "tool":
            if m["role"] == "assistant":
                calls, since_assistant = _tool_calls(m, i), 0
            out.append(m)
            i += 1
            continue
        j = i
        while j < n and messages[j]["role"] == "tool":
            j += 1
        out.extend(_resolve_run(messages, i, j, calls, since_assistant))
        since_assistant += j - i
        i = j
    return out


def _resolve_run(messages: list[dict], lo: int, hi: int, calls: list[dict], before: int) -> list[dict]:
    if not calls:
        raise ChatFormatError(f"messages[{lo}]: tool result has no preceding assistant message with tool_calls")
    positions: dict[str, int] = {}
    for pos, call in enumerate(calls):
        if call.get("id") is not None:
            positions.setdefault(str(call["id"]), pos)
    run, all_matched = [], True
    for i in range(lo, hi):
        m = messages[i]
        call_id = m.get("tool_call_id", m.get("id"))
        if call_id is None:
            all_matched = False
        elif str(call_id) not in positions:
            raise ChatFormatError(
                f"messages[{i}].tool_call_id {call_id!r} matches no tool call of the preceding assistant "
                f"message (call ids: {list(positions)})"
            )
        run.append((positions.get(str(call_id)) if call_id is not None else None, i - lo, m))
    if before + len(run) > len(calls):
        raise ChatFormatError(
            f"messages[{lo}:{hi}]: {before + len(run)} tool results for {len(calls)} tool calls "
            "of the preceding assistant message"
        )
    if not all_matched:
        return [m for _, _, m in run]
    run.sort(key=lambda r: (r[0], r[1]))
    resolved = []
    for pos, _, m in run:
        m = dict(m)
        m["tool"] = _call_function(calls[pos], "tool call")["name"]
        m.pop("name", None)
        resolved.append(m)
    return resolved


# ----------------------------------------------------------------------------- content


class _Images:
    """Hands out image prompts in order; without prompts, images stay as the placeholder text."""

    def __init__(self, prompts: Sequence[str] | None):
        self.prompts = None if prompts is None else list(prompts)
        self.used = 0

    def next(self) -> str:
        if self.prompts is None:
            return IMAGE_PLACEHOLDER
        if self.used >= len(self.prompts):
            raise ChatFormatError(f"more images than image_prompts ({len(self.prompts)})")
        self.used += 1
        return self.prompts[self.used - 1]

    def check_consumed(self) -> None:
        if self.prompts is not None and self.used != len(self.prompts):
            raise ChatFormatError(f"{len(self.prompts)} image_prompts given but {self.used} images in the messages")


def _text(b: SegmentBuilder, text: str, images: _Images) -> None:
    if images.prompts is None or IMAGE_PLACEHOLDER not in text:
        b.text(text)
        return
    pieces = text.split(IMAGE_PLACEHOLDER)
    for k, piece in enumerate(pieces):
        b.text(piece)
        if k < len(pieces) - 1:
            b.control(images.next(), assistant=False)


def _content(b: SegmentBuilder, content: Any, images: _Images, where: str) -> None:
    if content is None:
        return
    if isinstance(content, str):
        _text(b, content, images)
        return
    if not isinstance(content, (list, tuple)):
        raise ChatFormatError(f"{where}.content must be a string, a list of parts or null")
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatFormatError(f"{where}.content[{k}] must be an object")
        if part.get("type") in ("image", "image_url"):
            b.control(images.next(), assistant=False)
        elif isinstance(part.get("text"), str):
            _text(b, part["text"], images)
        else:
            raise ChatFormatError(f"{where}.content[{k}]: unsupported content part type {part.get('type')!r}")


# ----------------------------------------------------------------------------- messages


def _plain_message(b: SegmentBuilder, m: dict, images: _Images, where: str) -> None:
    attrs = [("role", m["role"])]
    if m.get("name"):
        attrs.append(("name", m["name"]))
    b.open_tag("message", attrs)
    _content(b, m.get("content"), images, where)
    b.close_tag("message")
    b.end_of_msg()


def _internal_message(b: SegmentBuilder, kind: str, body: str) -> None:
    b.open_tag("message", [("role", "system"), ("type", kind)])
    b.text(body.strip())
    b.close_tag("message")
    b.end_of_msg()


def _tool_declare(b: SegmentBuilder, tools: Any, *, dynamic: bool) -> None:
    body = (_TOOL_DECLARE_DYNAMIC if dynamic else _TOOL_DECLARE).format(compact_sorted_json(tools, "tools"))
    b.open_tag("message", [("role", "system"), ("type", "tool-declare")])
    b.text(body)
    b.close_tag("message")
    b.end_of_msg()


def _tools_block(b: SegmentBuilder, calls: list[dict], images: _Images, where: str) -> None:
    b.open_tag("tools")
    for index, call in enumerate(calls, start=1):
        fn = _call_function(call, f"{where}.tool_calls[{index - 1}]")
        args, raw = parse_arguments(fn.get("arguments"), f"{where}.tool_calls[{index - 1}].function")
        b.open_tag("call", [("tool", fn["name"]), ("index", index)])
        if raw is not None:
            b.open_tag("json", [("type", "object")])
            _text(b, raw, images)
            b.close_tag("json")
        else:
            for key, value in args.items():
                b.open_tag("argument", [("key", key), ("type", _value_type(value))])
                _text(b, _value_text(value), images)
                b.close_tag("argument")
        b.close_tag("call")
    b.close_tag("tools")


def _reasoning(m: dict, where: str) -> str:
    value = m.get("reasoning_content") or m.get("reasoning")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChatFormatError(f"{where}.reasoning_content must be a string")
    return value if value.strip() else ""


def _assistant_message(b: SegmentBuilder, m: dict, images: _Images, thinking: bool, where: str) -> None:
    attrs = [("role", "assistant")]
    if m.get("name"):
        attrs.append(("name", m["name"]))
    b.open_tag("message", attrs)
    # the header up to and including the first channel's open tag is the generation prompt;
    # everything after it, through <|end_of_msg|>, is what the model produced
    if thinking:
        b.open_tag("think")
        b.assistant = True
        _text(b, _reasoning(m, where), images)
        b.close_tag("think")
        b.open_tag("response")
    else:
        b.open_tag("response")
        b.assistant = True
    _content(b, m.get("content"), images, where)
    b.close_tag("response")
    calls = m.get("tool_calls")
    if calls:
        _tools_block(b, list(calls), images, where)
    b.close_tag("message")
    b.end_of_msg()
    b.assistant = False


def _tool_message(b: SegmentBuilder, m: dict, index: int, calls: list[dict], images: _Images, where: str) -> None:
    name = m.get("tool")
    if name is None:
        name = m.get("name")
    if name is None:
        name = _call_function(calls[index - 1], "tool call")["name"]
    b.open_tag("message", [("role", "tool"), ("tool", name), ("index", index)])
    _content(b, m.get("content"), images, where)
    b.close_tag("message")
    b.end_of_msg()


# ----------------------------------------------------------------------------- options


def _check_options(thinking_effort: Any, tool_choice: Any, response_format: Any) -> tuple[str | None, Any]:
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ChatFormatError(
            f"thinking_effort: invalid value {thinking_effort!r} (expected one of {', '.join(THINKING_EFFORTS)} or None)"
        )
    if tool_choice is not None and not isinstance(tool_choice, dict) and tool_choice not in ("auto", "none", "required"):
        raise ChatFormatError(
            f"tool_choice: invalid value {tool_choice!r} (expected auto, none, required or a named choice)"
        )
    if response_format is None:
        return None, None
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in ("text", "json_object", "json_schema"):
        raise ChatFormatError(f"response_format.type: invalid value {kind!r} (expected text, json_object or json_schema)")
    if kind != "json_schema":
        return kind, None
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if not isinstance(spec, dict):
        raise ChatFormatError("response_format.json_schema must be an object for type json_schema")
    # {"name", "schema"} as OpenAI sends it; a bare schema is accepted as well
    return kind, spec.get("schema", spec.get("json_schema", spec))


# ----------------------------------------------------------------------------- entry points


def render_segments(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    add_generation_prompt: bool = False,
    tool_choice: str | dict | None = None,
    response_format: str | dict | None = None,
    image_prompts: Sequence[str] | None = None,
) -> list[Segment]:
    """Render a conversation to XTML segments (see `render_text` for the arguments).

    Raises ChatFormatError on malformed input.
    """
    msgs = order_tool_results(message_list(messages))
    fmt_kind, schema = _check_options(thinking_effort, tool_choice, response_format)
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ChatFormatError(f"tools must be a list, got {type(tools).__name__}")
    b, images = SegmentBuilder(), _Images(image_prompts)
    if tools:
        _tool_declare(b, tools, dynamic=False)
    if thinking and thinking_effort is not None:
        _internal_message(b, "thinking-effort", _EFFORT.format(thinking_effort))
    calls: list[dict] = []
    tool_index = 0
    for i, m in enumerate(msgs):
        where, role = f"messages[{i}]", m["role"]
        if role == "assistant":
            calls, tool_index = list(m.get("tool_calls") or []), 0
            _assistant_message(b, m, images, thinking, where)
        elif role == "tool":
            tool_index += 1
            _tool_message(b, m, tool_index, calls, images, where)
        elif role == "system" and m.get("tools"):
            _tool_declare(b, m["tools"], dynamic=True)  # its content is ignored
        else:
            _plain_message(b, m, images, where)
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE:
        _internal_message(b, "tool-choice", _TOOL_CHOICE[tool_choice])
    if fmt_kind == "json_object":
        _internal_message(b, "response-format", _FORMAT_OBJECT)
    elif fmt_kind == "json_schema":
        _internal_message(b, "response-format", _FORMAT_SCHEMA.format(compact_sorted_json(schema, "response_format schema")))
    if add_generation_prompt:
        b.open_tag("message", [("role", "assistant")])
        b.open_tag("think" if thinking else "response")
    images.check_consumed()
    return b.segments


def render_text(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    add_generation_prompt: bool = False,
    tool_choice: str | dict | None = None,
    response_format: str | dict | None = None,
    image_prompts: Sequence[str] | None = None,
) -> str:
    """Render a conversation to the exact XTML prompt text (special tokens written as text).

    messages: OpenAI-style dicts with role system/user/assistant/tool. Assistant messages may
        carry `reasoning_content` (or `reasoning`), `content` (string, parts or null) and
        `tool_calls`; tool messages `tool_call_id`; a system message carrying `tools` declares
        tools mid-session (its content is ignored).
    tools: request-level tool list, declared first as compact key-sorted JSON.
    thinking: thinking mode (think channel on every assistant turn) or non-thinking mode.
    thinking_effort: low/medium/high/max, or None for no effort message (thinking mode only).
    add_generation_prompt: end with the opening of an assistant turn.
    tool_choice: "required"/"none" add a tool-choice message; "auto" or a named choice add none.
    response_format: "json_object"/"json_schema" (or the OpenAI dict) add a response-format message.
    image_prompts: media-token text replacing each image part / placeholder in order; without
        it images render as `<|kimi_image_placeholder|>` for the image processor to expand.
    """
    return "".join(
        s.text
        for s in render_segments(
            messages,
            tools,
            thinking=thinking,
            thinking_effort=thinking_effort,
            add_generation_prompt=add_generation_prompt,
            tool_choice=tool_choice,
            response_format=response_format,
            image_prompts=image_prompts,
        )
    )


def render(
    messages: Sequence[dict], tokenizer: Any, tools: Sequence[dict] | None = None, **kwargs: Any
) -> tuple[list[int], list[int]]:
    """Render and tokenize a conversation -> (token_ids, loss_mask), both of length T.

    loss_mask[t] is 1 exactly for tokens the assistant produced (each assistant turn after its
    generation prompt, through its <|end_of_msg|>), else 0. Each segment is encoded on its own,
    control segments with special tokens allowed, all other text with specials disallowed.
    kwargs: the keyword options of `render_text`.
    """
    ids: list[int] = []
    mask: list[int] = []
    for seg in render_segments(messages, tools, **kwargs):
        piece = tokenizer.encode(seg.text, allow_special=seg.special)
        ids.extend(piece)
        mask.extend([int(seg.assistant)] * len(piece))
    return ids, mask
