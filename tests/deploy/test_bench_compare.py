"""`specdec bench compare` as a smoke test on the tiny pair: the variants of the model draft
run (the gRPC ones through real services; `ngram` and `hybrid` are the same calls to
deployments of other drafters), all outputs are written, and every variant's tokens
agree with the target alone. Not a timing test: the figures are only checked for sanity."""

import json

from deploy.bench import compare, harness

VARIANTS = tuple(v for v in compare.VARIANTS if v not in ("ngram", "hybrid"))


def test_bench_runs_every_variant_and_they_agree(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two categories\n[chat]\nWrite a haiku about the sea.\n[text raw]\nThe sea is\n")
    out = tmp_path / "out"
    args = compare.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
         "--max-new-tokens", "12", "-k", "3", "--quantize", "none,int8", "--variants", ",".join(VARIANTS),
         "--out", str(out)])
    assert compare.main_with(args) == 0

    report = json.loads((out / "compare.json").read_text())
    variants = report["summary"]["variants"]
    assert set(variants) == set(VARIANTS) | {f"{v}-int8" for v in VARIANTS}
    for name, row in variants.items():
        # Each against the target with its own numerics. Transformers' assisted generation
        # is theirs: in int8 it can part from the target (seen in CI), and is only reported.
        assert row["same_tokens_as_target"] or row["variant"] == "assisted", name
        assert row["runs"] == 2 and row["tokens"] > 0 and row["tokens_per_s_median"] > 0, name
        assert set(row["speedup_by_category"]) == {"chat", "text"}, name
        assert ("speedup_vs_fp32_target" in row) == name.endswith("-int8"), name

    for name in ("inprocess", "grpc"):
        row = variants[name]
        assert row["rounds"] > 0 and len(row["acceptance_per_position"]) == 3
        assert 0 <= row["acceptance"] <= 1 and row["bound"] > 0
    # The in-process loop and the services run the same round: same acceptance, with
    # or without drafting ahead.
    assert variants["inprocess"]["acceptance"] == variants["grpc"]["acceptance"] == variants["overlap"]["acceptance"]
    assert variants["overlap"]["lookaheads"] > 0 and "lookaheads" not in variants["grpc"]
    assert 0 < report["summary"]["c"] and 0 < report["summary"]["verify_cost"]
    for name in ("inprocess", "grpc", "overlap"):
        row = variants[name]
        assert 0 < row["drafter_s_per_round"] and 0 < row["verifier_s_per_round"]
        assert row["drafter_s_per_round"] + row["verifier_s_per_round"] < row["round_s"]
    table = (out / "compare.md").read_text()
    assert all(f"| {name} |" in table for name in VARIANTS)
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_file_categories(tmp_path, smol_tokenizer):
    path = tmp_path / "prompts.txt"
    path.write_text("# a comment\nno category yet\n[code]\nFix this:\\n  x = 1\n[text raw]\nOnce upon\n")
    prompts = harness.read_prompts(path)
    assert [(p.category, p.text, p.raw) for p in prompts] == [
        ("prompts", "no category yet", False), ("code", "Fix this:\n  x = 1", False), ("text", "Once upon", True)]
    assert prompts[2].encode(smol_tokenizer) == smol_tokenizer("Once upon")["input_ids"]
    chat = prompts[1].encode(smol_tokenizer)
    decoded = smol_tokenizer.decode(chat)
    assert decoded.count("<|im_start|>") >= 2 and "Fix this:\n  x = 1" in decoded
