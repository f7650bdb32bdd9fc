"""`k3 chat`: a terminal client for a running `k3 serve` (or any OpenAI-compatible endpoint).

Streams each reply; reasoning is shown dimmed, tool calls as `[tool call] name(arguments)`. The
history keeps every turn's reasoning (preserved thinking). Commands: /reset, /exit. Only the
standard library is used.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
from typing import IO, Iterator
from urllib.parse import urlsplit

DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running k3 serve in the terminal")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="API base URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--effort", default=None, choices=["low", "medium", "high", "max"], help="reasoning_effort")
    p.add_argument("--no-thinking", action="store_true", help="non-thinking mode")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--prompt", action="append", default=None,
                   help="send this message instead of reading stdin (repeatable: one turn each)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=run)


class Client:
    def __init__(self, url: str, api_key: str, timeout: float) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--url must be an http(s) URL, got {url!r}")
        self.https, self.host, self.port = u.scheme == "https", u.hostname, u.port
        self.base = u.path.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.timeout = timeout

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> dict:
        c = self._conn()
        c.request("GET", self.base + path, headers=self.headers)
        r = c.getresponse()
        body = json.loads(r.read() or b"{}")
        if r.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {r.status}: {body}")
        return body

    def stream(self, path: str, payload: dict) -> Iterator[dict]:
        """POST with stream=true; yields each SSE event's JSON."""
        c = self._conn()
        c.request("POST", self.base + path, body=json.dumps(payload), headers=self.headers)
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read().decode('utf-8', 'replace')[:2000]}")
        for raw in r:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def turn(client: Client, payload: dict, out: IO[str], color: bool) -> dict:
    """Stream one reply, printing it; returns the assistant message for the history."""
    reasoning, content, calls = [], [], {}
    in_reasoning = False
    usage = None
    for ev in client.stream("/chat/completions", payload):
        if "error" in ev:
            raise RuntimeError(ev["error"].get("message", ev))
        usage = ev.get("usage") or usage
        for ch in ev.get("choices", []):
            d = ch.get("delta") or {}
            r = d.get("reasoning_content") or d.get("reasoning")
            if r:
                if not in_reasoning:
                    out.write(DIM if color else "[thinking] ")
                    in_reasoning = True
                reasoning.append(r)
                out.write(r)
            if d.get("content"):
                if in_reasoning:
                    out.write(RESET + "\n" if color else "\n")
                    in_reasoning = False
                content.append(d["content"])
                out.write(d["content"])
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            out.flush()
    if in_reasoning:
        out.write(RESET if color else "")
    for i in sorted(calls):
        fn = calls[i]["function"]
        out.write(f"\n[tool call] {fn['name']}({fn['arguments']})")
    if usage:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.write(f"\n{DIM if color else ''}[{usage.get('prompt_tokens')} prompt ({cached} cached), "
                  f"{usage.get('completion_tokens')} completion tokens]{RESET if color else ''}")
    out.write("\n")
    msg: dict = {"role": "assistant", "content": "".join(content), "reasoning_content": "".join(reasoning)}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def run(args: argparse.Namespace) -> int:
    try:
        client = Client(args.url, args.api_key, args.timeout)
        model = args.model or client.get("/models")["data"][0]["id"]
    except (ValueError, RuntimeError, OSError, KeyError, IndexError) as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 2
    color = sys.stdout.isatty()
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    prompts = iter(args.prompt) if args.prompt else None
    while True:
        if prompts is not None:
            text = next(prompts, None)
        else:
            try:
                text = input("> ")
            except EOFError:
                text = None
        if text is None or text.strip() == "/exit":
            return 0
        if text.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": text})
        payload: dict = {"model": model, "messages": history, "stream": True, "stream_options": {"include_usage": True}}
        if args.effort:
            payload["reasoning_effort"] = args.effort
        if args.no_thinking:
            payload["thinking"] = {"type": "disabled"}
        if args.max_tokens is not None:
            payload["max_tokens"] = args.max_tokens
        if args.temperature is not None:
            payload["temperature"] = args.temperature
        try:
            history.append(turn(client, payload, sys.stdout, color))
        except (RuntimeError, OSError, ValueError) as e:
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            if prompts is not None:
                return 1
