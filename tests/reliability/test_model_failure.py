"""A forward pass that raises half-way (out of memory, a bug) after earlier layers wrote
their keys and values: the verifier answers INTERNAL and drops the session, the next
call resyncs and is exact, and the service keeps serving. In one process: the verifier's
servicer on a real gRPC server and engine, with one layer of the model made to fail once."""

import asyncio

import grpc
import pytest
import torch

from cluster import as_tested, reference
from specdec.runtime import modeling
from specdec.api.common.v1 import common_pb2
from specdec.runtime.engine import Engine
from specdec.errors import RESYNC_DETAIL
from specdec.sessions import SessionStore
from specdec.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.server import VerifierServicer

GREEDY = common_pb2.SamplingParams(top_p=1.0)


def failing_once(module):
    """Makes `module` raise on its next call (once)."""
    forward = module.forward

    def fail(*args, **kwargs):
        module.forward = forward
        raise RuntimeError("CUDA out of memory (injected)")

    module.forward = fail


@pytest.mark.parametrize("where", [0, 1])  # the first layer, or the last after the first wrote its cache
def test_a_forward_that_raises_drops_the_session_and_the_next_call_is_exact(tiny_pair, smol_tokenizer, where):
    target_dir = tiny_pair[0]
    torch.set_grad_enabled(False)
    model, tokenizer = modeling.load_model(str(target_dir))
    model = as_tested(model)
    ids = smol_tokenizer("Once upon a time, in a land far away")["input_ids"]
    want = reference(as_tested(modeling.load_model(str(target_dir))[0]), ids, 12)

    async def go():
        engine = Engine(model, 64 * 2 ** 20)
        servicer = VerifierServicer()
        servicer.ready(modeling.model_info(model, tokenizer, "tiny", "target"),
                       SessionStore(engine.new_sequence, 8, 60.0, release=engine.release))
        server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)

        async def verify(start, new, drafts=()):
            return await stub.Verify(verifier_pb2.VerifyRequest(session_id="s1", start=start, new_tokens=new,
                                                                draft_tokens=drafts, sampling=GREEDY), timeout=30)

        try:
            first = await verify(0, ids)
            assert first.next_token == want[0]
            failing_once(model.model.layers[where].mlp)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verify(len(ids), [want[0]], want[1:4])
            assert err.value.code() == grpc.StatusCode.INTERNAL and RESYNC_DETAIL in err.value.details()
            assert "out of memory" in err.value.details()
            listed = await stub.ListSessions(verifier_pb2.ListSessionsRequest())
            assert not listed.sessions  # dropped, not kept with its cache in doubt
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verify(len(ids) + 1, [], want[1:4])
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # The resync: the whole history again, and the round is the target's.
            again = await verify(0, ids + want[:1], want[1:4])
            assert (again.num_accepted, again.next_token) == (3, want[4])
            history = ids + want[:5]
            for i in range(5, 12):  # and so are the rounds after it
                step = await verify(len(history) - 1, history[-1:])
                assert step.next_token == want[i]
                history.append(step.next_token)
        finally:
            await channel.close()
            await server.stop(0)
            engine.stop()

    asyncio.run(go())
