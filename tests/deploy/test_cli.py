"""`specdec generate` when the stream breaks off: one line that says so, not a traceback."""

import argparse

import pytest

from deploy import cli
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc


class Cut:
    """The orchestrator's stub, standing in: a chunk, then the stream ends without its result."""

    def __init__(self, channel):
        pass

    def Generate(self, request, **kwargs):
        yield pb.GenerateResponse(chunk=pb.Chunk(text="Half a sen"))


def test_a_stream_without_its_result_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(orchestrator_pb2_grpc, "OrchestratorServiceStub", Cut)
    args = argparse.Namespace(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, stop=None, raw=True,
                              prompt="hi", seed=None, k=None, address="127.0.0.1:1", wait=0, timeout=5,
                              token="", tls_ca="", tls_cert="", tls_key="", json_schema=None, json_object=False,
                              regex=None, lark=None, gbnf=None)
    assert cli.generate(args) == 1
    out, err = capsys.readouterr()
    assert out.startswith("Half a sen") and "ended without its result" in err


def test_ray_up_without_ray_says_what_to_install(monkeypatch, capsys):
    """(Before: a ModuleNotFoundError traceback.)"""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as where the ray extra is not installed
    monkeypatch.delitem(sys.modules, "deploy.ray.launcher", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["ray", "up"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Ray is not installed" in err and "pip install 'specdec[ray]'" in err


def test_the_orchestrators_earlier_verifier_flag_still_works():
    """--verifier, the flag the earlier CLI had, is --verifiers' alias. (Before: "ambiguous
    option: --verifier could match --verifiers, --verifier-dns, --verifier-ray".)"""
    from orchestrator.server import build_parser

    assert build_parser().parse_args(["--verifier", "127.0.0.1:7"]).verifiers == "127.0.0.1:7"
