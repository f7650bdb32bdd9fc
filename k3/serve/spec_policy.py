"""When the engine speculates: the batch-size policy of speculative decoding (learned draft or n-gram).

A speculative step verifies k + 1 tokens per request for the cost of one forward of (k + 1) x rows.
At a small batch the forward is bound by reading the weights, so the extra rows are nearly free and
the step emits tau tokens per request instead of one (tau: the mean acceptance length). At a large
batch the forward is bound by compute (and, in an MoE, every expert is read anyway), a verify step
costs close to (k + 1) plain steps, and speculation can lose; where the crossover lies depends on the
model and the GPU (measurements: docs/draft.md, "Speculation policy").

So the engine speculates in a step only while at most `max_batch` requests decode
(`EngineConfig.speculative_max_batch`; vLLM's `disable_by_batch_size`, the same idea), counting the
step's decoding requests and those whose prompt completes in the step (they decode from the next step
on: a batch of 32 new requests never captures draft features in its prefill). The decision is per step
and depends only on these counts, never on timings: the same requests in the same order take the same
path in every run. Greedy outputs do not depend on it (speculation is exact), so the policy may switch
on and off inside a request's generation.

While a step runs without speculation the engine hands the proposer no features (no host work per
request, nothing to keep); when speculation resumes, a request drafts from its next plain step on,
and the learned draft attends to its older cache entries across the gap (`k3.serve.draft_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Speculate in steps with at most this many decoding requests, per device type, when
# EngineConfig.speculative_max_batch is None (docs/draft.md, "Speculation policy"). GPU: k3-small's
# speculation wins at batch 8 with every draft measured, while at batch 32 it wins or loses with the
# draft's acceptance; CPU: the verify forward is compute-bound, and k3-tiny's speculation loses at
# batch 8. bench/spec.py's draft-all rows (no limit) re-derive the crossover for another model or card.
DEFAULT_SPEC_MAX_BATCH = {"cuda": 8, "cpu": 4}


def default_max_batch(device_type: str) -> int:
    """The measured default limit for a device type ('cuda', 'cpu'; others use the CPU's)."""
    return DEFAULT_SPEC_MAX_BATCH.get(device_type, DEFAULT_SPEC_MAX_BATCH["cpu"])


def resolve_max_batch(max_batch: int | None, device_type: str) -> int:
    """`EngineConfig.speculative_max_batch` as the engine applies it: None -> the device type's default."""
    return default_max_batch(device_type) if max_batch is None else max_batch


@dataclass(frozen=True)
class SpecPolicy:
    """max_batch: speculate only in steps with at most this many decoding requests; 0 = always."""

    max_batch: int = DEFAULT_SPEC_MAX_BATCH["cpu"]

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or self.max_batch < 0:
            raise ValueError(f"the speculation batch limit must be an integer >= 0 (0 = no limit), "
                             f"got {self.max_batch!r}")

    def speculate(self, num_decode: int) -> bool:
        """Whether a step with `num_decode` decoding requests speculates."""
        return self.max_batch == 0 or num_decode <= self.max_batch
