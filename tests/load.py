"""Many concurrent streaming Generate calls from one event loop, for load tests."""

import asyncio

import grpc

from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc


async def stream(stub, ids, k, cancel_after: int | None = None, new_tokens: int = 24):
    """One Generate call: ('ok', tokens, results seen) | ('cancelled',) | (status code name,)."""
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens,
                                            num_speculative_tokens=k), timeout=120)
    tokens, results, chunks = [], [], 0
    try:
        async for event in call:
            if event.HasField("chunk"):
                tokens.extend(event.chunk.token_ids)
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
                    return ("cancelled",)
            else:
                results.append(event.result)
    except grpc.aio.AioRpcError as err:
        return (err.code().name,)
    return ("ok", tokens, results)


def run_clients(address: str, plan: list[tuple], concurrency: int) -> list[tuple]:
    """Runs plan[i] = (ids, k, cancel_after) with `concurrency` calls in flight at a time."""

    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            limit = asyncio.Semaphore(concurrency)

            async def one(item):
                async with limit:
                    return await stream(stub, *item)

            return await asyncio.gather(*(one(item) for item in plan))

    return asyncio.run(go())
