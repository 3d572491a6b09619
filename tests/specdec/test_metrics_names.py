"""The metrics the services export, against what the table of docs/reference.md and the
Grafana dashboard name: no query or row refers to a metric that does not exist."""

import json
import re
from pathlib import Path

from specdec.metrics import EngineMetrics, OrchestratorMetrics

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exported() -> dict[str, set[str]]:
    """{metric family name: its label names} over the three services."""
    out = {}
    for metrics in (OrchestratorMetrics(), EngineMetrics("verifier"), EngineMetrics("drafter")):
        for family in metrics.registry.collect():
            if family.name.startswith("specdec_"):
                out[family.name] = set().union(*(s.labels for s in family.samples)) if family.samples else set()
    return out


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_dashboard_query_names_exported_metrics():
    names = exported()
    dashboard = json.loads((ROOT / "deploy/grafana/specdec.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"specdec_[a-z_]+", target["expr"]):
                assert family(metric) in names, (panel["title"], metric)
                queried.add(family(metric))
    assert {"specdec_spec_decode_num_accepted_tokens", "specdec_time_to_first_token_seconds",
            "specdec_batch_rows"} <= queried


def test_the_reference_table_lists_every_metric():
    reference = (ROOT / "docs/reference.md").read_text()
    table = {family(name) for name in re.findall(r"^\| `(specdec_[a-z_]+)` \|", reference, flags=re.M)}
    assert table == set(names := exported()), (set(names) - table, table - set(names))
