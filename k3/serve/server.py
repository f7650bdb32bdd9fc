"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (+ GET by id;
k3.serve.responses_api), POST /v1/messages (Anthropic; k3.serve.anthropic_api), GET /v1/models[/{id}],
GET /health, GET /metrics; HEAD on every route. Bodies are parsed and validated by hand (k3.serve.openai_types) so every malformed
request gets an OpenAI-shaped JSON error with a 4xx status; a client that disconnects has its
request aborted, which frees its cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from k3.chat import ChatFormatError, render_segments
from k3.chat.media import ChatMediaError, load_chat_media
from k3.chat.xtml import SegmentBuilder
from k3.media import MAX_IMAGE_BYTES
from k3.serve import anthropic_api, responses_api
from k3.serve.async_engine import AsyncEngine, Overloaded
from k3.serve.chat_output import ChatAssembler, CompletionAssembler, merged_response, merged_usage
from k3.serve.metrics import prometheus_text
from k3.serve.openai_types import APIError, ChatRequest, CommonParams, parse_chat, parse_completion
from k3.serve.structured import GrammarCompiler, GrammarError, StructuredSpec

log = logging.getLogger("k3.serve")


@dataclass
class ServerConfig:
    """model_names: ids accepted in `model` (the first is listed first); default_max_tokens: used when
    a request gives none (capped by the context left); max_body_bytes: larger bodies get 413.
    max_image_bytes: per encoded image (or frame); allow_local_media: accept local file paths as
    image sources (vision models; see k3.chat.media). clamp_max_tokens: lower a `max_tokens` that does not
    fit the context left to what fits (reported in the `x-k3-max-tokens-clamped` header) instead of a 400.
    structured_outputs: enforce tool_choice required / named and JSON response formats by grammar
    (k3.serve.structured); structured_reserve_tokens: of such a request's max_tokens, this many (at most
    half) are kept for the constrained part: the think channel is closed when the rest is used up.
    strict_tools: also enforce tool_choice auto (or absent) when every tool is `strict` (such rows take no
    speculative drafts)."""

    model_names: tuple[str, ...] = ("k3",)
    default_max_tokens: int = 4096
    max_body_bytes: int = 16 << 20
    disconnect_poll_s: float = 0.2
    max_image_bytes: int = MAX_IMAGE_BYTES
    allow_local_media: bool = True
    clamp_max_tokens: bool = False
    structured_outputs: bool = True
    structured_reserve_tokens: int = 512
    strict_tools: bool = True


class _State:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, cfg: ServerConfig) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.vision = getattr(engine.engine, "vision", None)  # VisionConfig of a vision model, else None
        self.http_requests: dict[str, int] = {}
        self.started = int(time.time())
        self.grammar = GrammarCompiler(tokenizer)
        # no single token is longer than this many bytes: a cheap upper bound on prompt length
        self.max_token_bytes = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.base_size)) or 1

    def count(self, key: str) -> None:
        self.http_requests[key] = self.http_requests.get(key, 0) + 1


async def _head_ok() -> Response:
    return Response(status_code=200, headers={"allow": "POST, HEAD"})


def build_app(engine: AsyncEngine, tokenizer: Any, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan."""
    from contextlib import asynccontextmanager

    cfg = config or ServerConfig()
    st = _State(engine, tokenizer, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="k3 serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.k3 = st

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        st.count(f"status_{exc.status_code}")
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        st.count("status_500")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": st.started, "owned_by": "k3",
                "max_model_len": engine.engine.max_model_len}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in cfg.model_names]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str) -> Response:
        try:
            _check_model(st, model_id)
        except APIError as e:
            st.count("status_404")
            return JSONResponse(e.body(), status_code=404)
        return JSONResponse(model_card(model_id))

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> PlainTextResponse:
        stats = engine.engine.stats()
        extra = {f"http_{k}": v for k, v in st.http_requests.items()}
        extra["http_aborted_requests"] = engine.aborted
        return PlainTextResponse(prometheus_text(stats, extra), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(st, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(st, request, chat=False)

    api = SimpleNamespace(start_chat=start_chat, drain=drain, error_response=error_response, read_json=_read_json)
    responses_api.add_routes(app, st, api)
    anthropic_api.add_routes(app, st, api)

    # HEAD on a POST endpoint: it exists (200, no body); clients and proxies probe routes this way
    for route in [r for r in app.routes if "POST" in getattr(r, "methods", ())]:
        app.add_api_route(route.path, _head_ok, methods=["HEAD"], include_in_schema=False)

    return app


# ------------------------------------------------------------------------------------------------ handlers


async def _read_json(st: _State, request: Request) -> Any:
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > st.cfg.max_body_bytes:
                raise APIError(413, f"request body larger than {st.cfg.max_body_bytes} bytes", code="body_too_large")
            chunks.append(part)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None


@dataclass
class _Prompt:
    """One prompt to sample from: ids (with any forced prefix), the forced prefix, the ids closing it,
    media tensors, and (completions with echo) its text."""

    ids: list[int]
    forced: list[int]
    close: list[int]
    media: list
    text: str = ""


class ChatRun:
    """A submitted chat-like request: its parsed form, one assembler and one stream per choice, and
    response headers. Built by `start_chat` for every API surface (chat, Responses, Messages)."""

    def __init__(self, req: Any, asms: list, streams: list, headers: dict[str, str], prompts: int) -> None:
        self.req, self.asms, self.streams, self.headers, self.prompts = req, asms, streams, headers, prompts

    def close(self) -> None:
        for s in self.streams:
            s.close()


async def start_chat(st: _State, body: Any, *, chat: bool = True) -> ChatRun:
    """Validate, render, tokenize and submit an OpenAI chat (or completions) body. Raises APIError
    (4xx), Overloaded or ValueError; nothing stays submitted when it raises."""
    streams: list = []
    try:
        vocab = st.engine.engine.vocab_limit
        req = parse_chat(body, vocab, vision=st.vision is not None) if chat else parse_completion(body, vocab)
        common: CommonParams = req.common
        _check_model(st, common.model)
        prompts = await asyncio.to_thread(_tokenize, st, req, chat)
        headers: dict[str, str] = {}
        for p in prompts:
            max_tokens = _max_tokens(st, common, len(p.ids), headers)
            params = common.sampling(max_tokens, req.logprobs)
            constraint = await _constraint(st, req, max_tokens) if chat else None
            streams += st.engine.submit_n(p.ids, params, common.n, media=p.media or None, constraint=constraint)
    except BaseException:
        for s_ in streams:
            s_.close()
        raise
    headers["x-request-id"] = streams[0].request_id
    return ChatRun(req, _assemblers(st, req, prompts, chat), streams, headers, len(prompts))


def error_response(st: _State, e: Exception, shape: Callable[[APIError], dict] = APIError.body) -> JSONResponse:
    """The JSON error reply for what `start_chat` raises (shape: the API's error body)."""
    if isinstance(e, Overloaded):
        e = APIError(503, f"server overloaded: {e}", code="overloaded")
    elif not isinstance(e, APIError):
        e = APIError(400, str(e), code="invalid_value")
    st.count(f"status_{e.status}")
    return JSONResponse(shape(e), status_code=e.status)


async def _handle(st: _State, request: Request, *, chat: bool) -> Response:
    try:
        run = await start_chat(st, await _read_json(st, request), chat=chat)
    except (APIError, Overloaded, ValueError) as e:
        return error_response(st, e)
    st.count("status_200")
    common, headers = run.req.common, run.headers
    if common.stream:
        headers["cache-control"] = "no-cache"
        return StreamingResponse(_sse(run.asms, run.streams, common.include_usage, run.prompts),
                                 media_type="text/event-stream", headers=headers)
    return await _collect(st, request, run.asms, run.streams, "chat.completion" if chat else "text_completion",
                          run.prompts, headers)


async def _constraint(st: _State, req: ChatRequest, max_tokens: int) -> Any:
    """A grammar-constraint factory for tool_choice required / named, JSON response formats and tool_choice
    auto (or absent) when every tool is `strict`, else None. Thinking may use all but
    `structured_reserve_tokens` (at most half) of the budget when the output must reach a constrained part."""
    tools = req.tools or []
    strict = st.cfg.strict_tools and bool(tools) and all(t["function"].get("strict") is True for t in tools)
    choice = req.tool_choice if req.tool_choice == "required" else (
        "auto" if strict and req.tool_choice in (None, "auto") and req.named_tool is None else None)
    spec = StructuredSpec(thinking=req.thinking, tools=tools, tool_choice=choice,
                          named_tool=req.named_tool, response_format=req.response_format,
                          parallel=req.parallel_tool_calls)
    if not spec.active or not st.cfg.structured_outputs:
        return None
    budget = max(0, max_tokens - min(st.cfg.structured_reserve_tokens, max_tokens // 2))
    try:
        return await asyncio.to_thread(st.grammar.compile, spec, budget)
    except GrammarError as e:
        param = "response_format" if spec.response_format and not (spec.tool_choice or spec.named_tool) else "tools"
        raise APIError(400, str(e), param=param, code="invalid_schema") from None


def _check_model(st: _State, model: str) -> None:
    if model not in st.cfg.model_names:
        raise APIError(404, f"model {model!r} not found; available: {', '.join(st.cfg.model_names)}",
                       param="model", code="model_not_found")


def _assemblers(st: _State, req: Any, prompts: list[_Prompt], chat: bool) -> list:
    """One assembler per choice (prompt-major, then sample), sharing the response id."""
    common, n = req.common, req.common.n
    rid, created = (f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"), int(time.time())
    out: list = []
    for i, p in enumerate(prompts):
        for j in range(n):
            kw = dict(model=common.model, index=i * n + j, response_id=rid, created=created)
            if chat:
                out.append(ChatAssembler(st.tok, thinking=req.thinking, forced_prefix=p.forced,
                                         want_logprobs=req.logprobs is not None, close_ids=p.close,
                                         skip_special_tokens=common.skip_special_tokens, **kw))
            else:
                out.append(CompletionAssembler(st.tok, logprobs=req.logprobs, echo=p.text, **kw))
    return out


def _tokenize(st: _State, req: Any, chat: bool) -> list[_Prompt]:
    """The request's prompts as token ids. APIError(400)."""
    tok = st.tok
    limit = st.engine.engine.max_model_len
    try:
        if chat:
            return [_chat_prompt(st, req)]
        out = []
        for p in req.prompts:
            if isinstance(p, list):
                out.append(_Prompt(list(p), [], [], [], tok.decode(p) if req.echo else ""))
            else:
                _length_precheck(st, len(p.encode("utf-8", errors="replace")), limit)
                out.append(_Prompt(tok.encode(p, allow_special=True), [], [], [], p if req.echo else ""))
        return out
    except APIError:
        raise
    except ChatMediaError as e:
        raise APIError(400, f"invalid image: {e}", param=e.param, code="invalid_image") from None
    except (ChatFormatError, ValueError, TypeError, RecursionError) as e:
        raise APIError(400, f"cannot render the conversation: {str(e)[:500]}", code="invalid_messages") from None


def _length_precheck(st: _State, nbytes: int, limit: int) -> None:
    if nbytes > limit * st.max_token_bytes:
        raise APIError(400, f"the prompt is longer than the maximum context length of {limit} tokens",
                       param="messages", code="context_length_exceeded")


def _encode(st: _State, b: SegmentBuilder) -> list[int]:
    return [t for s in b.segments for t in st.tok.encode(s.text, allow_special=s.special)]


def _chat_prompt(st: _State, req: ChatRequest) -> _Prompt:
    messages, prompts, media = req.messages, None, []
    if st.vision is not None:
        cm = load_chat_media(req.messages, st.vision, max_bytes=st.cfg.max_image_bytes,
                             max_total_tokens=st.engine.engine.max_model_len, allow_local=st.cfg.allow_local_media)
        messages, prompts, media = cm.messages, cm.prompts, cm.media
    segs = render_segments(messages, req.tools, thinking=req.thinking,
                           thinking_effort=req.effort if req.thinking else None, add_generation_prompt=True,
                           tool_choice=req.tool_choice, response_format=req.response_format, image_prompts=prompts)
    _length_precheck(st, sum(len(s.text.encode("utf-8", errors="replace")) for s in segs),
                     st.engine.engine.max_model_len)
    ids = [t for s in segs for t in st.tok.encode(s.text, allow_special=s.special)]
    forced: list[int] = []
    close: list[int] = []
    if req.named_tool is not None:
        # named tool_choice: the prompt ends with the opening of that call, the model writes the arguments
        b = SegmentBuilder()
        if req.thinking:
            b.close_tag("think")
            b.open_tag("response")
        b.close_tag("response")
        b.open_tag("tools")
        b.open_tag("call", [("tool", req.named_tool), ("index", 1)])
        forced = _encode(st, b)
        b = SegmentBuilder()
        b.close_tag("call")
        b.close_tag("tools")
        close = _encode(st, b)
    return _Prompt(ids + forced, forced, close, media)


def _max_tokens(st: _State, common: CommonParams, prompt_len: int, headers: dict[str, str]) -> int:
    """The request's token budget; with `clamp_max_tokens`, a cap beyond the context left is lowered to
    fit (reported in the `x-k3-max-tokens-clamped: REQUESTED->USED` header) instead of a 400."""
    eng = st.engine.engine
    limit = eng.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the maximum context length is {limit} tokens",
                       param="messages", code="context_length_exceeded")
    room = eng.max_tokens_limit(prompt_len)
    mt = common.max_tokens if common.max_tokens is not None else min(st.cfg.default_max_tokens, room)
    if mt > room >= 1 and st.cfg.clamp_max_tokens:
        headers["x-k3-max-tokens-clamped"] = f"{mt}->{room}"
        mt = room
    if mt < 1 or mt > room:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({mt}) exceeds the maximum context length "
                       f"({min(limit, eng.max_tokens_limit(0))} tokens)", param="max_tokens",
                       code="context_length_exceeded")
    return mt


def _sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def merged_outputs(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, output) from several streams as they arrive; exceptions are re-raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: Any) -> None:
        try:
            async for out in s:
                await q.put((k, out))
        except Exception as e:  # handed to the consumer
            await q.put((k, e))
        await q.put((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


async def _sse(asms: list, streams: list, include_usage: bool, prompts: int) -> AsyncIterator[str]:
    try:
        for a in asms:
            first = a.first_chunk()
            if first is not None:
                yield _sse_line(first)
        async for k, out in merged_outputs(streams):
            if out.finish_reason == "error":
                yield _sse_line(APIError(500, f"generation failed: {out.error}").body())
                return
            for c in asms[k].stream_chunks(out):
                yield _sse_line(c)
        if include_usage and all(a.usage is not None for a in asms):
            chunk = asms[0].usage_chunk()
            chunk["usage"] = merged_usage(asms, prompts)
            yield _sse_line(chunk)
        yield "data: [DONE]\n\n"
    except (ValueError, RuntimeError) as e:
        yield _sse_line(APIError(500, f"generation failed: {e}").body())
    finally:
        for s in streams:
            s.close()  # client gone or done: abort what still runs (frees the cache)


async def drain(st: _State, request: Request, streams: list, on_output: Callable[[int, Any], None]
                ) -> JSONResponse | None:
    """Feed every output of `streams` to on_output(stream index, output) until all finish, aborting them
    if the client disconnects. Returns an error reply (generation failed: 500; client gone: 499) or None."""
    async def watch() -> None:
        while not all(s.done for s in streams):
            if await request.is_disconnected():
                for s in streams:
                    s.close()
                return
            await asyncio.sleep(st.cfg.disconnect_poll_s)

    watcher = asyncio.create_task(watch())
    finished = 0
    try:
        async for k, out in merged_outputs(streams):
            if out.finish_reason == "error":
                return JSONResponse(APIError(500, f"generation failed: {out.error}").body(), status_code=500)
            on_output(k, out)
            finished += out.finished
    except (ValueError, RuntimeError) as e:
        return JSONResponse(APIError(500, f"generation failed: {e}").body(), status_code=500)
    finally:
        watcher.cancel()
        for s in streams:
            s.close()
    if finished < len(streams):  # aborted because the client left: nobody reads this
        return JSONResponse(APIError(499, "client closed the request").body(), status_code=499)
    return None


async def _collect(st: _State, request: Request, asms: list, streams: list, obj: str, prompts: int,
                   headers: dict[str, str]) -> Response:
    err = await drain(st, request, streams, lambda k, out: asms[k].add(out))
    if err is not None:
        return err
    return JSONResponse(merged_response(asms, obj, prompts), headers=headers)
