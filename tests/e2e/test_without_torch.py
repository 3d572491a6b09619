"""The orchestrator never runs a model: every one of its modules imports, and it serves
a request end to end (text, chat, a JSON schema, log-probabilities, speculation on), in
a process where torch cannot be imported. Its output is the target alone's."""

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import PY, Cluster, drafter, generate, orchestrator, pb, reference, verifier
from e2e.test_constraints import CONSTRAINTS, MAX_NEW, PROMPTS, constrained_reference
from specdec import grammar

ROOT = Path(__file__).resolve().parents[2]
# The first lines of a process in which `import torch` (and so every module that imports
# it) raises ImportError.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; "


def test_every_orchestrator_module_imports_without_torch():
    code = WITHOUT_TORCH + (
        "import importlib, pkgutil, orchestrator\n"
        "names = [m.name for m in pkgutil.walk_packages(orchestrator.__path__, 'orchestrator.')"
        " if not m.name.endswith('__main__')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(len(names))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = [f for f in (ROOT / "orchestrator").glob("*.py") if f.stem not in ("__init__", "__main__")]
    assert int(done.stdout) == len(modules)  # all of them


@pytest.fixture(scope="module")
def without_torch(tiny_pair):
    """A verifier and a drafter as usual, and an orchestrator in a process without torch."""
    target_dir, draft_dir, _ = tiny_pair
    cluster = Cluster()
    v, d = verifier(target_dir), drafter(draft_dir)
    o = orchestrator(v, [d], target_dir, "orchestrator-without-torch")
    assert o.argv[:3] == [*PY, "orchestrator"]
    o.argv[:3] = [sys.executable, "-c", WITHOUT_TORCH + "from orchestrator.server import main; main()"]
    try:
        cluster.start(v, d, o)
        yield cluster.orchestrator_stub(o)
    finally:
        cluster.close()


def test_an_orchestrator_without_torch_serves_the_targets_tokens(without_torch, tiny_pair, smol_tokenizer):
    _, _, target = tiny_pair
    ids = smol_tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    _, result = generate(without_torch, token_ids=pb.TokenIds(ids=ids), max_new_tokens=24, num_speculative_tokens=3,
                         logprobs=True, top_logprobs=2)
    assert list(result.token_ids) == reference(target, ids, 24)
    assert result.stats.draft_tokens > 0  # the rounds drafted: the drafter took part
    _, by_text = generate(without_torch, text="The quick brown fox jumps over the lazy dog.", max_new_tokens=8)
    assert list(by_text.token_ids) == reference(target, ids, 8)


def test_an_orchestrator_without_torch_follows_a_schema(without_torch, tiny_pair, smol_tokenizer):
    """The grammar's forced tokens drafted, the drafts cut at a forbidden one: the
    orchestrator's side of a constraint, against the target alone under it."""
    ids = smol_tokenizer(PROMPTS[0])["input_ids"]
    want = constrained_reference(tiny_pair[2], grammar.Vocabulary(smol_tokenizer, len(smol_tokenizer), [2]),
                                 CONSTRAINTS["json_schema"], ids, MAX_NEW)
    _, result = generate(without_torch, token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                         num_speculative_tokens=4, constraint=CONSTRAINTS["json_schema"])
    assert list(result.token_ids) == want
    assert result.stats.draft_tokens > 0
