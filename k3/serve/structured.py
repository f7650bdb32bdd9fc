"""Structured outputs: grammar-constrained decoding with llguidance.

`response_format` json_object / json_schema and `tool_choice` "required" / named are enforced by a
grammar over the assistant turn that the model writes after the generation prompt, in the XTML
syntax the parser (`k3.chat.parse`) reads:

    [thinking]  think text  <|close|>think<|sep|><|open|>response<|sep|>
    json:       JSON(schema)  <|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>
    tools:      <|close|>response<|sep|><|open|>tools<|sep|> call{1..k} <|close|>tools<|sep|>
                <|close|>message<|sep|><|end_of_msg|>
    auto:       text <|close|>response<|sep|> [<|open|>tools<|sep|> call{1..k} <|close|>tools<|sep|>]
                <|close|>message<|sep|><|end_of_msg|>     (tool_choice auto with strict tools)
    call:       <|open|>call tool="NAME" index="i"<|sep|> argument* <|close|>call<|sep|>
    argument:   <|open|>argument key="K" type="T"<|sep|> value <|close|>argument<|sep|>

Every fixed piece (markers, tag names, attributes) is pinned to the exact token ids the renderer
produces (`<[id]>` in the grammar), so the model writes them in one canonical tokenization. Argument
values follow the tool's JSON schema: `string` values are raw text (enum / const / pattern /
length limits honoured), other types are JSON constrained by the property's schema. Thinking is free
text, but the think channel must close after `think_budget` tokens so that the constrained part
always gets room (an untrained model never closes it on its own).

Why llguidance (not xgrammar): it is a self-contained Rust wheel (abi3, no torch / transformers /
triton dependency) that runs on CPU, computes a mask in ~50-100 us per token for a JSON grammar, and
its Lark front end references special tokens by name or id, which the XTML markers need.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3.chat.xtml import CLOSE, SegmentBuilder

MAX_PARALLEL_CALLS = 4
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BLOCKED = torch.finfo(torch.float32).max
_XTML_TYPE = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
              "object": "object", "array": "array"}


class GrammarError(ValueError):
    """The requested structure cannot be compiled (bad schema, or llguidance missing)."""


@dataclass
class StructuredSpec:
    """What to enforce for one chat request.

    thinking: the generation prompt opened the think channel. tools: the request's function tools.
    tool_choice: "required" (at least one call of any tool), "auto" (free text, then optionally calls
    with valid arguments: the server uses it when every tool is `strict`) or None. named_tool: the
    prompt already ends with this tool's call header (forced prefix); the grammar covers its arguments
    and the end. response_format: the OpenAI `response_format` object (it wins over "auto").
    parallel: allow up to MAX_PARALLEL_CALLS calls.
    """

    thinking: bool
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | None = None
    named_tool: str | None = None
    response_format: dict | None = None
    parallel: bool = True

    @property
    def json(self) -> bool:
        return (self.response_format or {}).get("type") in ("json_object", "json_schema")

    @property
    def active(self) -> bool:
        return self.tool_choice in ("required", "auto") or self.named_tool is not None or self.json

    @property
    def forced(self) -> bool:
        """The output must reach a constrained part (calls or JSON): thinking gets a budget."""
        return self.tool_choice == "required" or self.named_tool is not None or self.json


class GrammarConstraint:
    """One request's grammar state. `allowed(vocab)` -> bool [vocab] mask (None once the grammar is
    done or broken: the request then samples freely); `accept(token)` advances it."""

    def __init__(self, matcher: Any, n_vocab: int, close_id: int, think_budget: int | None) -> None:
        self.matcher, self.n_vocab, self.close_id = matcher, n_vocab, close_id
        self.think_budget = think_budget  # None: not in a think channel
        self.count = 0
        self._bits = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self, vocab: int) -> torch.Tensor | None:
        m = self.matcher
        if m.is_stopped() or m.is_error():
            return None
        out = torch.zeros(vocab, dtype=torch.bool)
        if self.think_budget is not None and self.count >= self.think_budget:
            out[self.close_id] = True  # thinking ran out of budget: close the channel now
            return out
        m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        bits = ((self._bits[:, None] >> self._shifts) & 1).flatten()[: min(vocab, self.n_vocab)].bool()
        out[: bits.numel()] = bits
        return out

    @property
    def state(self) -> str:
        """"free" (grammar done or broken), "close" (thinking out of budget) or "grammar"."""
        m = self.matcher
        if m.is_stopped() or m.is_error():
            return "free"
        return "close" if self.think_budget is not None and self.count >= self.think_budget else "grammar"

    @staticmethod
    def batch_bias(constraints: list["GrammarConstraint"], vocab: int, device: torch.device
                   ) -> tuple[list[int], torch.Tensor | None]:
        """Masks of many rows at once, as additive logit biases: (positions in `constraints` that are
        masked, float32 [len(positions), vocab] on `device`: 0 where allowed, -FLT_MAX elsewhere, i.e.
        probability exactly 0). The bitmasks are filled by llguidance on the host (~5 us a row from its
        cache), copied as int32 words (32x smaller than a bool mask) and unpacked on the device."""
        rows = [k for k, c in enumerate(constraints) if c.state != "free"]
        if not rows:
            return [], None
        n_vocab = constraints[rows[0]].n_vocab
        words = (n_vocab + 31) // 32
        bits = torch.zeros(len(rows), words, dtype=torch.int32)
        for r, k in enumerate(rows):
            c = constraints[k]
            if c.state == "close":
                b = c.close_id % 32
                bits[r, c.close_id // 32] = (1 << b) if b < 31 else -(1 << 31)
            else:
                c.matcher.unsafe_compute_mask_ptr(bits[r].data_ptr(), words * 4)
        dev = bits.to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        ones = ((dev[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, : min(vocab, words * 32)]
        # 0 where allowed, -FLT_MAX elsewhere: exp() of it is exactly 0, and it is built by plain
        # arithmetic (writing -inf by log / masked_fill / where is ~50x slower on CPU)
        bias = ones.to(torch.float32).sub_(1).mul_(_BLOCKED)
        if vocab > bias.shape[1]:  # model vocabulary wider than the tokenizer's: never allowed
            bias = torch.cat([bias, bias.new_full((len(rows), vocab - bias.shape[1]), -_BLOCKED)], 1)
        return rows, bias

    def accept(self, token: int) -> None:
        if self.matcher.is_stopped() or self.matcher.is_error():
            return
        self.matcher.consume_token(int(token))
        self.count += 1
        if token == self.close_id:
            self.think_budget = None


class GrammarCompiler:
    """Compiles `StructuredSpec`s for one tokenizer. The llguidance tokenizer is built once, lazily
    (thread-safe); compile() is meant to run off the event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._ll: Any = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                try:
                    import llguidance
                except ImportError as e:
                    raise GrammarError("structured outputs need the `llguidance` package (pip install llguidance)"
                                       ) from e
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokView(self.tok)),
                                                  n_vocab=self.tok.vocab_size)
            return self._ll

    def compile(self, spec: StructuredSpec, think_budget: int) -> Callable[[], GrammarConstraint]:
        """-> a factory of fresh constraints (one per sample). GrammarError on a bad spec."""
        import llguidance

        ll = self._lltokenizer()
        lark = self.lark(spec)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        err = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if err:
            raise GrammarError(f"cannot compile the output grammar: {err.splitlines()[0][:300]}")
        template = llguidance.LLMatcher(ll, grammar)
        if template.is_error():
            raise GrammarError(f"cannot compile the output grammar: {template.get_error()[:300]}")
        close_id = self.tok.special_id(CLOSE)
        budget = think_budget if spec.thinking and spec.named_tool is None and spec.forced else None
        return lambda: GrammarConstraint(template.deep_copy(), ll.vocab_size, close_id, budget)

    # ---- grammar text ------------------------------------------------------------------------------
    def _ids(self, build: Callable[[SegmentBuilder], None]) -> str:
        b = SegmentBuilder()
        build(b)
        ids = [t for s in b.segments for t in self.tok.encode(s.text, allow_special=s.special)]
        return " ".join(f"<[{i}]>" for i in ids)

    def lark(self, spec: StructuredSpec) -> str:
        """The Lark grammar (llguidance dialect) of the assistant output for `spec`."""
        rules: list[str] = []
        end = self._ids(lambda b: (b.close_tag("message"), b.end_of_msg()))
        if spec.named_tool is not None:
            tool = _find_tool(spec.tools, spec.named_tool)
            args = self._args(tool, "t0", rules)
            tail = self._ids(lambda b: (b.close_tag("call"), b.close_tag("tools")))
            return "\n".join([f"start: {args} {tail} {end}"] + rules)
        head = ""
        if spec.thinking:
            rules.append("think: /(?s:.*)/")
            head = "think " + self._ids(lambda b: (b.close_tag("think"), b.open_tag("response")))
        rf = (spec.response_format or {}).get("type")
        if spec.tool_choice == "required":
            body = self._calls(spec, rules)
        elif spec.json:
            schema = {"type": "object"}
            if rf == "json_schema":
                schema = (spec.response_format.get("json_schema") or {}).get("schema")
                schema = {} if schema is None else schema  # no schema: any JSON value
            rules.append(f"body: %json{_json_schema(schema)}")
            body = "body " + self._ids(lambda b: b.close_tag("response"))
        elif spec.tool_choice == "auto":
            rules.append("text: /(?s:.*)/")
            body = "text " + self._calls(spec, rules, optional=True)
        else:
            raise GrammarError("nothing to constrain")
        return "\n".join([f"start: {head} {body} {end}"] + rules)

    def _calls(self, spec: StructuredSpec, rules: list[str], optional: bool = False) -> str:
        """The end of the response channel and the tools block (optional: the block may be absent)."""
        tools = spec.tools
        if not tools:
            raise GrammarError("tool_choice needs tools")
        args = [self._args(t, f"t{k}", rules) for k, t in enumerate(tools)]
        close_call = self._ids(lambda b: b.close_tag("call"))
        k_max = MAX_PARALLEL_CALLS if spec.parallel else 1
        for i in range(1, k_max + 1):
            alts = []
            for t, a in zip(tools, args):
                name = t["function"]["name"]
                alts.append(f"{self._ids(lambda b: b.open_tag('call', [('tool', name), ('index', i)]))} {a} {close_call}")
            nxt = f" call{i + 1}?" if i < k_max else ""
            rules.append(f"call{i}: ({' | '.join(alts)}){nxt}")
        block = (self._ids(lambda b: b.open_tag("tools")) + " call1 " + self._ids(lambda b: b.close_tag("tools")))
        return self._ids(lambda b: b.close_tag("response")) + (f" ({block})?" if optional else f" {block}")

    def _args(self, tool: dict, prefix: str, rules: list[str]) -> str:
        """Rule name of a tool's argument list (properties in declared order, optional ones may be left
        out); appends the rules it needs."""
        params = tool["function"].get("parameters") or {}
        props = params.get("properties") or {}
        if not isinstance(props, dict):
            raise GrammarError(f"tool {tool['function']['name']!r}: parameters.properties must be an object")
        required = params.get("required") or []
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise GrammarError(f"tool {tool['function']['name']!r}: parameters.required must be a list of strings")
        required = set(required)
        parts = []
        for j, (key, ps) in enumerate(props.items()):
            name = f"{prefix}a{j}"
            rules.append(f"{name}: " + " | ".join(self._arg_alts(key, ps if isinstance(ps, dict) else {}, name,
                                                                  rules)))
            parts.append(name if key in required else f"{name}?")
        rules.append(f"{prefix}args: {' '.join(parts)}" if parts else f'{prefix}args: ""')
        return f"{prefix}args"

    def _arg_alts(self, key: str, ps: dict, name: str, rules: list[str]) -> list[str]:
        close = self._ids(lambda b: b.close_tag("argument"))
        alts = []
        for k, t in enumerate(_types(ps)):
            xt = _XTML_TYPE[t]
            head = self._ids(lambda b: b.open_tag("argument", [("key", key), ("type", xt)]))
            value = f"{name}v{k}"
            rules.append(f"{value}: {_string_value(ps) if t == 'string' else '%json' + _json_schema({**ps, 'type': t})}")
            alts.append(f"{head} {value} {close}")
        return alts


def _find_tool(tools: list[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return t
    raise GrammarError(f"tool {name!r} is not declared")


def _types(ps: dict) -> list[str]:
    """The JSON types a property may take (enum / const infer them; no `type` = any)."""
    t = ps.get("type")
    if isinstance(t, str):
        t = [t]
    if t is not None and not (isinstance(t, list) and all(isinstance(x, str) for x in t)):
        raise GrammarError(f"a JSON schema `type` must be a string or a list of strings, got {t!r:.80}")
    if not t:
        values = ps.get("enum") if isinstance(ps.get("enum"), list) else [ps["const"]] if "const" in ps else None
        if values is None:
            return ["string", "number", "boolean", "null", "object", "array"]
        if not values:
            raise GrammarError("an empty `enum` admits no value")
        kinds = {"string" if isinstance(v, str) else "boolean" if isinstance(v, bool) else "null" if v is None
                 else "number" if isinstance(v, (int, float)) else "array" if isinstance(v, list) else "object"
                 for v in values}
        t = sorted(kinds)
    bad = [x for x in t if x not in _XTML_TYPE]
    if bad:
        raise GrammarError(f"unsupported JSON schema type(s) {bad}")
    return list(dict.fromkeys(t))


def _string_value(ps: dict) -> str:
    """Grammar of a raw (unquoted) string argument value."""
    values = ps.get("enum") if isinstance(ps.get("enum"), list) else [ps["const"]] if "const" in ps else None
    if values is not None:
        strs = [v for v in values if isinstance(v, str)]
        if not strs:
            raise GrammarError("a string enum needs string values")
        return " | ".join(_lark_str(v) for v in strs)
    if isinstance(ps.get("pattern"), str):
        pat = ps["pattern"]
        pat = pat[1:] if pat.startswith("^") else f"(?s:.*)(?:{pat})"
        pat = pat[:-1] if pat.endswith("$") and not pat.endswith("\\$") else f"(?:{pat})(?s:.*)"
        return "/" + pat.replace("/", "\\/") + "/"
    lo, hi = ps.get("minLength", 0), ps.get("maxLength")
    if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
        raise GrammarError("minLength / maxLength must be integers")
    return f"/(?s:.{{{lo},{'' if hi is None else hi}}})/" if lo or hi is not None else "/(?s:.*)/"


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _json_schema(schema: Any) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return json.dumps({**schema, "x-guidance": _JSON_LAYOUT}, ensure_ascii=False)


class _TokView:
    """What llguidance's TokenizerWrapper reads: token bytes by id (special tokens by name), the
    special ids, eos, and an encoder."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = None
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]

    def __call__(self, s: str | bytes) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tok.encode(s)

