"""The GPU benchmark scripts keep working: run their CPU smoke modes."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_train_tiny_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "train.py"), "--tiny", "--device", "cpu", "--steps", "1",
                        "--seq-lens", "64"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    # six region columns (SiTU, AttnRes, combine, dispatch, routing, loss); 4 rows of 64 = 4 documents
    assert "| torch | bf16 |" + " inductor |" * 6 + " 4 | 64 |" in r.stdout


def test_bench_serve_tiny_decode_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--tiny", "--device", "cpu", "--which", "decode",
                        "--decode-batches", "1,2", "--decode-steps", "2", "--markdown"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| batch | static tok/s | eager tok/s |" in r.stdout and "\n| 2 | " in r.stdout


def test_bench_mla_decode_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "mla_decode.py"), "--device", "cpu", "--preset", "k3-tiny",
                        "--batches", "2", "--contexts", "20", "--lengths", "mixed", "--page-size", "8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| 2 | 20 | mixed | " in r.stdout


@pytest.mark.parametrize("script,header", [("situ.py", "| routed experts [512, 1024] | k3 triton |"),
                                           ("attn_res.py", "| 4 x [17, 300] | k3 triton, fused norm |"),
                                           ("moe_combine.py", "| dispatch k3-small 64 x 8 x 512 | k3 triton |"),
                                           ("moe_route.py", "| k3-small 64 x 64 x 8 | both |"),
                                           ("cross_entropy.py", "| k3 fused, chunk 16 |")])
def test_bench_triton_regions_cpu(script, header):
    """bench/situ.py, bench/attn_res.py, bench/moe_combine.py, bench/moe_route.py, bench/cross_entropy.py:
    correctness check and table, Triton under the interpreter."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--tiny", "--device", "cpu"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "check " in r.stdout and header in r.stdout


def test_profile_step_by_node_cpu():
    """bench/profile_step.py --by-node: operator time charged to autograd nodes; the profiled call runs
    with gradients already present (as micro-batches after the first), so AccumulateGrad's add_ shows."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--tiny", "--device", "cpu",
                        "--phases", "train", "--by-node", "--rows", "200"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "(by autograd node: host self time)" in r.stdout
    assert "| torch::autograd::AccumulateGrad | aten::add_ |" in r.stdout and "| forward | aten::mm |" in r.stdout


def test_kernel_resources_offline():
    """bench/kernel_resources.py records the SiTU kernels' launches under the interpreter, compiles them
    for sm_90 without a GPU and reads registers / spills from the cubins (with the installed Triton)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"), "--ops", "situ"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| _situ_")]
    assert {row.split("|")[1].strip() for row in rows} == {"_situ_fwd", "_situ_bwd"}
    assert all(16 <= int(row.split("|")[6]) <= 255 for row in rows)  # registers per thread
