"""What one round costs on the wire: `specdec bench wire`.

A server process answers the round's two calls with canned replies (no model), so what
is timed is gRPC, protobuf and the event loops on both sides, over loopback:

  calls     today's round: Propose, its K drafts in one message, then a unary Verify
  per-draft the same, the drafts in K messages of one (as Propose sent them before)
  streams   the same messages as `calls` over two long-lived bidirectional streams per
            session (one request and its reply per round on each)

for greedy rounds (token ids only) and sampled ones (each draft with a sparse q of
--support entries). Prints milliseconds per round (median and p90) for each; writes
wire.json and wire.md to --out."""

import argparse
import asyncio
import multiprocessing
import statistics
import time
from pathlib import Path

import grpc

from deploy.bench import harness
from deploy.launch import HOST
from specdec.api.common.v1 import common_pb2
from specdec.api.drafter.v1 import drafter_pb2
from specdec.api.verifier.v1 import verifier_pb2

SERVICE = "specdec.bench.Wire"


def _q(support: int) -> list[common_pb2.SparseDistribution]:
    return [common_pb2.SparseDistribution(token_ids=range(support), probs=[1.0 / support] * support)] if support else []


def _drafts(k: int, support: int) -> drafter_pb2.ProposeResponse:
    return drafter_pb2.ProposeResponse(token_ids=[100 + i for i in range(k)], qs=_q(support) * k)


def _handlers(k: int, support: int):
    drafts = _drafts(k, support)
    singles = [drafter_pb2.ProposeResponse(token_ids=[100 + i], qs=_q(support)) for i in range(k)]
    verdict = verifier_pb2.VerifyResponse(num_accepted=k // 2, next_token=7)

    async def propose(request, context):
        yield drafts

    async def propose_singles(request, context):
        for draft in singles:
            yield draft

    async def verify(request, context):
        return verdict

    async def propose_stream(requests, context):
        async for request in requests:
            yield drafts

    async def verify_stream(requests, context):
        async for request in requests:
            yield verdict

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Propose": grpc.unary_stream_rpc_method_handler(
            propose, drafter_pb2.ProposeRequest.FromString, drafter_pb2.ProposeResponse.SerializeToString),
        "ProposeSingles": grpc.unary_stream_rpc_method_handler(
            propose_singles, drafter_pb2.ProposeRequest.FromString, drafter_pb2.ProposeResponse.SerializeToString),
        "Verify": grpc.unary_unary_rpc_method_handler(
            verify, verifier_pb2.VerifyRequest.FromString, verifier_pb2.VerifyResponse.SerializeToString),
        "ProposeStream": grpc.stream_stream_rpc_method_handler(
            propose_stream, drafter_pb2.ProposeRequest.FromString, drafter_pb2.ProposeResponse.SerializeToString),
        "VerifyStream": grpc.stream_stream_rpc_method_handler(
            verify_stream, verifier_pb2.VerifyRequest.FromString, verifier_pb2.VerifyResponse.SerializeToString),
    })


def _serve(port_out, k: int, support: int) -> None:
    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([_handlers(k, support)])
        port = server.add_insecure_port(f"{HOST}:0")
        await server.start()
        port_out.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _requests(k: int, support: int):
    sampling = common_pb2.SamplingParams(temperature=0.7 if support else 0.0, top_p=1.0)
    propose = drafter_pb2.ProposeRequest(session_id="s", start=100, new_tokens=[1, 2, 3], num_draft_tokens=k,
                                         sampling=sampling)
    qs = _q(support) * k
    verify = verifier_pb2.VerifyRequest(session_id="s", start=100, new_tokens=[1, 2, 3],
                                        draft_tokens=[100 + i for i in range(k)], draft_probs=qs, sampling=sampling)
    return propose, verify


async def _time_rounds(address: str, k: int, support: int, rounds: int) -> dict[str, list[float]]:
    propose_req, verify_req = _requests(k, support)
    async with grpc.aio.insecure_channel(address) as channel:
        propose = channel.unary_stream(f"/{SERVICE}/Propose", drafter_pb2.ProposeRequest.SerializeToString,
                                       drafter_pb2.ProposeResponse.FromString)
        propose_singles = channel.unary_stream(f"/{SERVICE}/ProposeSingles",
                                               drafter_pb2.ProposeRequest.SerializeToString,
                                               drafter_pb2.ProposeResponse.FromString)
        verify = channel.unary_unary(f"/{SERVICE}/Verify", verifier_pb2.VerifyRequest.SerializeToString,
                                     verifier_pb2.VerifyResponse.FromString)
        propose_stream = channel.stream_stream(f"/{SERVICE}/ProposeStream",
                                               drafter_pb2.ProposeRequest.SerializeToString,
                                               drafter_pb2.ProposeResponse.FromString)()
        verify_stream = channel.stream_stream(f"/{SERVICE}/VerifyStream", verifier_pb2.VerifyRequest.SerializeToString,
                                              verifier_pb2.VerifyResponse.FromString)()

        def by_calls(call):
            async def one_round():
                drafts = [t async for run in call(propose_req) for t in run.token_ids]
                assert len(drafts) == k
                await verify(verify_req)
            return one_round

        async def by_streams():
            await propose_stream.write(propose_req)
            assert len((await propose_stream.read()).token_ids) == k
            await verify_stream.write(verify_req)
            await verify_stream.read()

        ways = {"calls": by_calls(propose), "per-draft": by_calls(propose_singles), "streams": by_streams}
        times = {name: [] for name in ways}
        for _ in range(20):  # connections, first-call costs
            for one_round in ways.values():
                await one_round()
        for _ in range(rounds):  # interleaved, so that drift hits all alike
            for name, one_round in ways.items():
                started = time.perf_counter()
                await one_round()
                times[name].append(time.perf_counter() - started)
        await propose_stream.done_writing()
        await verify_stream.done_writing()
        return times


def measure(k: int, support: int, rounds: int) -> dict[str, dict[str, float]]:
    ctx = multiprocessing.get_context("spawn")
    port = ctx.Queue()
    server = ctx.Process(target=_serve, args=(port, k, support), daemon=True)
    server.start()
    try:
        times = asyncio.run(_time_rounds(f"{HOST}:{port.get(timeout=60)}", k, support, rounds))
    finally:
        server.terminate()
        server.join()
    out = {}
    for name, values in times.items():
        values = sorted(values)
        out[name] = {"median_ms": statistics.median(values) * 1e3, "p90_ms": values[int(0.9 * (len(values) - 1))] * 1e3}
    return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or harness.parser_for("wire", __doc__)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--support", type=int, default=64, help="entries of each sparse q when sampling")
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path("wire-out"))
    return parser


def main_with(args) -> int:
    lines = [f"K={args.k}, {args.rounds} rounds each, interleaved; ms per round (median / p90)", "",
             "| rounds | calls (today) | drafts a message each | streams | streams save |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    results = {}
    for label, support in (("greedy", 0), (f"sampled, q of {args.support}", args.support)):
        results[label] = r = measure(args.k, support, args.rounds)
        saved = r["calls"]["median_ms"] - r["streams"]["median_ms"]
        lines.append(f"| {label} | {r['calls']['median_ms']:.2f} / {r['calls']['p90_ms']:.2f} | "
                     f"{r['per-draft']['median_ms']:.2f} / {r['per-draft']['p90_ms']:.2f} | "
                     f"{r['streams']['median_ms']:.2f} / {r['streams']['p90_ms']:.2f} | {saved:.2f} ms |")
        print(lines[-1], flush=True)
    harness.write_report(args.out, "wire", {"meta": {"k": args.k, "support": args.support, "rounds": args.rounds},
                                            "results": results}, "\n".join(lines) + "\n", echo=False)
    return 0
