"""Prometheus metrics of the three services during known traffic: the counters equal
what the requests' own Results report, and a real Prometheus server scraping them
computes the same acceptance rate with PromQL (skipped, saying why, where there is no
`prometheus` binary: `make test` installs Debian's package where apt is available)."""

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, drafter, eventually, generate, orchestrator, pb, verifier
from deploy.launch import HOST, free_port

PROMPTS = ["Counting sheep", "The harbour at dawn", "Instructions for a kite", "Notes on the weather"]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics endpoint."""
    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def metered(tiny_pair, smol_tokenizer):
    """A deployment whose three services serve metrics, after known traffic: (cluster,
    services, metrics ports, the Results of the traffic)."""
    target_dir, draft_dir, _ = tiny_pair
    ports = {name: free_port() for name in ("verifier", "drafter", "orchestrator")}
    v = verifier(target_dir, "metered-verifier", extra=["--metrics-port", str(ports["verifier"])])
    d = drafter(draft_dir, "metered-drafter", extra=["--metrics-port", str(ports["drafter"])])
    cluster = Cluster()
    cluster.start(v, d)
    o = orchestrator(v, [d], target_dir, "metered-orchestrator", extra=["--metrics-port", str(ports["orchestrator"])])
    cluster.start(o)
    stub = cluster.orchestrator_stub(o)
    results = []
    for i, prompt in enumerate(PROMPTS * 3):
        ids = smol_tokenizer(prompt)["input_ids"]
        results.append((len(ids), generate(stub, token_ids=pb.TokenIds(ids=ids), max_new_tokens=30,
                                           num_speculative_tokens=1 + i % 4)[1]))
    for service in (v, d):  # the sessions close right after each Result
        eventually(lambda: not cluster.sessions(service))
    yield cluster, {"verifier": v, "drafter": d, "orchestrator": o}, ports, results
    cluster.close()


def test_counters_equal_what_the_results_report(metered):
    cluster, services, ports, results = metered
    o, v, d = (scrape(ports[name]) for name in ("orchestrator", "verifier", "drafter"))
    stats = [r.stats for _, r in results]
    assert value(o, "specdec_requests_total", outcome="ok", code="OK") == len(results)
    assert value(o, "specdec_prompt_tokens_total") == sum(n for n, _ in results)
    assert value(o, "specdec_generation_tokens_total") == sum(len(r.token_ids) for _, r in results)
    assert value(o, "specdec_rounds_total") == sum(s.rounds for s in stats)
    assert value(o, "specdec_spec_decode_num_draft_tokens_total") == sum(s.draft_tokens for s in stats) > 0
    assert value(o, "specdec_spec_decode_num_accepted_tokens_total") == sum(s.accepted_tokens for s in stats) > 0
    for position in range(4):
        assert value(o, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == sum(
            s.accepted_per_position[position] for s in stats if len(s.accepted_per_position) > position)
    assert value(o, "specdec_num_speculative_tokens_count") == sum(s.rounds for s in stats)
    assert value(o, "specdec_time_to_first_token_seconds_count") == len(results)
    assert value(o, "specdec_request_latency_seconds_count") == len(results)
    assert value(o, "specdec_verifier_call_seconds_count") == sum(s.rounds for s in stats)
    assert value(o, "specdec_drafter_replicas", healthy="true") == 1
    # The services: every round was a pass row on the verifier; no session is left open.
    assert value(v, "specdec_batch_rows_sum", service="verifier") >= sum(s.rounds for s in stats)
    assert value(d, "specdec_batch_pass_seconds_count", service="drafter") > 0
    for samples, service in ((v, "verifier"), (d, "drafter")):
        assert value(samples, "specdec_batch_pass_seconds_count", service=service) > 0
        assert value(samples, "specdec_open_sessions", service=service) == 0
        assert value(samples, "specdec_kv_blocks_used", service=service) == 0
        assert value(samples, "specdec_kv_blocks_capacity", service=service) > 0
        assert value(samples, "process_resident_memory_bytes") > 0


def test_a_refused_request_is_counted_by_its_code(metered):
    import grpc

    cluster, services, ports, _ = metered
    before = value(scrape(ports["orchestrator"]), "specdec_requests_total", outcome="error", code="INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError):
        generate(cluster.orchestrator_stub(services["orchestrator"]), text="hi", top_p=2.0)
    after = value(scrape(ports["orchestrator"]), "specdec_requests_total", outcome="error", code="INVALID_ARGUMENT")
    assert after == before + 1


def promql(port: int, query: str) -> float:
    url = f"http://{HOST}:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    answer = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert answer["status"] == "success", answer
    (result,) = answer["data"]["result"]
    return float(result["value"][1])


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="no prometheus binary (Debian: apt-get install prometheus; make test installs it as root)")
def test_prometheus_computes_the_acceptance_rate_the_results_report(metered, tmp_path):
    cluster, services, ports, results = metered
    want = sum(r.stats.accepted_tokens for _, r in results) / sum(r.stats.draft_tokens for _, r in results)
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n" + "".join(
        f"  - job_name: {name}\n    static_configs:\n      - targets: ['{HOST}:{port}']\n"
        for name, port in ports.items()))
    port = free_port()
    server = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address={HOST}:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        query = ("sum(specdec_spec_decode_num_accepted_tokens_total) / "
                 "sum(specdec_spec_decode_num_draft_tokens_total)")
        deadline = time.monotonic() + 60
        while True:
            try:
                up = promql(port, 'count(up{job=~"verifier|drafter|orchestrator"} == 1)')
                if up == 3:
                    got = promql(port, query)
                    break
            except (OSError, ValueError, AssertionError):
                pass
            assert server.poll() is None, server.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "Prometheus never scraped the three services"
            time.sleep(0.5)
        assert got == pytest.approx(want, rel=1e-9), (got, want)
        print(f"PromQL acceptance rate {got:.4f}, from the Results {want:.4f}")
    finally:
        server.terminate()
        server.wait(10)


def test_specdec_top_shows_the_traffic(metered, smol_tokenizer):
    from deploy import top

    cluster, services, ports, _ = metered
    urls = [f"http://{HOST}:{ports[name]}/metrics" for name in ("orchestrator", "verifier", "drafter")]
    before = {url: top.scrape(url) for url in urls}
    started = time.monotonic()
    stats = []
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        stats.append(generate(cluster.orchestrator_stub(services["orchestrator"]), token_ids=pb.TokenIds(ids=ids),
                              max_new_tokens=20, num_speculative_tokens=3)[1].stats)
    now = {url: top.scrape(url) for url in urls}
    screen = top.frame(urls, before, now, time.monotonic() - started)
    print(screen)
    rate = sum(s.accepted_tokens for s in stats) / sum(s.draft_tokens for s in stats)
    assert f"accepted   {rate:.2f} of drafts" in screen
    assert f" over {sum(s.rounds for s in stats)} rounds" in screen
    assert "verifier" in screen and "drafter" in screen and "0 sessions" in screen
    # The orchestrator's view of its one verifier replica: every request was routed to it,
    # and so was the warm-up's session.
    routed = top.total(now[urls[0]], "specdec_verifier_routed_total")
    assert routed - 1 == top.total(now[urls[0]], "specdec_requests_total", outcome="ok") >= len(PROMPTS)
    assert re.search(rf"verifier   {services['verifier'].address}: \d+ sessions, \d+ free KV blocks; routed "
                     rf"\d+ by prefix, \d+ by load", screen), screen
