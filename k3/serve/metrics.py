"""Engine counters and the Prometheus text exposition for GET /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class EngineMetrics:
    requests_added: int = 0
    forked_requests: int = 0  # n > 1 siblings that took a copy of a computed prompt (no prefill of their own)
    steps: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    # forwards by kind, with the rows they carried and the wall seconds of each phase (forward + sampling;
    # sampling reads the tokens back, so the time includes the device work)
    prefill_forwards: int = 0
    decode_forwards: int = 0
    decode_rows: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # speculative decoding (k3.serve.speculative): drafts proposed / accepted, verify forwards and their
    # rows, second forwards that rolled a partly rejected run back, wall seconds of the verify path
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_forwards: int = 0
    spec_verify_rows: int = 0
    spec_rerun_forwards: int = 0
    spec_verify_seconds: float = 0.0
    spec_propose_seconds: float = 0.0
    spec_policy_plain_steps: int = 0  # steps with decoding requests above EngineConfig.speculative_max_batch

    def observe_forward(self, decode: bool, rows: int, seconds: float) -> None:
        if decode:
            self.decode_forwards += 1
            self.decode_rows += rows
            self.decode_seconds += seconds
        else:
            self.prefill_forwards += 1
            self.prefill_seconds += seconds

    def observe_ttft(self, seconds: float) -> None:
        i = next((k for k, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
        self.ttft_counts[i] += 1
        self.ttft_sum += seconds

    def on_finish(self, req: Any) -> None:
        reason = req.finish_reason or "unknown"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_tokens or 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests_added": self.requests_added, "forked_requests": self.forked_requests, "steps": self.steps,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "finished": dict(self.finished),
            "ttft_counts": list(self.ttft_counts), "ttft_sum": self.ttft_sum,
            "prefill_forwards": self.prefill_forwards, "decode_forwards": self.decode_forwards,
            "decode_rows": self.decode_rows, "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "spec_draft_tokens": self.spec_draft_tokens, "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_verify_forwards": self.spec_verify_forwards, "spec_verify_rows": self.spec_verify_rows,
            "spec_rerun_forwards": self.spec_rerun_forwards, "spec_verify_seconds": self.spec_verify_seconds,
            "spec_propose_seconds": self.spec_propose_seconds, "spec_policy_plain_steps": self.spec_policy_plain_steps,
            "spec_acceptance_rate": (self.spec_accepted_tokens / self.spec_draft_tokens
                                     if self.spec_draft_tokens else 0.0),
            "spec_mean_acceptance_length": ((self.spec_accepted_tokens + self.spec_verify_rows) / self.spec_verify_rows
                                            if self.spec_verify_rows else 0.0),
        }


_HELP = {
    "requests_added": ("counter", "Requests submitted to the engine"),
    "forked_requests": ("counter", "n > 1 siblings that forked a computed prompt instead of prefilling it"),
    "steps": ("counter", "Engine steps run"),
    "prefill_forwards": ("counter", "Prefill forwards (one packed batch of prompt chunks each)"),
    "decode_forwards": ("counter", "Decode forwards (one token for each running request)"),
    "decode_rows": ("counter", "Rows summed over decode forwards (mean decode batch = decode_rows / decode_forwards)"),
    "prefill_seconds": ("counter", "Wall seconds in prefill forwards and their sampling"),
    "decode_seconds": ("counter", "Wall seconds in decode forwards and their sampling"),
    "spec_draft_tokens": ("counter", "Speculative draft tokens proposed (and verified)"),
    "spec_accepted_tokens": ("counter", "Speculative draft tokens accepted by the target model"),
    "spec_acceptance_rate": ("gauge", "spec_accepted_tokens / spec_draft_tokens"),
    "spec_mean_acceptance_length": ("gauge", "Tokens per speculative verify row: accepted drafts + the target's own "
                                    "token, averaged over rows (tau)"),
    "spec_verify_forwards": ("counter", "Speculative verify forwards"),
    "spec_verify_rows": ("counter", "Requests summed over speculative verify forwards"),
    "spec_rerun_forwards": ("counter", "Rollbacks of partly rejected verify runs (KDA states replayed to the accepted prefix)"),
    "spec_verify_seconds": ("counter", "Wall seconds in the speculative verify path (forwards and acceptance)"),
    "spec_propose_seconds": ("counter", "Wall seconds in the speculative proposer (drafting)"),
    "spec_policy_plain_steps": ("counter", "Steps decoded without speculation because more requests were decoding "
                                           "than the speculation batch limit (--spec-max-batch)"),
    "prompt_tokens_computed": ("counter", "Prompt tokens run through the model (not served from the cache)"),
    "generated_tokens": ("counter", "Tokens sampled"),
    "prompt_tokens": ("counter", "Prompt tokens of finished requests"),
    "cached_tokens": ("counter", "Prompt tokens of finished requests served from the prefix cache"),
    "running": ("gauge", "Requests holding a KDA slot"),
    "waiting": ("gauge", "Requests waiting for admission"),
    "blocks_total": ("gauge", "Cache pool blocks"),
    "blocks_free": ("gauge", "Free cache pool blocks"),
    "preemptions": ("counter", "Requests preempted for memory"),
    "prefix_checkpoints": ("gauge", "KDA checkpoints held by the prefix cache"),
    "prefix_queries": ("counter", "Prefix cache lookups"),
    "prefix_hits": ("counter", "Prefix cache lookups that reused tokens"),
    "prefix_query_tokens": ("counter", "Prompt tokens looked up in the prefix cache"),
    "prefix_hit_tokens": ("counter", "Prompt tokens reused from the prefix cache"),
    "prefix_saved": ("counter", "Checkpoints saved"),
    "prefix_evicted": ("counter", "Checkpoints evicted"),
    "prefix_token_hit_rate": ("gauge", "prefix_hit_tokens / prefix_query_tokens"),
}


def prometheus_text(stats: dict[str, Any], extra: dict[str, float] | None = None, prefix: str = "k3") -> str:
    """Render `Engine.stats()` (plus server counters in `extra`) in the Prometheus text format 0.0.4."""
    lines: list[str] = []
    for name, (kind, help_) in _HELP.items():
        if name not in stats:
            continue
        full = f"{prefix}_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}", f"{full} {float(stats[name])!r}"]
    if "finished" in stats:
        full = f"{prefix}_requests_finished_total"
        lines += [f"# HELP {full} Finished requests by finish reason", f"# TYPE {full} counter"]
        for reason, n in sorted(stats["finished"].items()):
            lines.append(f'{full}{{reason="{reason}"}} {float(n)!r}')
    if "ttft_counts" in stats:
        full = f"{prefix}_time_to_first_token_seconds"
        lines += [f"# HELP {full} Time from arrival to the first sampled token", f"# TYPE {full} histogram"]
        cum = 0
        for b, c in zip(list(TTFT_BUCKETS) + [float("inf")], stats["ttft_counts"]):
            cum += c
            le = "+Inf" if b == float("inf") else repr(float(b))
            lines.append(f'{full}_bucket{{le="{le}"}} {float(cum)!r}')
        lines += [f"{full}_sum {float(stats['ttft_sum'])!r}", f"{full}_count {float(cum)!r}"]
    for name, value in (extra or {}).items():
        full = f"{prefix}_{name}"
        lines += [f"# TYPE {full} counter", f"{full} {float(value)!r}"]
    return "\n".join(lines) + "\n"
