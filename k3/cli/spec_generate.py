"""The serving-engine decode path of `k3 generate` (--engine, --draft): one request, streamed."""

from __future__ import annotations

from typing import Any, Callable, Iterator


def engine_stream(model: Any, tokenizer: Any, ids: list[int], params: Any, draft_dir: str | None,
                  spec_tokens: int) -> tuple[Iterator[int], Callable[[], str]]:
    """(token ids as the engine emits them, a summary suffix for the final line: the mean acceptance
    length with a draft). One request, no prefix cache; CUDA graphs where the engine supports them (bf16
    on CUDA: decode, verify and draft steps)."""
    from k3.model.draft import load_draft
    from k3.serve.engine import Engine, EngineConfig

    draft = load_draft(draft_dir, model) if draft_dir else None
    cfg = EngineConfig(memory_budget_bytes=256 << 20, page_size=16, enable_prefix_cache=False, max_running=1,
                       speculative_draft_tokens=spec_tokens)
    engine = Engine(model, _Vocab(tokenizer), cfg, draft=draft)

    def stream() -> Iterator[int]:
        engine.add_request(ids, params)
        while engine.has_unfinished():
            for o in engine.step():
                yield from o.new_token_ids

    def summary() -> str:
        s = engine.stats()
        if not s["spec_verify_rows"]:
            return ""
        tau = (s["spec_accepted_tokens"] + s["spec_verify_rows"]) / s["spec_verify_rows"]
        return (f", draft k={spec_tokens}: mean acceptance length {tau:.2f} tokens/verify, "
                f"{s['spec_accepted_tokens']}/{s['spec_draft_tokens']} drafts accepted")

    return stream(), summary


class _Vocab:
    """The engine needs the tokenizer only for its vocabulary size and eos id (`k3 generate` prints the
    text itself); a byte-level stand-in has neither, so fall back to the model's vocabulary."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = getattr(tok, "vocab_size", 1 << 30)
        self.eos_id = tok.eos_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)
