"""Chunked KDA in plain PyTorch (WY/UT form): the CPU default; autograd provides the backward.

Per head and chunk of C tokens with state S at the chunk start, chunk-local cumulative
log-decay G_i = sum_{t<=i} g_t (per key channel) and Gamma_ij = exp(G_i - G_j):

    A_ij = beta_i * sum_c k_ic k_jc Gamma_ijc            (j < i)      intra-chunk delta rule
    P_ij = sum_c q_ic k_jc Gamma_ijc                     (j <= i)     intra-chunk attention
    (I + A) [U0 | W] = [beta*v | beta*k*exp(G)]                       UT transform (triangular solve)
    U = U0 - W S                                                      pseudo-values
    o = (q*exp(G)) S + P U
    S_next = M S + E,  M = Diag(exp(G_C)) - (k*exp(G_C - G))^T W,  E = (k*exp(G_C - G))^T U0

All intra-chunk work is batched over (chunks, heads); only S_next = M S + E runs as a Python
loop over chunk index. Packed sequences (cu_seqlens) and padded tails are re-laid out as
chunk-aligned rows so no work is wasted on padding beyond one partial chunk per sequence.
The default chunk is 16 tokens: on CPU small chunks win (fewer C^2 terms, no sub-block
expansion) and the loop over chunks is cheap; any multiple of 16 gives the same result.

Numerics: every exponential is of a number <= 0, except inside 16-token diagonal blocks
where Gamma is factorised as exp(G_i - G_r) * exp(G_r - G_j) around the block's first
position r; the second factor is at most exp(span), span = G_r - G_(block end) <= 75 for
K3 gates (g > -5), far from float32 overflow. If some block's span exceeds _SPAN_LIMIT (gates
well below -5) those blocks are instead evaluated exactly per channel and pair, so any g <= 0
is handled. Between blocks the decay is split at a block boundary into two factors in (0, 1].
Cumulative sums are chunk-local, so their magnitude (and rounding) is at most C * max|g|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.ops.kda.validate import check_kda_shapes

SUB = 16  # diagonal block size of the pairwise-decay computation


@dataclass
class ChunkLayout:
    """Maps a [B, T] token grid (or B == 1 packed sequences) onto chunk-aligned rows.

    Sequence n occupies `nchunks[n]` consecutive chunks (sequence-major). The recurrence
    runs on an [N, max_chunks] grid whose unused cells hold the identity transform.
    Index tensors are None when the mapping is a plain reshape.
    """

    N: int
    C: int
    n_chunks: int
    max_chunks: int
    n_tokens: int
    tok_idx: torch.Tensor | None  # [n_chunks * C] -> flat token (n_tokens = padding slot)
    out_idx: torch.Tensor | None  # [n_tokens] -> flat chunk slot
    grid_idx: torch.Tensor | None  # [N * max_chunks] -> chunk (n_chunks = identity cell)
    chunk_pos: torch.Tensor | None  # [n_chunks] -> grid cell

    @classmethod
    def build(cls, B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int,
              device: torch.device) -> "ChunkLayout":
        if cu_seqlens is None:
            lens = torch.full((B,), T, dtype=torch.long)
        else:
            lens = cu_seqlens.detach().to("cpu", torch.long).diff()
        N = lens.numel()
        max_len = int(lens.max()) if N else 0
        C = min(chunk_size, max(SUB, -(-max_len // SUB) * SUB))
        nch = -(-lens // C)
        n_chunks, max_chunks = int(nch.sum()), int(nch.max()) if N else 0
        if bool((lens == max_chunks * C).all()):
            return cls(N, C, n_chunks, max_chunks, B * T, None, None, None, None)
        starts = torch.cumsum(lens, 0) - lens
        offs = torch.cumsum(nch, 0) - nch
        seq_of_chunk = torch.repeat_interleave(torch.arange(N), nch)
        j_of_chunk = torch.arange(n_chunks) - offs[seq_of_chunk]
        local = j_of_chunk[:, None] * C + torch.arange(C)
        tok = torch.where(local < lens[seq_of_chunk, None], starts[seq_of_chunk, None] + local, B * T)
        seq_of_tok = torch.repeat_interleave(torch.arange(N), lens)
        out = offs[seq_of_tok] * C + torch.arange(B * T) - starts[seq_of_tok]
        j = torch.arange(max_chunks)
        grid = torch.where(j < nch[:, None], offs[:, None] + j, n_chunks)
        pos = seq_of_chunk * max_chunks + j_of_chunk
        return cls(N, C, n_chunks, max_chunks, B * T, *(x.reshape(-1).to(device) for x in (tok, out, grid, pos)))

    def to_chunks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H, *D] -> [n_chunks, H, C, *D] in `dtype` (padding slots are zero)."""
        flat = x.to(dtype).reshape(self.n_tokens, *x.shape[2:])
        if self.tok_idx is not None:
            flat = _Gather.apply(flat, self.tok_idx, self.out_idx, flat.new_zeros(flat.shape[1:]))
        return flat.reshape(self.n_chunks, self.C, *flat.shape[1:]).transpose(1, 2).contiguous()

    def from_chunks(self, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """[n_chunks, H, C, D] -> [B, T, H, D]."""
        flat = x.transpose(1, 2).reshape(self.n_chunks * self.C, *x.shape[1:2], *x.shape[3:])
        if self.out_idx is not None:
            flat = _Gather.apply(flat, self.out_idx, self.tok_idx, None)
        return flat.reshape(B, T, *flat.shape[1:])

    def to_grid(self, x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """Per-chunk [n_chunks, *R] -> [N, max_chunks, *R]; empty cells take `fill` [*R]."""
        if self.grid_idx is not None:
            x = _Gather.apply(x, self.grid_idx, self.chunk_pos, fill.to(x.dtype))
        return x.reshape(self.N, self.max_chunks, *x.shape[1:])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[N, max_chunks, *R] -> per-chunk [n_chunks, *R]."""
        x = x.reshape(self.N * self.max_chunks, *x.shape[2:])
        return x if self.chunk_pos is None else _Gather.apply(x, self.chunk_pos, self.grid_idx, None)


class _Gather(torch.autograd.Function):
    """out = src[idx], src = x, or x with the row `fill` appended (read by every idx == len(x)).

    The layouts read every row of x at most once, so the gradient is a gather too: row r of x gets
    grad[inv[r]], with inv the inverse map (`inv[r] == len(out)` for a row no idx reads: zero). Autograd's
    own backward of indexing is an accumulating scatter (index_put), several times slower on CPU.
    x: [R, *D]; idx: [R_out] long; inv: [R] long; fill: [*D] (not differentiated) or None.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor, fill: torch.Tensor | None):
        ctx.save_for_backward(inv)
        ctx.pad = fill is None  # rows of x no idx reads exist exactly when idx reads no fill row
        src = x if fill is None else torch.cat((x, fill.unsqueeze(0)))
        return src[idx]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inv,) = ctx.saved_tensors
        if ctx.pad:
            grad = torch.cat((grad, grad.new_zeros(1, *grad.shape[1:])))
        return grad[inv], None, None, None


# Largest within-block decay span exp(span) that the factorised diagonal blocks may produce
# (fp32 max ~ e^88.7, fp64 ~ e^709); K3's gate (g > -5) gives at most 15 * 5 = 75.
_SPAN_LIMIT = {torch.float32: 80.0, torch.float64: 600.0}


def decay_pairs(L: torch.Tensor, R: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """out[..., x, i, j] = sum_c L[..., x, i, c] R[..., j, c] exp(G[..., i, c] - G[..., j, c]) for j <= i, else 0.

    L: [..., X, C, K]; R, G: [..., C, K] with G non-increasing along C; C a multiple of SUB.
    Returns [..., X, C, C] in L's dtype; entries with j > i are unspecified (callers apply tril).

    The decay is split at r_b, the first position of i's SUB-block b:
    exp(G_i - G_r) * exp(G_r - G_j). For j in an earlier block both exponents are <= 0. Inside
    block b the second exponent is in [0, span_b], span_b = G_r - G_(last of b); when some span
    exceeds _SPAN_LIMIT (only for gates below about -5) the diagonal blocks are instead computed
    exactly per channel, so positive exponents never exceed _SPAN_LIMIT.
    """
    C = G.shape[-2]
    nb = C // SUB
    Gb = G.unflatten(-2, (nb, SUB))
    ref = Gb[..., 0, :]  # [..., nb, K]
    exact = G.numel() > 0 and float((ref - Gb[..., -1, :]).detach().max()) > _SPAN_LIMIT[G.dtype]
    lq = L * (Gb - ref.unsqueeze(-2)).exp().flatten(-3, -2).unsqueeze(-3)  # [..., X, C, K]
    if nb == 1 and not exact:  # the CPU default (C = 16): one matmul
        return lq @ (R * (ref - G).exp()).unsqueeze(-3).transpose(-1, -2)
    blk = torch.arange(C, device=G.device) // SUB
    bidx = torch.arange(nb, device=G.device)[:, None]
    keep = blk < bidx if exact else blk <= bidx  # [nb, C]: which j each block's rows may see
    e = torch.where(keep[:, :, None], ref.unsqueeze(-2) - G.unsqueeze(-3), -torch.inf)
    rk = R.unsqueeze(-3) * e.exp()  # [..., nb, C, K]
    out = torch.einsum("...xbik,...bjk->...xbij", lq.unflatten(-2, (nb, SUB)), rk)
    out = out.reshape(*out.shape[:-3], C, C)
    return out + _exact_diagonal_blocks(L, R, Gb) if exact else out


def _exact_diagonal_blocks(L: torch.Tensor, R: torch.Tensor, Gb: torch.Tensor) -> torch.Tensor:
    """Block-diagonal part of decay_pairs with the decay evaluated per channel and pair (j <= i)."""
    nb = Gb.shape[-3]
    lower = torch.ones(SUB, SUB, dtype=torch.bool, device=Gb.device).tril()
    d = torch.where(lower[:, :, None], Gb[..., :, None, :] - Gb[..., None, :, :], -torch.inf)
    rx = d.exp() * R.unflatten(-2, (nb, SUB)).unsqueeze(-3)  # [..., nb, i, j, K]
    lb = L.unflatten(-2, (nb, SUB)).movedim(-4, -1)  # [..., nb, i, K, X]
    diag = (rx @ lb).movedim(-1, -4)  # [..., X, nb, i, j]
    eye = torch.eye(nb, dtype=L.dtype, device=L.device)
    return torch.einsum("...xbij,bc->...xbicj", diag, eye).reshape(*diag.shape[:-3], nb * SUB, nb * SUB)


def chunk_parts(k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor,
                q: torch.Tensor | None = None):
    """Per-chunk quantities, batched over leading dims.

    k, G: [..., C, K] (G = chunk-local cumsum of g); v: [..., C, V]; beta: [..., C];
    q: [..., C, K] already scaled, or None when no output is needed.
    Returns M [..., K, K], E [..., K, V], U0 [..., C, V], W [..., C, K], and when q is given
    P [..., C, C] and Qg [..., C, K] (else None, None).
    """
    V = v.shape[-1]
    L = k.unsqueeze(-3) if q is None else torch.stack((k, q), -3)
    pairs = decay_pairs(L, k, G)
    A = pairs[..., 0, :, :].tril(-1) * beta.unsqueeze(-1)
    bcol, eg = beta.unsqueeze(-1), G.exp()
    rhs = torch.cat((bcol * v, bcol * k * eg), -1)
    # unitriangular: the solve reads only A's strict lower part, i.e. solves (I + A) x = rhs.
    U0, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split(
        [V, k.shape[-1]], -1)
    g_last = G[..., -1:, :]
    kgt = (k * (g_last - G).exp()).transpose(-1, -2)  # [..., K, C]
    M = torch.diag_embed(g_last.squeeze(-2).exp()) - kgt @ W
    E = kgt @ U0
    if q is None:
        return M, E, U0, W, None, None
    return M, E, U0, W, pairs[..., 1, :, :].tril(), q * eg


def run_states(layout: ChunkLayout, M: torch.Tensor, E: torch.Tensor,
               S0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inter-chunk recurrence S <- M S + E along each sequence's chunks.

    M: [n_chunks, H, K, K]; E: [n_chunks, H, K, V]; S0: [N, H, K, V].
    Returns (state at the start of each chunk [n_chunks, H, K, V], final state [N, H, K, V]).
    """
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand(M.shape[1:])
    Mg = layout.to_grid(M, eye)
    Eg = layout.to_grid(E, E.new_zeros(E.shape[1:]))
    # unbind once: indexing Mg[:, j] per step would make the backward O(chunks^2).
    Ms, Es = Mg.unbind(1), Eg.unbind(1)
    S, starts = S0, []
    for Mj, Ej in zip(Ms, Es):
        starts.append(S)
        S = torch.baddbmm(Ej.flatten(0, 1), Mj.flatten(0, 1), S.flatten(0, 1)).view_as(S)
    if not starts:
        return S0.new_zeros(0, *S0.shape[1:]), S
    return layout.from_grid(torch.stack(starts, 1)), S


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    The chunk -> token re-layout hands back a permuted gradient, and CPU bmm backward falls
    into a per-matrix loop on such strides (about 10x slower).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def validate(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size: int) -> int:
    """Shape checks shared by the chunked entry points; returns the number of sequences N."""
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % SUB:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB}, got {chunk_size!r}")
    return check_kda_shapes(q, k, v, g, beta, initial_state, cu_seqlens)


def _decode_step(q, k, v, g, beta, scale, S0, dt):
    """T == 1 without packing: one recurrence step, [B, 1, H, *] inputs, S0 [B, H, K, V]."""
    qt, kt, vt, gt, bt = (x[:, 0].to(dt) for x in (q, k, v, g, beta))
    S = S0 * gt.exp().unsqueeze(-1)
    u = bt.unsqueeze(-1) * (vt - (kt.unsqueeze(-2) @ S).squeeze(-2))
    S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
    o = ((qt * scale).unsqueeze(-2) @ S).squeeze(-2)
    return o.unsqueeze(1), S


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (fla layout), differentiable.

    Args:
        q, k: [B, T, H, K] (L2-normalised); v: [B, T, H, V]; g: [B, T, H, K] log-decay <= 0;
        beta: [B, T, H]. scale: default K ** -0.5.
        initial_state: [N, H, K, V]; N = B, or the number of packed sequences with cu_seqlens.
        cu_seqlens: [N + 1] int32/int64 cumulative lengths (B == 1); the state resets per sequence.
        chunk_size: a multiple of 16. 16 is fastest on CPU (measured fwd+bwd: 32 is ~1.5x and
            64 ~5x slower) and keeps every exponential >= e^-80 for K3 gates (g > -5), so
            float32 denormals, on which x86 slows several-fold, stay rare.
    Returns:
        o [B, T, H, V] in v's dtype; final state [N, H, K, V] (or None) in float32, float64 for
        float64 q. Compute runs in float32 (float64 for float64 q).
    """
    N = validate(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q)
    scale = K**-0.5 if scale is None else scale
    S0 = (torch.zeros(N, H, K, V, dtype=dt, device=q.device) if initial_state is None
          else initial_state.to(dt))
    if T == 1 and cu_seqlens is None:
        o, S = _decode_step(q, k, v, g, beta, scale, S0, dt)
    else:
        o, S = _chunked(q, k, v, g, beta, scale, S0, cu_seqlens, chunk_size, dt)
    return o.to(v.dtype), (S if output_final_state else None)


def _chunked(q, k, v, g, beta, scale, S0, cu_seqlens, chunk_size, dt):
    B, T = q.shape[:2]
    lay = ChunkLayout.build(B, T, cu_seqlens, chunk_size, q.device)
    qc, kc, vc, gc, bc = (lay.to_chunks(x, dt) for x in (q, k, v, g, beta))
    M, E, U0, W, P, Qg = chunk_parts(kc, vc, gc.cumsum(-2), bc, qc * scale)
    starts, S = run_states(lay, M, E, S0)
    o = Qg @ starts + P @ (U0 - W @ starts)
    return lay.from_chunks(_ContiguousGrad.apply(o), B, T), S
