import json
import subprocess
import sys


def test_info_json_kimi_k3():
    out = subprocess.run([sys.executable, "-m", "k3", "info", "--preset", "kimi-k3", "--json"],
                         capture_output=True, text=True, check=True, timeout=120)
    d = json.loads(out.stdout)
    assert isinstance(d["total_params"], int) and isinstance(d["active_params"], int)
    assert abs(d["total_params"] / 2.8e12 - 1) < 0.02
    assert abs(d["active_params"] / 104e9 - 1) < 0.02
    assert d["num_kda_layers"] == 69 and d["num_mla_layers"] == 24
    # benchmarks.md section 3: "Training total at T = 8192 ~ 645.8 GFLOP/token"
    assert abs(d["train_flops_per_token_8k"] / 645.8e9 - 1) < 2e-3
    assert d["train_state_bytes"] == 16 * d["total_params"]
