"""Training-time test (EAGLE-3): the draft unrolled on its own hidden states for K steps, a loss at each.

For a sequence x_0..x_{T-1} the target gives, in one forward, captured features g_i and its next-token
distributions p_i (p_i predicts x_{i+1}). The draft has N = T - 1 entries i = 0..N-1:

    step 0: entry i = (fused g_i, token x_{i+1})          -> predicts x_{i+2}; teacher p_{i+1}
    step s: entry i = (draft hidden of step s-1 at i, x_{i+1+s}) -> predicts x_{i+2+s}; teacher p_{i+1+s}

A query of step s at entry i attends to step 0's keys at entries j <= i (the real context) and to the
keys of steps 1..s at entry i itself (the draft's own earlier guesses in this chain). That is exactly
what the serving path sees when it drafts s tokens after position i (`k3.serve.draft_spec`): a cache of
real entries followed by its own speculative entries. Step s is valid at entry i when i + 1 + s < T.

Loss per step: soft cross-entropy to the target's distribution (the draft learns p, which is also what
maximises the acceptance probability sum_x min(p, q) to first order). Acceptance estimate: where the
sequence continues with the target's own greedy tokens (after its prompt), the chain of K greedy drafts
from entry i is accepted up to the first step whose argmax differs from the target's; tau = 1 + mean
accepted run (the bonus/correction token counts as the 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.model.draft import EagleDraft, attend


@dataclass
class TTTOutput:
    """loss: scalar (mean over steps of the per-step mean soft CE); step_loss / step_acc: per step, floats
    (acc: top-1 agreement with the target over generated positions); tau: acceptance-length estimate at
    K = steps (greedy chain), over entries where all K steps fall in the generated part; positions:
    entries that entered tau; step_logits: per step the draft's logits [B, N, V] (keep_logits only)."""

    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    tau: float
    positions: int
    step_logits: list[torch.Tensor] | None = None


@torch.no_grad()
def target_states(target: torch.nn.Module, ids: torch.Tensor, layers: tuple[int, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (aux features [B, T, 3H] fp32: the captured layers concatenated, the final hidden
    states [B, T, H] fp32); `teacher_logprobs` turns the latter into the target's distributions."""
    h, hidden = target.model(ids, hidden_state_layers=list(layers))
    return torch.cat([hidden[i] for i in layers], -1).float(), h.float()


@torch.no_grad()
def teacher_logprobs(target: torch.nn.Module, final_hidden: torch.Tensor, vocab_limit: int | None = None
                     ) -> torch.Tensor:
    """Final hidden [B, T, H] -> the target's log-probs [B, T, V] fp32 over the first vocab_limit ids (the
    rest -inf), the distribution the engine samples from at temperature 1."""
    w = target.lm_head.weight
    return F.log_softmax(_limit(target.lm_head(final_hidden.to(w.dtype)).float(), vocab_limit), -1)


def target_pass(target: torch.nn.Module, ids: torch.Tensor, layers: tuple[int, ...],
                vocab_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (aux [B, T, 3H], target log-probs [B, T, V]) in one target forward."""
    aux, h = target_states(target, ids, layers)
    return aux, teacher_logprobs(target, h, vocab_limit)


def _limit(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return torch.cat([logits[..., :vocab_limit], torch.full_like(logits[..., vocab_limit:], float("-inf"))], -1)


def ttt_forward(draft: EagleDraft, aux: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor,
                lengths: torch.Tensor, prompt_lens: torch.Tensor, steps: int, vocab_limit: int | None = None,
                *, keep_logits: bool = False) -> TTTOutput:
    """aux [B, T, 3H] / logp [B, T, V]: the target's captured states and log-probs of ids (`target_pass`,
    or cached `target_states` + `teacher_logprobs`); ids [B, T] long (right-padded), lengths [B] (valid
    tokens), prompt_lens [B] (tokens before the target's own continuation); vocab_limit: ids a tokenizer
    can produce (None = all), applied to the draft as to the target. Gradients flow into the draft only."""
    B, T = ids.shape
    N = T - 1
    if N < 1 or steps < 1:
        raise ValueError(f"need sequences of >= 2 tokens and steps >= 1, got T={T}, steps={steps}")
    dev = ids.device
    idx = torch.arange(N, device=dev)
    causal = torch.ones(N, N, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    feats = draft.fuse(aux[:, :N])
    keys, values, masks = [], [], [causal]
    losses, accs, agree_all, kept = [], [], [], []
    for s in range(steps):
        shift = 1 + s
        tok = _shifted(ids, shift, N)
        teacher = _shifted(logp, shift, N)  # [B, N, V]: p_{i+1+s}
        valid = (idx[None] + shift) < lengths[:, None]  # [B, N]
        q, k, v = draft.qkv(tok, feats)
        keys.append(k)
        values.append(v)
        mask = torch.cat(masks, -1)[None].expand(B, N, -1)
        hidden = draft.finish(feats, attend(q, torch.cat(keys, 1), torch.cat(values, 1), mask))
        logits = _limit(draft.logits(hidden).float(), vocab_limit)
        lq = F.log_softmax(logits, -1).clamp(min=-1e4)  # -inf outside the limit, where the teacher is 0
        ce = -(teacher.exp() * lq).sum(-1)  # [B, N]
        losses.append((ce * valid).sum() / valid.sum().clamp(min=1))
        agree = logits.argmax(-1) == teacher.argmax(-1)
        gen = valid & (idx[None] + 2 >= prompt_lens[:, None])  # the drafted token x_{i+2} was generated
        accs.append(float((agree & gen).sum() / gen.sum().clamp(min=1)))
        agree_all.append(agree)
        if keep_logits:
            kept.append(logits.detach())
        masks.append(eye)
        feats = hidden
    tau, n = _tau(agree_all, idx, lengths, prompt_lens, steps)
    loss = torch.stack(losses).mean()
    return TTTOutput(loss, [float(x.detach()) for x in losses], accs, tau, n, kept if keep_logits else None)


def _shifted(x: torch.Tensor, shift: int, n: int) -> torch.Tensor:
    """x[:, shift:shift + n] right-padded with zeros to n entries (dim 1)."""
    out = x[:, shift: shift + n]
    if out.shape[1] < n:
        pad = torch.zeros((x.shape[0], n - out.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
        out = torch.cat([out, pad], 1)
    return out


def _tau(agree: list[torch.Tensor], idx: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor,
         steps: int) -> tuple[float, int]:
    """1 + mean number of leading agreeing steps over entries whose whole K-step chain lies in the
    generated part of their sequence."""
    run = torch.ones_like(agree[0])
    accepted = torch.zeros(agree[0].shape, dtype=torch.long, device=agree[0].device)
    for a in agree:
        run = run & a
        accepted += run
    ok = (idx[None] + steps < lengths[:, None]) & (idx[None] + 2 >= prompt_lens[:, None])
    n = int(ok.sum())
    return (1.0 + float((accepted * ok).sum()) / n if n else float("nan")), n
