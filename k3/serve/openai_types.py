"""OpenAI-compatible request validation and response shapes.

Requests are plain JSON objects validated field by field; every problem raises `APIError` with the
HTTP status, a message naming the field, and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Unknown fields are ignored (clients such as
kimi-cli and kimi-code send Moonshot extensions: `thinking`, `prompt_cache_key`, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from k3.model.sampling import MAX_LOGPROBS, SamplingParams

MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 100_000
MAX_N = 128
MAX_LOGIT_BIAS = 1024
EFFORTS = ("low", "medium", "high", "max")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        default = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or {404: "not_found_error", 503: "server_overloaded"}.get(status, default)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


# ---------------------------------------------------------------------------------------------- field readers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {type(v).__name__}", "invalid_type")
    return v


def get_int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {type(v).__name__}", "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise bad(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def get_num(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(name, f"must be a finite number, got {type(v).__name__}", "invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def get_str(body: dict, name: str, *, required: bool = False) -> str | None:
    v = body.get(name)
    if v is None:
        if required:
            raise bad(name, "is required", "missing_required_parameter")
        return None
    if not isinstance(v, str):
        raise bad(name, f"must be a string, got {type(v).__name__}", "invalid_type")
    return v


def get_stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > MAX_STOP or any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in items):
        raise bad("stop", f"must be a string or a list of at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} "
                  "characters")
    return tuple(items)


def get_stop_ids(body: dict, vocab: int) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > 64 or any(not _is_int(t) or not 0 <= t < vocab for t in v):
        raise bad("stop_token_ids", f"must be a list of at most 64 token ids in [0, {vocab})")
    return tuple(v)


def get_logit_bias(body: dict, vocab: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} {{token id: bias}} entries")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"keys must be token ids, got {k!r}") from None
        if not 0 <= t < vocab:
            raise bad("logit_bias", f"token id {t} is not in [0, {vocab})")
        if not _is_num(b) or not -100 <= b <= 100:
            raise bad("logit_bias", f"bias of token {t} must be a number in [-100, 100]")
        out[t] = float(b)
    return out


@dataclass
class CommonParams:
    """Fields shared by chat and completions."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=max_tokens,
                              seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias,
                              min_tokens=min(self.min_tokens, max_tokens),
                              skip_special_tokens=self.skip_special_tokens)


def parse_common(body: Any, vocab: int) -> CommonParams:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
    model = get_str(body, "model", required=True)
    n = get_int(body, "n", 1, MAX_N) or 1
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options", "must be an object", "invalid_type")
    include_usage = get_bool(so or {}, "include_usage", False)
    mct = get_int(body, "max_completion_tokens", 1)
    mt = get_int(body, "max_tokens", 1)
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise bad("top_k", "must be an integer >= 0 (or -1 for off)")
    temperature = get_num(body, "temperature", 0.0, 2.0)
    return CommonParams(
        model=model, stream=get_bool(body, "stream", False), include_usage=include_usage,
        max_tokens=mct if mct is not None else mt,
        temperature=1.0 if temperature is None else temperature,
        top_p=get_num(body, "top_p", 0.0, 1.0, lo_open=True) or 1.0, top_k=top_k or 0,
        seed=get_int(body, "seed", -(2**63), 2**64), stop=get_stop(body), stop_token_ids=get_stop_ids(body, vocab),
        ignore_eos=get_bool(body, "ignore_eos", False), n=n,
        presence_penalty=get_num(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=get_num(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        logit_bias=get_logit_bias(body, vocab), min_tokens=get_int(body, "min_tokens", 0) or 0,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
    )


# ---------------------------------------------------------------------------------------------- chat


@dataclass
class ChatRequest:
    common: CommonParams
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str | dict | None
    named_tool: str | None
    thinking: bool
    effort: str
    response_format: Any
    logprobs: int | None  # None = off, else top_logprobs count
    parallel_tool_calls: bool = True


MEDIA_PARTS = ("image_url", "image", "video_url", "video")


def _media_part(part: dict, w: str) -> None:
    """Shape check of an image/video part; its source is loaded (and judged) by k3.chat.media."""
    kind = part["type"]
    if kind in ("image_url", "video_url"):
        v = part.get(kind)
        url = v.get("url") if isinstance(v, dict) else v
        if not isinstance(url, str) or not url:
            raise bad(f"{w}.{kind}", "must be an object {'url': string} with a data: URI or a local file path")
    elif kind == "image" and not isinstance(part.get("image"), str):
        raise bad(f"{w}.image", "must be a string (a data: URI or a local file path)")
    elif kind == "video":
        v = part.get("video")
        if not (isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(f, str) for f in v))):
            raise bad(f"{w}.video", "must be a string or a non-empty list of frame strings (data: URIs or paths)")


def _content(v: Any, where: str, vision: bool = False) -> Any:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(f"{where}.content", "must be a string, a list of content parts or null", "invalid_type")
    for k, part in enumerate(v):
        w = f"{where}.content[{k}]"
        if not isinstance(part, dict):
            raise bad(w, "must be an object", "invalid_type")
        kind = part.get("type")
        if kind in MEDIA_PARTS and vision:
            _media_part(part, w)
            continue
        if kind in MEDIA_PARTS or kind == "input_audio":
            what = "this model has no vision encoder" if kind in MEDIA_PARTS else "audio input is not supported"
            raise bad(w, f"content parts of type {kind!r} are not supported by this text-only server ({what})",
                      "unsupported_content")
        if kind not in (None, "text") or not isinstance(part.get("text"), str):
            raise bad(w, "must be a text part {type: 'text', text: string}")
    return v


def _tool_calls(v: Any, where: str) -> list[dict]:
    if not isinstance(v, list):
        raise bad(f"{where}.tool_calls", "must be a list", "invalid_type")
    out = []
    for k, call in enumerate(v):
        w = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad(w, "must be an object with a `function` object")
        fn = call["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{w}.function.name", "must be a non-empty string")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise bad(f"{w}.function.arguments", "must be a JSON string or an object", "invalid_type")
        cid = call.get("id")
        if cid is not None and not isinstance(cid, str):
            raise bad(f"{w}.id", "must be a string", "invalid_type")
        out.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _tools(v: Any, where: str) -> list[dict] | None:
    """Function tools (builtin `$...` / non-function tools are ignored)."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(where, "must be a list", "invalid_type")
    out = []
    for k, tool in enumerate(v):
        w = f"{where}[{k}]"
        if not isinstance(tool, dict):
            raise bad(w, "must be an object", "invalid_type")
        if tool.get("type", "function") != "function":
            continue
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{w}.function", "must be an object with a non-empty string `name`")
        if fn["name"].startswith("$"):
            continue
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"{w}.function.parameters", "must be a JSON Schema object", "invalid_type")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{w}.function.description", "must be a string", "invalid_type")
        out.append({"type": "function", "function": fn})
    return out


def _message(m: Any, i: int, vision: bool = False) -> dict:
    w = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(w, "must be an object", "invalid_type")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{w}.role", f"unknown role {role!r} (expected system, developer, user, assistant or tool)")
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), w, vision)}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad(f"{w}.name", "must be a string", "invalid_type")
        out["name"] = name
    if role == "assistant":
        for key in ("reasoning_content", "reasoning"):
            val = m.get(key)
            if val is not None and not isinstance(val, str):
                raise bad(f"{w}.{key}", "must be a string", "invalid_type")
        reasoning = m.get("reasoning_content") if m.get("reasoning_content") is not None else m.get("reasoning")
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if m.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(m["tool_calls"], w)
    elif role == "tool":
        cid = m.get("tool_call_id")
        if cid is not None and not isinstance(cid, str):
            raise bad(f"{w}.tool_call_id", "must be a string", "invalid_type")
        if cid is not None:
            out["tool_call_id"] = cid
    elif role == "system" and m.get("tools") is not None:
        tools = _tools(m["tools"], f"{w}.tools")
        if tools:
            out["tools"] = tools
    elif m.get("tools") is not None:
        _tools(m["tools"], f"{w}.tools")  # validated, but only system messages declare tools
    return out


def _thinking_mode(body: dict) -> tuple[bool, str | None]:
    """(thinking on?, effort from `thinking`) from `thinking` / `chat_template_kwargs`."""
    thinking, effort = True, None
    t = body.get("thinking")
    if t is not None:
        if isinstance(t, bool):
            thinking = t
        elif isinstance(t, dict):
            kind = t.get("type")
            if kind not in (None, "enabled", "disabled", "auto"):
                raise bad("thinking.type", f"must be 'enabled' or 'disabled', got {kind!r}")
            thinking = kind != "disabled"
            if t.get("effort") is not None:
                effort = t["effort"]
                if effort not in EFFORTS:
                    raise bad("thinking.effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
        else:
            raise bad("thinking", "must be an object like {'type': 'enabled'}", "invalid_type")
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("chat_template_kwargs", "must be an object", "invalid_type")
        for key in ("thinking", "enable_thinking"):
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise bad(f"chat_template_kwargs.{key}", "must be a boolean", "invalid_type")
                thinking = kw[key]
    return thinking, effort


def parse_chat(body: Any, vocab: int, *, vision: bool = False) -> ChatRequest:
    """Validate a chat request. vision: the model can take image/video content parts."""
    common = parse_common(body, vocab)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of message objects")
    if len(msgs) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages")
    messages = [_message(m, i, vision) for i, m in enumerate(msgs)]
    tools = _tools(body.get("tools"), "tools") or None
    tc = body.get("tool_choice")
    named = None
    if isinstance(tc, dict):
        fn = tc.get("function")
        if tc.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("tool_choice", "a named choice must be {'type': 'function', 'function': {'name': ...}}")
        named = fn["name"]
        if not tools or named not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice", f"names tool {named!r}, which is not in `tools`")
    elif tc is not None and tc not in ("auto", "none", "required"):
        raise bad("tool_choice", f"must be 'auto', 'none', 'required' or a named function, got {tc!r}")
    if tc == "required" and not tools:
        raise bad("tool_choice", "'required' needs a non-empty `tools` list")
    thinking, effort = _thinking_mode(body)
    re_ = body.get("reasoning_effort")
    if re_ is not None:
        if re_ not in EFFORTS:
            raise bad("reasoning_effort", f"must be one of low, high, max (or medium), got {re_!r}")
        effort = re_
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
        if rf["type"] == "json_schema" and not isinstance(rf.get("json_schema"), dict):
            raise bad("response_format.json_schema", "must be an object")
    lp = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not lp:
        raise bad("top_logprobs", "needs logprobs = true")
    return ChatRequest(common=common, messages=messages, tools=tools,
                       tool_choice=tc if isinstance(tc, str) else None, named_tool=named, thinking=thinking,
                       effort=effort or "max", response_format=rf, logprobs=(top or 0) if lp else None,
                       parallel_tool_calls=get_bool(body, "parallel_tool_calls", True))


# ---------------------------------------------------------------------------------------------- completions


@dataclass
class CompletionRequest:
    """prompts: a batch (one or more) of strings or token-id lists; choice i*n + j is sample j of prompt i."""

    common: CommonParams
    prompts: list[str | list[int]]
    logprobs: int | None
    echo: bool = False


MAX_PROMPTS = 64


def _prompt_list(p: Any, vocab: int) -> list[str | list[int]]:
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise bad("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    if len(p) > MAX_PROMPTS:
        raise bad("prompt", f"a batch holds at most {MAX_PROMPTS} prompts")
    for k, q in enumerate(p):
        where = "prompt" if len(p) == 1 else f"prompt[{k}]"
        if isinstance(q, str):
            if not q:
                raise bad(where, "must not be empty")
        elif isinstance(q, list):
            if not q or any(not _is_int(t) or not 0 <= t < vocab for t in q):
                raise bad(where, f"a token-id prompt must be a non-empty list of integers in [0, {vocab})")
        else:
            raise bad(where, "each prompt must be a string or a list of token ids")
    return p


def parse_completion(body: Any, vocab: int) -> CompletionRequest:
    common = parse_common(body, vocab)
    prompts = _prompt_list(body.get("prompt"), vocab)
    if body.get("suffix"):
        raise bad("suffix", "is not supported", "unsupported_parameter")
    best_of = get_int(body, "best_of", 1)
    if best_of not in (None, 1, common.n):
        raise bad("best_of", "only best_of = 1 (or = n) is supported", "unsupported_parameter")
    if len(prompts) * common.n > MAX_N:
        raise bad("n", f"prompts x n must be at most {MAX_N}")
    echo = get_bool(body, "echo", False)
    logprobs = get_int(body, "logprobs", 0, 5)
    if echo and logprobs is not None:
        raise bad("echo", "echo together with logprobs (prompt logprobs) is not supported", "unsupported_parameter")
    return CompletionRequest(common=common, prompts=prompts, logprobs=logprobs, echo=echo)
