"""K3ForCausalLM.save_pretrained -> from_pretrained through the official-format adapter."""

import torch

from k3 import K3ForCausalLM
from k3.config import k3_tiny


def test_round_trip_bit_exact_fp32_and_same_logits(tmp_path):
    m = K3ForCausalLM(k3_tiny()).init_weights(seed=3)
    m.save_pretrained(tmp_path / "ck", dtype="float32")
    again = K3ForCausalLM.from_pretrained(tmp_path / "ck")
    a, b = m.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 4096, (1, 10))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, again(ids).logits)


def test_bf16_round_trip(tmp_path):
    m = K3ForCausalLM(k3_tiny()).init_weights(seed=4).to_dtype(torch.bfloat16)
    m.save_pretrained(tmp_path / "ck")
    again = K3ForCausalLM.from_pretrained(tmp_path / "ck", dtype="bfloat16")
    for (k, x), (_, y) in zip(m.state_dict().items(), again.state_dict().items()):
        assert x.dtype == y.dtype and torch.equal(x, y), k
