"""OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) on the chat pipeline.

A request is translated into a chat request (instructions -> system message; input items: messages,
`function_call`, `function_call_output`, `reasoning` -> chat messages with tool calls, tool results
and preserved reasoning; flat function tools; `text.format` -> response_format; `reasoning.effort`;
`max_output_tokens`) and runs through `start_chat`. Output items are reasoning, message and
function_call items built from the chat deltas (`k3.serve.blocks`); streaming sends the typed
`response.*` events. Stored responses (bounded, in memory) carry their whole conversation, so
`previous_response_id` continues it; the rendered prompt then extends the previous one and its
prefix comes from the prefix cache.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3.serve.async_engine import Overloaded
from k3.serve.blocks import Block, BlockEvent, BlockTracker
from k3.serve.openai_types import APIError, bad

MAX_STORED = 1024
_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or a list of content parts", "invalid_type")
    out = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise bad(f"{where}.content[{k}]", "only input_text / output_text parts are supported",
                      "unsupported_content")
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{k}].text", "must be a string", "invalid_type")
        out.append(part["text"])
    return "".join(out)


def _reasoning_text(item: dict, where: str) -> str:
    """The text of a `reasoning` input item: its `content` then `summary` parts ({type, text} objects)."""
    out = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad(f"{where}.{key}", "must be a list of {type, text} parts", "invalid_type")
        for k, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise bad(f"{where}.{key}[{k}]", "must be an object with a string `text`", "invalid_type")
            out.append(part.get("text", ""))
    return "".join(out)


def input_messages(items: Any) -> list[dict]:
    """Responses input (a string or a list of items) -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad("input", "must be a string or a list of input items", "invalid_type")
    msgs: list[dict] = []

    def assistant() -> dict:
        if not msgs or msgs[-1]["role"] != "assistant":
            msgs.append({"role": "assistant", "content": ""})
        return msgs[-1]

    for i, it in enumerate(items):
        w = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(w, "must be an object", "invalid_type")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{w}.role", f"unknown role {role!r}")
            text = _text_of(it.get("content"), w)
            if role == "assistant":
                assistant()["content"] += text
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            a = assistant()
            a["reasoning_content"] = a.get("reasoning_content", "") + _reasoning_text(it, w)
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise bad(w, "a function_call needs string `name` and `call_id`")
            assistant().setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function",
                 "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            out = it.get("output")
            if not isinstance(it.get("call_id"), str):
                raise bad(f"{w}.call_id", "must be a string", "invalid_type")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else json.dumps(out, ensure_ascii=False)})
        else:
            raise bad(f"{w}.type", f"input items of type {kind!r} are not supported", "unsupported_content")
    return msgs


def _object(body: dict, name: str) -> dict:
    """An optional object-valued field ({} when absent)."""
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise bad(name, "must be an object", "invalid_type")
    return v or {}


def chat_body(body: Any, history: list[dict]) -> tuple[dict, list[dict]]:
    """A Responses request -> (an OpenAI chat body, the conversation to store with the response).
    history: the previous response's conversation. `instructions` lead the chat messages but are not
    part of the stored conversation (OpenAI: they do not carry over through previous_response_id)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_body")
    convo = list(history) + input_messages(body.get("input"))
    msgs = convo
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise bad("instructions", "must be a string", "invalid_type")
        msgs = [{"role": "system", "content": body["instructions"]}] + convo
    out: dict[str, Any] = {"model": body.get("model"), "messages": msgs, "stream": body.get("stream", False)}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("seed", "seed"), ("ignore_eos", "ignore_eos")):
        if body.get(src) is not None:
            out[dst] = body[src]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list", "invalid_type")
        out["tools"] = [{"type": "function", "function": {k: t.get(k) for k in ("name", "description", "parameters", "strict")
                                                          if t.get(k) is not None}}
                        for t in tools if isinstance(t, dict) and t.get("type", "function") == "function"]
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    elif tc is not None:
        out["tool_choice"] = tc
    fmt = _object(body, "text").get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")):
        raise bad("text.format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"), "strict": fmt.get("strict", False)}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    effort = _object(body, "reasoning").get("effort")
    if effort == "none":
        out["thinking"] = {"type": "disabled"}
    elif effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORT:
            raise bad("reasoning.effort", f"must be one of {', '.join(_EFFORT)} or none, got {effort!r}")
        out["reasoning_effort"] = _EFFORT[effort]
    return out, convo


def output_item(b: Block, done: bool) -> dict:
    status = "completed" if done else "in_progress"
    if b.kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{id(b):x}", "summary": [],
                "content": [{"type": "reasoning_text", "text": b.text if done else ""}], "status": status}
    if b.kind == "text":
        return {"type": "message", "id": f"msg_{id(b):x}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": b.text, "annotations": []}] if done else []}
    return {"type": "function_call", "id": f"fc_{id(b):x}", "call_id": b.call_id, "name": b.name,
            "arguments": b.text if done else "", "status": status}


class ResponseBuilder:
    """Accumulates one response: its output blocks, and the stream of `response.*` events."""

    def __init__(self, model: str, previous: str | None) -> None:
        self.id, self.model, self.previous = f"resp_{uuid.uuid4().hex}", model, previous
        self.created = int(time.time())
        self.tracker = BlockTracker()
        self.seq = 0
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **data})}\n\n"

    def body(self, status: str) -> dict:
        u = self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
        incomplete = status == "completed" and self.finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": "incomplete" if incomplete else status, "previous_response_id": self.previous,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
                "output": [output_item(b, True) for b in self.tracker.blocks] if status != "in_progress" else [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                          "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                          "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    def events(self, ev: BlockEvent) -> list[str]:
        b, i = ev.block, ev.index
        item_id = output_item(b, False)["id"]
        if ev.what == "start":
            out = [self.event("response.output_item.added", output_index=i, item=output_item(b, False))]
            if b.kind == "text":
                out.append(self.event("response.content_part.added", item_id=item_id, output_index=i,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            return out
        if ev.what == "delta":
            kind = {"text": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                    "tool_call": "response.function_call_arguments.delta"}[b.kind]
            extra = {"content_index": 0} if b.kind != "tool_call" else {}
            return [self.event(kind, item_id=item_id, output_index=i, delta=ev.text, **extra)]
        out = []
        if b.kind == "text":
            out += [self.event("response.output_text.done", item_id=item_id, output_index=i, content_index=0,
                               text=b.text),
                    self.event("response.content_part.done", item_id=item_id, output_index=i, content_index=0,
                               part={"type": "output_text", "text": b.text, "annotations": []})]
        elif b.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item_id, output_index=i, content_index=0,
                                  text=b.text))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item_id, output_index=i,
                                  arguments=b.text))
        return out + [self.event("response.output_item.done", output_index=i, item=output_item(b, True))]

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The request's chat messages plus this response as an assistant message (for previous_response_id)."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for b in self.tracker.blocks:
            if b.kind == "reasoning":
                msg["reasoning_content"] = msg.get("reasoning_content", "") + b.text
            elif b.kind == "text":
                msg["content"] += b.text
            else:
                msg.setdefault("tool_calls", []).append(
                    {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}})
        return messages + [msg]


def add_routes(app: FastAPI, st: Any, api: Any) -> None:
    """api: the server's chat pipeline (`start_chat`, `drain`, `error_response`, `read_json`)."""
    stored: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def remember(rb: ResponseBuilder, messages: list[dict], store: bool) -> None:
        if store:
            stored[rb.id] = (rb.body("completed"), rb.conversation(messages))
            while len(stored) > MAX_STORED:
                stored.popitem(last=False)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "HEAD"])
    async def get_response(response_id: str) -> Response:
        if response_id not in stored:
            return JSONResponse(APIError(404, f"response {response_id!r} not found", code="not_found").body(), 404)
        return JSONResponse(stored[response_id][0])

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        try:
            body = await api.read_json(st, request)
            prev = body.get("previous_response_id") if isinstance(body, dict) else None
            if prev is not None and not isinstance(prev, str):
                raise bad("previous_response_id", "must be a string", "invalid_type")
            if isinstance(body, dict) and body.get("store") is not None and not isinstance(body["store"], bool):
                raise bad("store", "must be a boolean", "invalid_type")
            if prev is not None and prev not in stored:
                raise bad("previous_response_id", f"response {prev!r} not found (not stored or evicted)",
                          "previous_response_not_found")
            cb, messages = chat_body(body, stored[prev][1] if prev else [])
            run = await api.start_chat(st, cb)
        except (APIError, Overloaded, ValueError) as e:
            return api.error_response(st, e)
        st.count("status_200")
        rb = ResponseBuilder(run.req.common.model, prev)
        asm, store = run.asms[0], body.get("store", True) is not False

        def feed(out: Any) -> list[BlockEvent]:
            evs = [e for d in asm.deltas(out) for e in rb.tracker.feed(d)]
            if out.finished:
                evs += rb.tracker.finish()
                rb.usage, rb.finish_reason = asm.usage, asm.finish_reason
            return evs

        if run.req.common.stream:
            return StreamingResponse(_stream(rb, run, feed, lambda: remember(rb, messages, store)),
                                     media_type="text/event-stream", headers=run.headers)
        err = await api.drain(st, request, run.streams, lambda k, out: feed(out))
        if err is not None:
            return err
        remember(rb, messages, store)
        return JSONResponse(rb.body("completed"), headers=run.headers)


async def _stream(rb: ResponseBuilder, run: Any, feed: Callable, done: Callable[[], None]) -> AsyncIterator[str]:
    try:
        yield rb.event("response.created", response=rb.body("in_progress"))
        yield rb.event("response.in_progress", response=rb.body("in_progress"))
        async for out in run.streams[0]:
            if out.finish_reason == "error":
                yield rb.event("response.failed", response={**rb.body("failed"),
                                                            "error": {"code": "server_error", "message": out.error}})
                return
            for ev in feed(out):
                for line in rb.events(ev):
                    yield line
        if rb.usage is not None:
            done()
            yield rb.event("response.completed", response=rb.body("completed"))
    finally:
        run.close()
