"""Grouped GEMMs over expert-sorted rows: the routed experts' forward / input-gradient GEMM and their
weight-gradient GEMM accumulated in fp32 straight into the master weights' gradients.

    from k3.ops.grouped_gemm import gmm, gmm_wgrad
    y = gmm(x, w.transpose(-2, -1), offs)        # x [S, K], w [E, N, K] -> [S, N], rows of expert e use w[e]^T
    gmm_wgrad(dy, x, offs, (g,), accumulate)      # g [E, N, K] fp32 (+)= per expert dy_e^T x_e

`offs` [E] int32 are the experts' cumulative row counts (torch._grouped_mm's convention). `reference.py`
is the spec; `triton_gmm.py` the kernels (CUDA, or the CPU under TRITON_INTERPRET=1 as CI runs them).
"""

from __future__ import annotations

import torch

from k3.ops.triton_utils import env_int, env_tile

__all__ = ["gmm", "gmm_wgrad"]


def _check_offs(offs: torch.Tensor, E: int) -> None:
    if offs.dim() != 1 or offs.shape[0] != E or offs.dtype != torch.int32:
        raise ValueError(f"offs must be [{E}] int32 cumulative row counts, got {list(offs.shape)} {offs.dtype}")


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of expert e times B_e: out[r] = a[r] @ b[e] for offs[e-1] <= r < offs[e] (rows past offs[-1]
    are left unwritten, as torch._grouped_mm leaves them).

    Args:
        a: [S, K] bf16 / fp16 / fp32, rows sorted by expert (unit stride along K).
        b: [E, K, N] same dtype, any strides (e.g. `w.transpose(-2, -1)` of a stacked [E, N, K] weight).
        offs: [E] int32 cumulative row counts.
    Returns:
        [S, N] in a's dtype (fp32 accumulation).
    """
    from k3.ops.grouped_gemm.triton_gmm import _gmm_rows
    import triton

    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1] or a.dtype != b.dtype:
        raise ValueError(f"gmm takes a [S, K] and b [E, K, N] of one dtype, got {list(a.shape)} {a.dtype}, "
                         f"{list(b.shape)} {b.dtype}")
    E, K, N = b.shape
    _check_offs(offs, E)
    a = a if a.stride(1) == 1 else a.contiguous()
    S = a.shape[0]
    out = torch.empty(S, N, device=a.device, dtype=a.dtype)
    bm, bn, bk = env_tile("K3_GMM", ("BM", "BN", "BK"), (128, 128, 64))
    warps, stages, group = env_int("K3_GMM_WARPS", 8), env_int("K3_GMM_STAGES", 4), env_int("K3_GMM_GROUP", 8)
    tiles = triton.cdiv(S, bm) + E
    grid = (triton.cdiv(tiles, group) * group * triton.cdiv(N, bn),)
    _gmm_rows[grid](a, b, out, offs, N, K, a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
                    E=E, EP=triton.next_power_of_2(E), BM=bm, BN=bn, BK=bk, GROUP=group,
                    num_warps=warps, num_stages=stages)
    return out


def gmm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, outs: tuple[torch.Tensor, ...],
              accumulate: bool) -> None:
    """Per expert e: C_e (+)= a[rows_e]^T @ b[rows_e] in fp32, C = outs concatenated along dim 1.

    Args:
        a: [S, M], b: [S, N]: bf16 / fp16 / fp32, one dtype, rows sorted by expert, unit column stride.
        offs: [E] int32 cumulative row counts.
        outs: one [E, M, N] or two [E, M1, N], [E, M - M1, N] contiguous fp32 tensors (e.g. w1.grad and
            w3.grad of a packed gate|up GEMM), written in place.
        accumulate: add to outs (True) or overwrite them (False).
    """
    from k3.ops.grouped_gemm.triton_gmm import _gmm_wgrad
    import triton

    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"gmm_wgrad takes a [S, M] and b [S, N] of one dtype, got {list(a.shape)} {a.dtype}, "
                         f"{list(b.shape)} {b.dtype}")
    if len(outs) not in (1, 2):
        raise ValueError(f"gmm_wgrad writes one or two outputs, got {len(outs)}")
    E = outs[0].shape[0]
    _check_offs(offs, E)
    M, N = a.shape[1], b.shape[1]
    M1 = outs[0].shape[1]
    shapes = [list(o.shape) for o in outs]
    want = [[E, M, N]] if len(outs) == 1 else [[E, M1, N], [E, M - M1, N]]
    if shapes != want or any(o.dtype != torch.float32 or not o.is_contiguous() for o in outs):
        raise ValueError(f"gmm_wgrad outputs must be contiguous fp32 {want}, got {shapes} "
                         f"{[o.dtype for o in outs]}")
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    bm, bn, bk = env_tile("K3_GMMW", ("BM", "BN", "BK"), (128, 128, 64))
    if M1 % bm and len(outs) == 2:
        raise ValueError(f"gmm_wgrad: the split row {M1} must be a multiple of the row tile {bm}")
    warps, stages = env_int("K3_GMMW_WARPS", 8), env_int("K3_GMMW_STAGES", 4)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), E)
    _gmm_wgrad[grid](a, b, outs[0], outs[-1], offs, M, N, M1, a.stride(0), b.stride(0),
                     E=E, BM=bm, BN=bn, BK=bk, ACCUMULATE=accumulate, num_warps=warps, num_stages=stages)
