"""tools/gpu_size.py, the GPU check at a real target's size, run here as its own smoke
check (GPU_CHECK_SMOKE: small models of the same vocabulary, on the CPU): what a lent GPU
runs must not first fail there. Its figures here say nothing of a GPU's."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "tools.gpu_size", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_engine_check_measures_every_pass_and_speculation_is_the_target_alones(tmp_path):
    done = run("engine", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_size.json").read_text())
    assert results["copy_gb_s"] > 0
    for name, modes in (("target", ("eager", "invariant")), ("draft", ("eager",))):
        runs = results[name]
        assert runs["bound_ms"] > 0 and runs["weight_bytes"] > 0
        for mode in modes:
            r = runs[mode]
            assert all(r[f"pass_{n}_ms"] > 0 for n in (1, 2, 5)) and r["rows_8_ms"] > 0 and r["step_ms"] > 0
            assert r["speculation_identical"] == "2/2", (name, mode, r)
    assert "invariant-8" in results["target"]["invariant"]["numerics"]
    assert "x bound" in done.stdout and "speculation K=4 identical 2/2" in done.stdout


def test_the_saved_pair_loads_as_the_services_load_it(tmp_path):
    from specdec.runtime import modeling
    from tools import gpu_size

    done = run("save", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("target", "draft"):
        model, tokenizer = modeling.load_model(str(tmp_path / name))
        assert model.config.vocab_size == gpu_size.SHAPES[name]["vocab_size"] == 128256
        assert model.config.tie_word_embeddings == gpu_size.SHAPES[name]["tie_word_embeddings"]
        # The default target's tokenizer: a random model's tokens past its ids decode to nothing.
        assert len(tokenizer) == 49152 and tokenizer.decode([100, 128000]) == tokenizer.decode([100])
