"""Language-model agents for the tool loop: a k3 checkpoint in-process, or any OpenAI endpoint.

Both implement the `Agent` protocol of `k3.envs.base` (`act(messages, tools) -> assistant
message`) and return OpenAI-style assistant messages:

    {"role": "assistant", "content": str, "reasoning_content": str, "tool_calls": [...]}   # tool_calls only if any

`EngineAgent` renders the conversation with k3's chat template (`k3.chat.render`), generates with
k3's serving engine (`k3.serve.engine.Engine`, continuous batching) and parses the output ids with
`k3.chat.parse`. Many episodes share one engine: `act` is thread-safe (a driver thread steps the
engine for every caller, so episodes run in a thread pool batch together) and `act_batch` submits
several conversations at once. Model output is never an error: whatever the model wrote comes back
as content / reasoning / the complete tool calls the parser found.

`OpenAIAgent` speaks POST {base_url}/chat/completions with `tools` over HTTP (httpx).
"""

from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Sequence

from k3.chat import ChatFormatError, parse, render

Conversation = tuple[list[dict], list[dict]]  # (messages, tools)


@dataclass
class AgentConfig:
    """Decoding choices of an LLM agent.

    temperature 0 = greedy. max_new_tokens: per assistant turn (EngineAgent clips it to the context
    left). thinking: thinking mode (reasoning channel) or not; thinking_effort: low/medium/high/max
    or None (no effort message). seed: per-request sampling seed (reproducible sampled runs).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    thinking: bool = True
    thinking_effort: str | None = "low"
    seed: int | None = None


@dataclass
class Generation:
    """One assistant turn of `EngineAgent.generate_batch`.

    prompt_ids: the rendered prompt (ending with the generation prompt); token_ids: what the model
    sampled, including the stop id when it stopped on it; logprobs: per sampled token (or []).
    finish_reason: "stop" | "length" | "abort" | "error"; message: the parsed assistant message.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    message: dict
    finish_reason: str | None
    logprobs: list = field(default_factory=list)


def assistant_message(parsed: dict) -> dict:
    """An OpenAI assistant message from `k3.chat.parse` output ({content, reasoning_content, tool_calls})."""
    msg = {"role": "assistant", "content": parsed.get("content") or "",
           "reasoning_content": parsed.get("reasoning_content") or ""}
    if parsed.get("tool_calls"):
        msg["tool_calls"] = [dict(c) for c in parsed["tool_calls"]]
    return msg


def message_from_ids(token_ids: Sequence[int], tokenizer: Any, *, thinking: bool = True) -> dict:
    """Parse sampled ids (after a thinking or non-thinking generation prompt) into an assistant
    message. Never raises on model output: stray markers are text, cut-off calls are dropped."""
    return assistant_message(parse(list(token_ids), tokenizer, start="think" if thinking else "response"))


def renderable(messages: Sequence[dict]) -> list[dict]:
    """Copy of `messages` with the model's own malformed calls made renderable.

    A tool call whose arguments are JSON but not an object (the model wrote `[1]`) cannot be
    rendered back; its arguments become the raw text inside an object {"_raw": text} so the turn
    stays visible. A call without a name is shown as tool "_". Everything else is unchanged.
    """
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = dict(m, tool_calls=[_renderable_call(c) for c in calls])
        out.append(m)
    return out


def _renderable_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        fn = dict(fn, name="_")
        call = dict(call, function=fn)
    if not isinstance(fn.get("arguments"), str):
        return call
    try:
        value = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except json.JSONDecodeError:
        return call  # invalid JSON renders verbatim (the template's raw fallback)
    if isinstance(value, dict):
        return call
    return dict(call, function=dict(fn, arguments={"_raw": fn["arguments"]}))


# ---------------------------------------------------------------------------------------- in-process


class _Driver:
    """Steps one Engine on a background thread for any number of submitting threads.

    Commands come in through a queue (the engine is only touched by the driver thread); each
    request's FinalOutput-like dict is delivered through a concurrent.futures.Future.
    """

    def __init__(self, engine: Any, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = idle_wait_s
        self._live: dict[str, tuple[Future, dict]] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, prompt_ids: list[int], params: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, name="k3-agent-engine", daemon=True)
                self._thread.start()
        self._cmds.put((prompt_ids, params, fut))
        self._wake.set()
        return fut

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._wake.set()
            thread.join(30)

    def _add_pending(self) -> None:
        while True:
            try:
                ids, params, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                rid = self.engine.add_request(ids, params)
            except (ValueError, KeyError) as e:
                fut.set_exception(ValueError(str(e)))
                continue
            self._live[rid] = (fut, {"token_ids": [], "logprobs": [], "finish_reason": None})

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._add_pending()
                if not self._live:
                    self._wake.wait(self._idle)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._collect(out)
            except Exception as e:  # fail what is in flight, keep the driver alive for later requests
                for rid, (fut, _) in list(self._live.items()):
                    self.engine.abort(rid)
                    fut.set_exception(RuntimeError(f"engine failure: {type(e).__name__}: {e}"))
                self._live.clear()
        for rid, (fut, _) in list(self._live.items()):  # closed with requests in flight
            self.engine.abort(rid)
            fut.set_exception(RuntimeError("the agent was closed"))
        self._live.clear()

    def _collect(self, out: Any) -> None:
        entry = self._live.get(out.request_id)
        if entry is None:
            return
        fut, acc = entry
        acc["token_ids"] += out.new_token_ids
        acc["logprobs"] += out.new_logprobs
        if out.finished:
            del self._live[out.request_id]
            if out.finish_reason == "error":
                fut.set_exception(RuntimeError(f"generation failed: {out.error}"))
            else:
                acc["finish_reason"] = out.finish_reason
                fut.set_result(acc)


class EngineAgent:
    """A k3 model as an agent, generating with k3's serving engine in this process.

    model: a `K3ForCausalLM` (eval mode is set by the engine); tokenizer: a k3 tokenizer with the
    chat special tokens. engine_config: `k3.serve.engine.EngineConfig` (memory budget, max_running,
    ...), default the engine's own defaults. Call `close()` (or use `with`) to stop the driver thread.
    """

    def __init__(self, model: Any, tokenizer: Any, config: AgentConfig | None = None, *,
                 engine_config: Any = None) -> None:
        from k3.serve.engine import Engine

        self.config = config or AgentConfig()
        self.tokenizer = tokenizer
        self.engine = Engine(model, tokenizer, engine_config)
        self._driver = _Driver(self.engine)

    @classmethod
    def from_checkpoint(cls, directory: str, config: AgentConfig | None = None, *, tokenizer: str | None = None,
                        device: str | None = None, dtype: str | None = None, engine_config: Any = None) -> "EngineAgent":
        """Load a checkpoint directory (official layout + tokenizer files, or `tokenizer=DIR`).
        device: default cuda if available, else cpu; dtype: default bfloat16 on cuda, float32 on cpu."""
        import torch

        from k3.data.tokenizer import load_tokenizer
        from k3.model.causal_lm import K3ForCausalLM

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        tok = load_tokenizer(tokenizer or directory)
        model = K3ForCausalLM.from_pretrained(directory, dtype=dtype, device=device)
        return cls(model, tok, config, engine_config=engine_config)

    # ---- the Agent protocol ------------------------------------------------------------------------
    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        """The next assistant message (thread-safe: concurrent callers share engine batches)."""
        return self.generate_batch([(messages, tools)])[0].message

    def act_batch(self, items: Sequence[Conversation], *, return_exceptions: bool = False) -> list[Any]:
        """Next assistant messages of several conversations, generated together.
        return_exceptions: put a conversation's error (unrenderable, too long) in its slot instead of raising."""
        return [g.message if isinstance(g, Generation) else g
                for g in self.generate_batch(items, return_exceptions=return_exceptions)]

    # ---- generation ----------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The rendered prompt for the next assistant turn (ChatFormatError for malformed messages)."""
        c = self.config
        ids, _ = render(renderable(messages), self.tokenizer, tools or None, thinking=c.thinking,
                        thinking_effort=c.thinking_effort if c.thinking else None, add_generation_prompt=True)
        return ids

    def sampling_params(self, prompt_len: int) -> Any:
        """SamplingParams for one turn: max_new_tokens clipped to what the context has left."""
        from k3.serve.sampling import SamplingParams

        c = self.config
        room = self.engine.max_tokens_limit(prompt_len)
        if room < 1:
            raise ValueError(f"the conversation ({prompt_len} tokens) fills the model's context "
                             f"({self.engine.max_model_len} tokens)")
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_tokens=min(c.max_new_tokens, room), seed=c.seed)

    def generate_batch(self, items: Sequence[Conversation], *, return_exceptions: bool = False) -> list[Any]:
        """One assistant turn per conversation, with prompt/output ids (for SFT and RL rollouts)."""
        futures: list[Any] = []
        prompts: list[list[int] | None] = []
        for messages, tools in items:
            try:
                ids = self.prompt_ids(messages, tools)
                futures.append(self._driver.submit(ids, self.sampling_params(len(ids))))
                prompts.append(ids)
            except (ChatFormatError, ValueError, TypeError) as e:
                if not return_exceptions:
                    self._cancel(futures)
                    raise
                futures.append(e)
                prompts.append(None)
        out: list[Any] = []
        for ids, fut in zip(prompts, futures):
            if isinstance(fut, Exception):
                out.append(fut)
                continue
            try:
                res = fut.result()
            except (ValueError, RuntimeError) as e:
                if not return_exceptions:
                    raise
                out.append(e)
                continue
            out.append(self._generation(ids, res))
        return out

    def _generation(self, prompt_ids: list[int], res: dict) -> Generation:
        msg = message_from_ids(res["token_ids"], self.tokenizer, thinking=self.config.thinking)
        return Generation(prompt_ids, res["token_ids"], msg, res["finish_reason"], res["logprobs"])

    @staticmethod
    def _cancel(futures: list[Any]) -> None:
        for f in futures:
            if isinstance(f, Future):
                f.cancel()  # results of already-running requests are simply dropped

    def close(self) -> None:
        self._driver.close()

    def __enter__(self) -> "EngineAgent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- over HTTP


class EndpointError(RuntimeError):
    """The endpoint answered with an error or something that is not a chat completion."""


_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class OpenAIAgent:
    """Any OpenAI-compatible /v1/chat/completions endpoint (k3 serve, vLLM, the Kimi API) as an agent.

    base_url: e.g. http://127.0.0.1:8000/v1. send_reasoning: pass earlier turns' reasoning_content
    back (k3 serve and the Kimi API keep it; set False for endpoints that reject the field).
    extra_body: merged into every request (e.g. {"thinking": {"type": "disabled"}}).
    Errors (HTTP, timeouts, malformed replies) raise EndpointError / httpx errors: `run_episode`
    records them as the episode's agent_error.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, temperature: float | None = 0.0,
                 max_tokens: int | None = None, timeout: float = 600.0, send_reasoning: bool = True,
                 reasoning_effort: str | None = None, extra_body: dict | None = None) -> None:
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url, self.model = base_url.rstrip("/"), model
        self.temperature, self.max_tokens = temperature, max_tokens
        self.send_reasoning, self.reasoning_effort = send_reasoning, reasoning_effort
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)

    def payload(self, messages: list[dict], tools: list[dict]) -> dict:
        """The request body for one turn."""
        body: dict = {"model": self.model, "messages": [self._wire(m) for m in messages]}
        if tools:
            body["tools"] = tools
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.reasoning_effort is not None:
            body["reasoning_effort"] = self.reasoning_effort
        body.update(self.extra_body)
        return body

    def _wire(self, m: dict) -> dict:
        out = {k: m[k] for k in _MESSAGE_KEYS if k in m}
        if m.get("role") == "assistant":
            if out.get("tool_calls"):
                out["tool_calls"] = [_wire_call(c) for c in out["tool_calls"]]
            if self.send_reasoning and m.get("reasoning_content"):
                out["reasoning_content"] = m["reasoning_content"]
        return out

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        r = self._client.post(self.base_url + "/chat/completions", json=self.payload(messages, tools))
        try:
            body = r.json()
        except ValueError:
            raise EndpointError(f"HTTP {r.status_code}: reply is not JSON: {r.text[:300]!r}") from None
        if r.status_code != 200:
            err = body.get("error", body) if isinstance(body, dict) else body
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise EndpointError(f"HTTP {r.status_code}: {str(msg)[:500]}")
        return message_from_completion(body)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "OpenAIAgent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _wire_call(call: Any) -> Any:
    """A tool call as OpenAI expects it: arguments a JSON string."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or isinstance(fn.get("arguments"), str):
        return call
    return dict(call, function=dict(fn, arguments=json.dumps(fn.get("arguments") or {}, ensure_ascii=False)))


def message_from_completion(body: Any) -> dict:
    """The assistant message of a chat.completion body, normalised (EndpointError if there is none)."""
    try:
        msg = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"reply has no choices[0].message: {str(body)[:300]}") from None
    if not isinstance(msg, dict):
        raise EndpointError(f"choices[0].message is not an object: {str(msg)[:300]}")
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    content = msg.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": "assistant", "content": content if isinstance(content, str) else "",
           "reasoning_content": reasoning if isinstance(reasoning, str) else ""}
    calls = [_normalise_call(c, i) for i, c in enumerate(msg.get("tool_calls") or []) if isinstance(c, dict)]
    if calls:
        out["tool_calls"] = calls
    return out


def _normalise_call(call: dict, index: int) -> dict:
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False)
    return {"id": str(call.get("id") or f"call_{index}"), "type": "function",
            "function": {"name": fn.get("name") if isinstance(fn.get("name"), str) else "", "arguments": args}}
