"""`specdec bench load` as a smoke test on the tiny pair: every variant runs at two
concurrencies through real services (closed loops of 1 s), the outputs are written,
nothing fails, and every output is the target's. Not a timing test."""

import json

from deploy.bench import load


def test_bench_load_runs_every_variant(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a haiku about the sea.\nList three colors.\nName a fruit.\n")
    out = tmp_path / "out"
    args = load.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
         "--max-new-tokens", "10", "--concurrency", "1,4", "--duration", "1", "-k", "2", "--out", str(out)])
    assert load.main_with(args) == 0

    report = json.loads((out / "load.json").read_text())
    assert set(report["cells"]) == {"1", "4"}
    for streams, by_variant in report["cells"].items():
        assert set(by_variant) == set(load.VARIANTS)
        for name, row in by_variant.items():
            assert row["requests"] >= int(streams) and row["failed"] == 0, (streams, name)
            assert row["same_as_target"] == row["checked"] >= row["requests"], (streams, name)
            assert row["tokens"] > 0 and row["tokens_per_s"] > 0
        assert by_variant["target"]["draft_tokens_per_round"] == 0
        assert by_variant["fixed"]["draft_tokens_per_round"] > 0
        assert by_variant["fixed"]["draft_ms_per_round"] > 0 and by_variant["fixed"]["verify_ms_per_round"] > 0
        assert by_variant["target"]["verify_ms_per_round"] > 0
        assert by_variant["unbatched"]["mean_batch_rows"] == 1.0
    assert report["cells"]["4"]["target"]["mean_batch_rows"] > 1
    assert (out / "load.png").stat().st_size > 0
    assert "| 4 | adaptive |" in (out / "load.md").read_text()


def test_unseen_sends_no_request_a_prompt_sent_before(tiny_pair, tmp_path):
    """--unseen: no request may find its prompt in the verifier's prefix cache or its
    answer in the memory of outputs, so each cell's prompts follow every earlier cell's."""
    target, draft, _ = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Name a color, number {i}.\n" for i in range(4000)))
    out = tmp_path / "out"
    args = load.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens", "6",
         "--concurrency", "1,3", "--duration", "1", "--variants", "target,fixed", "--unseen", "--out", str(out)])
    assert load.main_with(args) == 0

    report = json.loads((out / "load.json").read_text())
    assert report["meta"]["unseen"] and report["meta"]["repeated"] == 0
    earlier: set[int] = set()
    for streams in ("1", "3"):
        for variant, row in report["cells"][streams].items():
            sent = set(row["prompts_sent"])
            assert len(sent) >= int(streams) and not sent & earlier, (streams, variant)
            earlier |= sent
            assert row["same_as_target"] == row["checked"]
