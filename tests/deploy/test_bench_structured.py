"""`specdec bench structured` as a smoke test on the tiny pair: schema prompts through
real services with the defaults, at K = 0 under the same schema and at K = 0 free; the
first two give the same tokens, under load as well, and the report is written. Not a
timing test."""

import json

from deploy.bench import harness, structured


def test_bench_structured_runs_each_prompt_three_ways(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    args = structured.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--limit", "4", "--max-new-tokens", "16", "--out", str(out),
         "--concurrency", "2"])
    assert structured.main_with(args) == 0
    report = json.loads((out / "structured.json").read_text())
    rows = report["rows"]
    assert len(rows) == 4 and {r["task"] for r in rows} == {"extract", "call"}
    for row in rows:
        assert row["same"] and set(row["runs"]) == {"defaults", "k0", "k0-free"}
        assert row["target_alone"]  # K = 0 under the schema is the target's own generate under it
        assert row["runs"]["defaults"]["text"].startswith("{")  # under the schema
        if row["finish"] == "FINISH_REASON_STOP":
            assert row["valid"]
    assert set(report["summary"]) == {"extract", "call", "all"}
    # Under load: a pass of each, every output the sequential K = 0 one's.
    assert [p["variant"] for p in report["load"]] == ["defaults", "k0"]
    assert all(p["same"] == 4 and p["tokens"] == sum(len(r["runs"]["k0"]["tokens"]) for r in rows)
               for p in report["load"])
    text = (out / "structured.md").read_text()
    assert "| all | 4 |" in text and "under load: every prompt from 2 clients" in text
    assert report["summary"]["all"]["target_alone"] == 4


def test_the_workload_is_32_prompts_with_valid_schemas():
    import jsonschema

    rows = structured.read_workload(harness.STRUCTURED_PROMPTS, None)
    assert len(rows) == 32 and sum(r["task"] == "call" for r in rows) == 16
    for row in rows:
        jsonschema.Draft202012Validator.check_schema(row["schema"])
        assert not list(unbounded(row["schema"])), row["prompt"]  # a loop ends within the schema, not at the cap


def unbounded(node):
    """The strings without maxLength and lists without maxItems in a schema."""
    if isinstance(node, dict):
        if node.get("type") == "string" and "maxLength" not in node \
                or node.get("type") == "array" and "maxItems" not in node:
            yield node
        for value in node.values():
            yield from unbounded(value)
    elif isinstance(node, list):
        for value in node:
            yield from unbounded(value)
