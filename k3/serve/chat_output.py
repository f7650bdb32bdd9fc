"""Turn engine outputs into OpenAI chat / completion payloads (non-streaming and SSE chunks).

Chat output is parsed on token ids by `k3.chat.StreamingParser` (structure = special ids only).
Reasoning is emitted under both `reasoning_content` (Kimi) and `reasoning` (vLLM); tool calls
are emitted once complete, with server-generated ids `call_<24 hex>`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from k3.chat import StreamingParser
from k3.chat.xtml import MARKERS
from k3.serve.engine import RequestOutput


def new_tool_call_id(index: int, name: str) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_str(tok: Any, tid: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(tid)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(tok: Any, ids: list[int], lps: list[tuple[float | None, list | None]]) -> list[dict]:
    out = []
    for tid, (lp, top) in zip(ids, lps):
        s, b = _token_str(tok, tid)
        entry = {"token": s, "logprob": lp, "bytes": b, "top_logprobs": []}
        for t, v in top or []:
            ts, tb = _token_str(tok, t)
            entry["top_logprobs"].append({"token": ts, "logprob": v, "bytes": tb})
        out.append(entry)
    return out


class ChatAssembler:
    """Feeds output tokens to the parser; builds deltas, chunks and the final message."""

    def __init__(self, tokenizer: Any, *, model: str, thinking: bool, forced_prefix: list[int], want_logprobs: bool,
                 close_ids: list[int] = (), index: int = 0, response_id: str | None = None,
                 created: int | None = None, skip_special_tokens: bool = True) -> None:
        """forced_prefix: prompt tokens that already opened a tool call (named tool_choice); close_ids:
        tokens that close it, fed at the end if the model did not, so the forced call is always emitted.
        index: the choice index (n > 1); response_id / created: shared by the choices of one response.
        skip_special_tokens: special ids other than the XTML markers never reach the text."""
        self.tok, self.model, self.index = tokenizer, model, index
        self.id = response_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = created or int(time.time())
        self.parser = StreamingParser(tokenizer, start="think" if thinking else "response",
                                      tool_call_id=new_tool_call_id)
        self.markers = {tokenizer.special_id(m) for m in MARKERS}
        self.skip_special = skip_special_tokens
        if forced_prefix:
            self.parser.feed_ids(forced_prefix)  # named tool choice: the call header is part of the prompt
        self.want_logprobs = want_logprobs
        self.logprobs: list[dict] = []
        self.close_ids = list(close_ids)
        self.finish_reason: str | None = None
        self.stop_str: str | None = None  # the stop string that ended the output, if one did
        self.usage: dict | None = None

    # ---- shared --------------------------------------------------------------------------------------
    def deltas(self, out: RequestOutput) -> list[dict]:
        ids = out.new_token_ids
        if self.skip_special:
            ids = [t for t in ids if t in self.markers or not self.tok.is_special(t)]
        events = self.parser.feed_ids(ids)
        if out.finished:
            forced = bool(self.close_ids) and not self.parser.result()["tool_calls"]
            if forced and not self.parser.done:
                events += self.parser.feed_ids(self.close_ids)
            events += self.parser.finish(close_calls=forced)
            self.usage = usage(out.prompt_tokens, out.output_tokens, out.cached_tokens)
            self.finish_reason = self._finish_reason(out.finish_reason)
            self.stop_str = out.stop_str
        deltas: list[dict] = []
        for ev in events:
            if ev.kind == "reasoning":
                deltas.append({"reasoning_content": ev.text, "reasoning": ev.text})
            elif ev.kind == "content":
                deltas.append({"content": ev.text})
            else:
                call = ev.tool_call
                fn = call["function"]
                deltas.append({"tool_calls": [{"index": call["index"], "id": call["id"], "type": "function",
                                               "function": {"name": fn["name"], "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": call["index"], "function": {"arguments": fn["arguments"]}}]})
        return deltas

    def _finish_reason(self, reason: str | None) -> str:
        if reason == "length":
            return "length"
        return "tool_calls" if self.parser.result()["tool_calls"] else "stop"

    # ---- streaming -----------------------------------------------------------------------------------
    def chunk(self, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "delta": delta, "finish_reason": finish_reason,
                             "logprobs": {"content": logprobs} if logprobs is not None else None}]}

    def first_chunk(self) -> dict | None:
        return self.chunk({"role": "assistant", "content": ""})

    def stream_chunks(self, out: RequestOutput) -> list[dict]:
        deltas = self.deltas(out)
        lp = chat_logprobs(self.tok, out.new_token_ids, out.new_logprobs) if self.want_logprobs else None
        chunks = [self.chunk(d) for d in deltas]
        if lp:
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = {"content": lp}
            else:
                chunks.append(self.chunk({}, logprobs=lp))
        if out.finished:
            chunks.append(self.chunk({}, self.finish_reason))
        return chunks

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage}

    # ---- non-streaming -------------------------------------------------------------------------------
    def add(self, out: RequestOutput) -> None:
        self.deltas(out)
        if self.want_logprobs:
            self.logprobs += chat_logprobs(self.tok, out.new_token_ids, out.new_logprobs)

    def choice(self) -> dict:
        """The non-streaming choice; reasoning fields are omitted (not "") when there is no reasoning."""
        r = self.parser.result()
        content = r["content"] if r["content"] or not r["tool_calls"] else None  # null beside tool calls
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if r["reasoning_content"]:
            msg["reasoning_content"] = msg["reasoning"] = r["reasoning_content"]
        if r["tool_calls"]:
            msg["tool_calls"] = r["tool_calls"]
        return {"index": self.index, "message": msg, "finish_reason": self.finish_reason,
                "logprobs": {"content": self.logprobs} if self.want_logprobs else None}

    def response(self) -> dict:
        return merged_response([self], "chat.completion")


def merged_usage(asms: list[Any], prompts: int = 1) -> dict[str, Any]:
    """Usage of a response with several choices: each prompt counted once (choices come in groups of
    len(asms) // prompts samples per prompt), completion tokens summed."""
    per = max(1, len(asms) // prompts)
    firsts = [a.usage for a in asms[::per]]
    comp = sum(a.usage["completion_tokens"] for a in asms)
    return usage(sum(u["prompt_tokens"] for u in firsts), comp,
                 sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts))


def merged_response(asms: list[Any], obj: str, prompts: int = 1) -> dict:
    """The non-streaming body of finished assemblers (one per choice, in choice order)."""
    a = asms[0]
    return {"id": a.id, "object": obj, "created": a.created, "model": a.model,
            "choices": [x.choice() for x in asms], "usage": merged_usage(asms, prompts)}


class CompletionAssembler:
    """Plain-text completions (/v1/completions)."""

    def __init__(self, tokenizer: Any, *, model: str, logprobs: int | None, index: int = 0,
                 response_id: str | None = None, created: int | None = None, echo: str = "") -> None:
        """echo: the prompt text, put in front of the completion (first chunk when streaming)."""
        self.tok, self.model, self.want, self.index = tokenizer, model, logprobs, index
        self.id = response_id or f"cmpl-{uuid.uuid4().hex}"
        self.created = created or int(time.time())
        self.echo = echo
        self.text = echo
        self.lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _lp(self, out: RequestOutput, offset: int) -> dict:
        lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, (v, top) in zip(out.new_token_ids, out.new_logprobs):
            s, _ = _token_str(self.tok, tid)
            lp["tokens"].append(s)
            lp["token_logprobs"].append(v)
            lp["top_logprobs"].append({_token_str(self.tok, t)[0]: x for t, x in top or []})
            lp["text_offset"].append(offset)
            offset += len(s)
        return lp

    def add(self, out: RequestOutput) -> dict | None:
        """Record an output; returns its logprobs block (or None)."""
        lp = self._lp(out, len(self.text)) if self.want is not None else None
        if lp:
            for k in self.lp:
                self.lp[k] += lp[k]
        self.text += out.new_text
        if out.finished:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            self.usage = usage(out.prompt_tokens, out.output_tokens, out.cached_tokens)
        return lp

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def first_chunk(self) -> dict | None:
        return self.chunk(self.echo, None, None) if self.echo else None

    def stream_chunks(self, out: RequestOutput) -> list[dict]:
        lp = self.add(out)
        chunks = []
        if out.new_text or lp:
            chunks.append(self.chunk(out.new_text, None, lp))
        if out.finished:
            chunks.append(self.chunk("", self.finish_reason, None))
        return chunks

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage}

    def choice(self) -> dict:
        return {"index": self.index, "text": self.text, "logprobs": self.lp if self.want is not None else None,
                "finish_reason": self.finish_reason}

    def response(self) -> dict:
        return merged_response([self], "text_completion")
