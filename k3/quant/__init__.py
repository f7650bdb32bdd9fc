"""Quantisation formats used by the K3 checkpoint (MXFP4 routed experts) and by QAT."""

from k3.quant.mxfp4 import (
    BLOCK,
    E2M1_GRID,
    decode_mxfp4,
    encode_mxfp4,
    encode_mxfp4_reuse,
    fake_quant_mxfp4,
    mxfp4_scales_ocp,
    quantize_dequantize_mxfp4,
)

__all__ = [
    "BLOCK",
    "E2M1_GRID",
    "decode_mxfp4",
    "encode_mxfp4",
    "encode_mxfp4_reuse",
    "fake_quant_mxfp4",
    "mxfp4_scales_ocp",
    "quantize_dequantize_mxfp4",
]
