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
    # seven region columns (SiTU, AttnRes, combine, dispatch, routing, loss, MLA k/v); 4 rows of 64 = 4 documents
    assert "| torch | bf16 |" + " torch |" * 7 + " 4 | 64 |" in r.stdout


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
                                           ("attn_res.py", "| 4 x [17, 300] | k3 triton, then norm |"),
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


def test_gap_report_charges_idle_time_to_the_launching_op():
    """bench/gaps.py: device idle time between kernels is charged to the autograd node and innermost
    operator around the launch that ended the gap; late launches and long blocking calls are flagged."""
    from bench.gaps import analyse

    def x(cat, name, ts, dur, tid=1, pid=0, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    node = "autograd::engine::evaluate_function: MmBackward0"
    ev = [
        x("cpu_op", "aten::mm", 0, 10), x("cuda_runtime", "cudaLaunchKernel", 1, 2, corr=1),
        x("cpu_op", node, 20, 1000, tid=2), x("cpu_op", "aten::mm", 30, 20, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 35, 2, tid=2, corr=2),
        x("cpu_op", "aten::copy_", 60, 900, tid=2), x("cuda_runtime", "cudaStreamSynchronize", 61, 800, tid=2),
        x("cuda_driver", "cuLaunchKernelEx", 870, 3, tid=2, corr=3),
        x("kernel", "gemm", 5, 40, pid=9, tid=7, corr=1),      # 5..45
        x("kernel", "gemm2", 40, 10, pid=9, tid=8, corr=2),    # overlaps: no gap
        x("kernel", "triton_k", 900, 10, pid=9, tid=7, corr=3),  # gap 50..900, launched late at 870
    ]
    rep = analyse({"traceEvents": ev})
    assert rep.kernels == 3
    assert abs(rep.busy_ms - 0.055) < 1e-9 and abs(rep.idle_ms - 0.850) < 1e-9
    assert abs(rep.span_ms - 0.905) < 1e-9
    row = rep.rows[("MmBackward0", "aten::copy_")]
    assert row.gaps == 1 and row.late == 1 and abs(row.ms - 0.85) < 1e-9
    assert rep.blocking == [(0.8, "cudaStreamSynchronize", "MmBackward0 / aten::copy_")]
