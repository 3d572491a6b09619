"""`specdec bench pair` as a smoke test on the tiny pair: each cell a deployment of real
services, the prompts of each category through it, the defaults' outputs equal to K =
0's. Not a timing test (the pair itself is 1.6 GB: never fetched here)."""

import json

from deploy.bench import pair


def test_bench_pair_runs_each_category_through_each_cell(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    args = pair.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--per-category", "1", "--max-new-tokens", "6",
         "--passes", "1", "--quantize", "none", "--topologies", "split", "--out", str(out)])
    assert pair.main_with(args) == 0
    report = json.loads((out / "pair.json").read_text())
    assert [(r["topology"], r["variant"]) for r in report["rows"]] == [("split", "defaults"), ("split", "K = 0")]
    for row in report["rows"]:
        assert set(row["by_category"]) == {"chat", "code", "repetitive"} and len(row["tokens"]) == 3
        assert all(v["tok_s"] > 0 for v in row["by_category"].values())
    defaults, k0 = report["summary"]["split, defaults"], report["summary"]["split, K = 0"]
    assert defaults["same"] == "3/3" == k0["same"]
    assert all(v["accept_length"] >= 1 and v["over_llama"] is None for v in defaults["by_category"].values())
    assert all(v["accept_length"] == 1 and v["over_k0"] == 1 for v in k0["by_category"].values())
    assert "| split, defaults |" in (out / "pair.md").read_text()
