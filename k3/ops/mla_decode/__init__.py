"""Weight-absorbed MLA decode attention over the serving engine's paged latent cache.

    paged_mla_decode(q_lat, q_pe, cache, page_tables, lens, scale, num_splits=None) -> [N, H, r] fp32
        Triton flash-decoding kernel (paged.py): reads only each row's valid pages, in place; CUDA-graph
        safe; runs on CPU tensors under TRITON_INTERPRET=1.
    mla_decode_reference(...)  the plain float32 spec (reference.py), same arguments minus num_splits.
"""

from k3.ops.mla_decode.paged import default_num_splits, paged_mla_decode
from k3.ops.mla_decode.reference import mla_decode_reference

__all__ = ["paged_mla_decode", "mla_decode_reference", "default_num_splits"]
