"""Anthropic Messages API (`POST /v1/messages`) on the chat pipeline.

A request is translated into a chat request: `system` -> system message; content blocks `text`,
`thinking` (preserved reasoning), `tool_use` (assistant tool calls; `input` -> arguments JSON) and
`tool_result` (user turn -> tool messages); tools `{name, description, input_schema}`; tool_choice
auto / any (-> required) / tool (-> named) / none; `thinking.type` disabled -> non-thinking rendering
(K3 otherwise always thinks); `output_config` effort / json_schema format; `stop_sequences` (a match
is reported as stop_reason "stop_sequence"), `max_tokens`, sampling fields. The reply has
`thinking`, `text` and `tool_use` blocks and Anthropic stop reasons; streaming sends message_start,
content_block_start / _delta / _stop, message_delta and message_stop events. Errors use Anthropic's
`{"type": "error", "error": {"type", "message"}}` body.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3.serve.async_engine import Overloaded
from k3.serve.blocks import Block, BlockEvent, BlockTracker
from k3.serve.openai_types import APIError, bad

_STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
_ERROR_TYPE = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
               503: "overloaded_error"}


def error_body(e: APIError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPE.get(e.status, "api_error"), "message": e.message}}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content blocks", "invalid_type")
    out = []
    for k, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}[{k}]", "only text blocks are supported here", "unsupported_content")
        out.append(b["text"])
    return "".join(out)


def _turn(m: Any, i: int) -> list[dict]:
    """One Anthropic message -> chat messages (a user turn's tool_result blocks become tool messages)."""
    w = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(w, "must be an object with role 'user' or 'assistant'")
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise bad(f"{w}.content", "must be a string or a list of content blocks", "invalid_type")
    text, reasoning, calls, results = [], [], [], []
    for k, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and m["role"] == "assistant":
            reasoning.append(str(b.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                raise bad(f"{w}.content[{k}]", "a tool_use block needs string `id` and `name`")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and m["role"] == "user":
            c = b.get("content")
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text(c, f"{w}.content[{k}].content") if c is not None else ""})
        else:
            raise bad(f"{w}.content[{k}]", f"unsupported content block {kind!r} for role {m['role']!r}",
                      "unsupported_content")
    if m["role"] == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def chat_body(body: Any) -> dict:
    """An Anthropic Messages request -> an OpenAI chat body."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_body")
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required", "missing_required_parameter")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list")
    out_msgs = [x for i, m in enumerate(msgs) for x in _turn(m, i)]
    if body.get("system") is not None:
        out_msgs = [{"role": "system", "content": _text(body["system"], "system")}] + out_msgs
    out: dict[str, Any] = {"model": body.get("model"), "messages": out_msgs, "max_tokens": body["max_tokens"],
                           "stream": body.get("stream", False)}
    for k in ("temperature", "top_p", "top_k", "ignore_eos"):  # ignore_eos: k3 extension (benchmarks, tests)
        if body.get(k) is not None:
            out[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None and not isinstance(stops, list):
        raise bad("stop_sequences", "must be a list of strings", "invalid_type")
    if stops:
        out["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "must be a list of tool objects", "invalid_type")
        out["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                          "parameters": t.get("input_schema"),
                                                          "strict": t.get("strict")}}
                        for t in tools if t.get("type") in (None, "custom")]
    tc = body.get("tool_choice")
    if tc is not None and not isinstance(tc, dict):
        raise bad("tool_choice", "must be an object like {'type': 'auto' | 'any' | 'tool' | 'none'}", "invalid_type")
    if isinstance(tc, dict):
        kind = tc.get("type")
        if kind == "any":
            out["tool_choice"] = "required"
        elif kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
        elif kind in ("auto", "none"):
            out["tool_choice"] = kind
        else:
            raise bad("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
        if tc.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    out.update(_output_config(body))
    th = body.get("thinking")
    if th is not None and not isinstance(th, dict):
        raise bad("thinking", "must be an object like {'type': 'enabled' | 'disabled'}", "invalid_type")
    if isinstance(th, dict) and th.get("type") == "disabled":
        out["thinking"] = {"type": "disabled"}
    return out


_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}


def _output_config(body: dict) -> dict:
    """`output_config` {effort, format} (and the older top-level `output_format`) -> chat fields:
    reasoning_effort, and a json_schema response_format (grammar-enforced)."""
    oc = body.get("output_config")
    if oc is not None and not isinstance(oc, dict):
        raise bad("output_config", "must be an object", "invalid_type")
    oc = oc or {}
    out: dict[str, Any] = {}
    fmt, where = (oc.get("format"), "output_config.format") if oc.get("format") is not None else (
        body.get("output_format"), "output_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad(where, "must be {'type': 'json_schema', 'schema': {...}}")
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    effort = oc.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORT:
            raise bad("output_config.effort", f"must be one of {', '.join(_EFFORT)}, got {effort!r}")
        out["reasoning_effort"] = _EFFORT[effort]
    return out


def block_json(b: Block, done: bool) -> dict:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text if done else ""}
    inp: Any = {}
    if done:
        try:
            inp = json.loads(b.text or "{}")
        except json.JSONDecodeError:
            inp = {"_raw_arguments": b.text}  # model-produced garbage: keep it visible, never crash
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": inp}


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageBuilder:
    def __init__(self, model: str) -> None:
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.tracker = BlockTracker()
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None

    def usage_json(self) -> dict:
        u = self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def body(self, done: bool) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [block_json(b, True) for b in self.tracker.blocks] if done else [],
                "stop_reason": self.stop_reason() if done else None,
                "stop_sequence": self.stop_sequence if done else None, "usage": self.usage_json()}

    def stop_reason(self) -> str:
        if self.stop_sequence is not None and self.finish_reason == "stop":
            return "stop_sequence"
        return _STOP.get(self.finish_reason or "", "end_turn")

    def events(self, ev: BlockEvent) -> list[str]:
        b = ev.block
        if ev.what == "start":
            return [sse("content_block_start", {"index": ev.index, "content_block": block_json(b, False)})]
        if ev.what == "delta":
            delta = ({"type": "thinking_delta", "thinking": ev.text} if b.kind == "reasoning" else
                     {"type": "text_delta", "text": ev.text} if b.kind == "text" else
                     {"type": "input_json_delta", "partial_json": ev.text})
            return [sse("content_block_delta", {"index": ev.index, "delta": delta})]
        out = []
        if b.kind == "reasoning":
            out.append(sse("content_block_delta", {"index": ev.index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        return out + [sse("content_block_stop", {"index": ev.index})]


def add_routes(app: FastAPI, st: Any, api: Any) -> None:
    """api: the server's chat pipeline (`start_chat`, `drain`, `error_response`, `read_json`)."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            run = await api.start_chat(st, chat_body(await api.read_json(st, request)))
        except (APIError, Overloaded, ValueError) as e:
            return api.error_response(st, e, error_body)
        st.count("status_200")
        mb = MessageBuilder(run.req.common.model)
        asm = run.asms[0]

        def feed(out: Any) -> list[BlockEvent]:
            evs = [e for d in asm.deltas(out) for e in mb.tracker.feed(d)]
            if out.finished:
                evs += mb.tracker.finish()
                mb.usage, mb.finish_reason, mb.stop_sequence = asm.usage, asm.finish_reason, asm.stop_str
            return evs

        if run.req.common.stream:
            return StreamingResponse(_stream(mb, run, feed), media_type="text/event-stream", headers=run.headers)
        err = await api.drain(st, request, run.streams, lambda k, out: feed(out))
        if err is not None:
            return JSONResponse(error_body(APIError(err.status_code, json.loads(err.body)["error"]["message"])),
                                status_code=err.status_code)
        return JSONResponse(mb.body(True), headers=run.headers)


async def _stream(mb: MessageBuilder, run: Any, feed: Callable) -> AsyncIterator[str]:
    try:
        yield sse("message_start", {"message": mb.body(False)})
        async for out in run.streams[0]:
            if out.finish_reason == "error":
                yield sse("error", {"error": {"type": "api_error", "message": f"generation failed: {out.error}"}})
                return
            for ev in feed(out):
                for line in mb.events(ev):
                    yield line
        if mb.usage is not None:
            yield sse("message_delta", {"delta": {"stop_reason": mb.stop_reason(), "stop_sequence": mb.stop_sequence},
                                        "usage": mb.usage_json()})  # cumulative: the SDKs overwrite
            yield sse("message_stop", {})
    finally:
        run.close()
