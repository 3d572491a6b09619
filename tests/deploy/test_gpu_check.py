"""tools/gpu_check.py's family stage (GPU_CHECK_FAMILIES), run here as its own smoke check
(GPU_CHECK_SMOKE: 2 layers, few prompts, on the CPU): what a lent GPU runs must not first
fail there. Its figures here say nothing of a GPU's."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_family_check_runs_each_family_in_static_invariant_passes_as_its_steps(tmp_path):
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "GPU_CHECK_FAMILIES": "gemma2", "PYTHONPATH": str(ROOT),
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "gpu_check.json").read_text())["runs"]
    assert [r["family"] for r in runs] == ["gemma2"]
    for r in runs:
        assert r["numerics"].endswith("+invariant-8") and r["static_passes"] > 0
        assert r["speculation_identical"] == "3/3" and r["verify_bit_identical"] == "18/18", r
        assert r["rows_bit_identical"] == "64/64" and r["features_bit_identical"]
