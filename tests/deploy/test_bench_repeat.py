"""`specdec bench repeat` as a smoke test on the tiny pair: the templated requests run
through real services with the memory of outputs on and off, every pair of outputs
(defaults, K = 0) is equal, and the report is written. Not a timing test."""

import json

from deploy.bench import repeat


def test_bench_repeat_replays_the_templates_with_the_memory_on_and_off(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    args = repeat.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--requests", "5", "--max-new-tokens", "8",
         "--compare-memory-off", "--out", str(out)])
    assert repeat.main_with(args) == 0
    report = json.loads((out / "repeat.json").read_text())
    assert set(report["runs"]) == {"on", "off"}
    for run in report["runs"].values():
        assert [row["request"] for row in run["rows"]] == list(range(5))
        assert all(row["same"] and row["tokens"] > 0 for row in run["rows"])
        assert run["summary"]["first_tenth"]["requests"] == 1 and run["summary"]["rest"]["requests"] == 4
    assert "| off, the rest | 4 |" in (out / "repeat.md").read_text()


def test_a_control_run_sends_both_of_each_pair_at_k0(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    args = repeat.build_parser().parse_args(
        ["--target", str(target), "--draft", str(draft), "--requests", "3", "--max-new-tokens", "8", "--control",
         "--out", str(out)])
    assert repeat.main_with(args) == 0
    report = json.loads((out / "repeat.json").read_text())
    assert report["meta"]["control"]
    assert all(row["same"] and row["drafted"] == 0 and row["rounds"] == row["tokens"]
               for row in report["runs"]["on"]["rows"])
    assert "a control" in (out / "repeat.md").read_text()


def test_the_workload_cycles_the_templates_with_a_new_fill_each_pass():
    prompts = repeat.workload(["A {name}", "B {city} {lname}"], 5)
    assert prompts == ["A Alice", "B Lisbon alice", "A Bruno", "B Oslo bruno", "A Chen"]
