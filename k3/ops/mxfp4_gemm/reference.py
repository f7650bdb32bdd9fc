"""The spec of the MXFP4 grouped GEMM: decode each expert's weight exactly, then a plain GEMM.

`offs` [E] int32: each expert's end row (cumulative counts, as torch._grouped_mm takes them); expert e
owns rows offs[e-1] .. offs[e]-1 of x. Weights in the official layout (k3.quant.mxfp4): packed uint8
[E, N, K/2] (low nibble = even column), scale uint8 [E, N, K/32] (E8M0).
"""

from __future__ import annotations

import torch

from k3.quant.mxfp4 import decode_mxfp4


def mxfp4_gmm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor
                        ) -> torch.Tensor:
    """x [S, K] -> y [S, N] of x.dtype: rows of expert e times decode(packed[e], scale[e])^T, fp32
    accumulation; rows past offs[-1] are zero."""
    out = x.new_zeros(x.shape[0], packed.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w = decode_mxfp4(packed[e], scale[e], dtype=torch.float32)
            out[start:end] = (x[start:end].float() @ w.t()).to(x.dtype)
        start = end
    return out
