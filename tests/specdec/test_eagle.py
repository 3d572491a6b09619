"""EAGLE-3 heads: the drafter's batched steps compute what training's unrolled pass
computes (so a head drafts as it was trained), and heads in the ecosystem's formats load."""

import json

import pytest
import torch

from specdec.runtime import eagle

LAYER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "rms_norm_eps": 1e-5, "vocab_size": 50, "max_position_embeddings": 512,
         "rope_theta": 10000.0, "hidden_act": "silu"}


def tiny_head(window: int = 64, seed: int = 0, draft_vocab: int = 20) -> eagle.Eagle3Head:
    torch.manual_seed(seed)
    config = eagle.HeadConfig(layer=dict(LAYER), draft_vocab=draft_vocab, target_hidden=24,
                              aux_layers=(1, 2, 3), window=window)
    head = eagle.Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        head.d2t.copy_(torch.randperm(50)[:draft_vocab].sort().values - torch.arange(draft_vocab))
    return head.eval()


@pytest.mark.parametrize("window", [64, 5])
def test_drafting_steps_compute_the_unrolled_training_pass(window):
    """A chain drafted from index i (real inputs up to i in the cache, then the head's own
    outputs) gives the outputs training's unrolled pass gives at i, step by step; rows of
    several sessions in one pass give what each gives alone."""
    head = tiny_head(window)
    length, steps = 12, 3
    tokens = torch.randint(0, 50, (1, length))
    features = torch.randn(1, length, 72)
    with torch.no_grad():
        unrolled = head.unrolled(tokens, features, steps)
    for i in (0, 4, 8):
        cache = eagle.HeadCache()
        (g,), _ = head.step([(cache, tokens[0, :i + 1], features[0, :i + 1], 0, True)])
        torch.testing.assert_close(g, unrolled[0][0, i], rtol=1e-4, atol=1e-5)
        for j in range(1, steps):
            (g,), _ = head.step([(cache, tokens[0, i + j:i + j + 1], g[None], i + j, False)])
            torch.testing.assert_close(g, unrolled[j][0, i], rtol=1e-4, atol=1e-5)
        cache.crop(i + 1)
        assert cache.end == i + 1
    # Two sessions in one pass, each as alone.
    a, b = eagle.HeadCache(), eagle.HeadCache()
    (ga, gb), (la, lb) = head.step([(a, tokens[0, :7], features[0, :7], 0, True),
                                    (b, tokens[0, :3], features[0, :3], 0, True)])
    torch.testing.assert_close(ga, unrolled[0][0, 6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gb, unrolled[0][0, 2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lb, head.logits(unrolled[0][0, 2]), rtol=1e-4, atol=1e-5)


def test_a_cache_keeps_its_window_and_drops_a_rounds_drafts():
    head = tiny_head(window=4)
    cache = eagle.HeadCache()
    tokens, features = torch.randint(0, 50, (10,)), torch.randn(10, 72)
    head.step([(cache, tokens[:6], features[:6], 0, True)])
    assert (cache.first, cache.end, cache.k.shape[1]) == (2, 6, 4)
    (g,), _ = head.step([(cache, tokens[6:7], torch.randn(1, 32), 6, False)])
    assert cache.end == 7 and cache.k.shape[1] == 5  # a draft's entry, until the round crops it
    cache.crop(6)
    assert (cache.first, cache.end, cache.k.shape[1]) == (2, 6, 4)
    with pytest.raises(ValueError, match="cache ends at 6"):
        head.step([(cache, tokens[8:9], features[8:9], 8, True)])


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_a_head_in_the_ecosystems_formats_loads(tmp_path, layout):
    """A head written as SpecForge writes one (midlayer.*) and as speculators does
    (layers.0.*, the layer's config nested), with t2d beside d2t: it loads and drafts
    the same tokens as the head it was written from."""
    from safetensors.torch import save_file

    head = tiny_head()
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[head.token_ids] = True
    state["t2d"] = t2d
    if layout == "specforge":
        config = dict(LAYER, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=20, target_hidden_size=24,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    else:
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": dict(LAYER, model_type="llama"), "draft_vocab_size": 20,
                  "target_hidden_size": 24, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    assert eagle.is_head(tmp_path)
    loaded = eagle.load_head(tmp_path)
    assert loaded.aux_layers == (1, 2, 3)
    assert torch.equal(loaded.token_ids, head.token_ids)
    tokens, features = torch.randint(0, 50, (6,)), torch.randn(6, 72)
    (_,), (want,) = head.step([(eagle.HeadCache(), tokens, features, 0, True)])
    (_,), (got,) = loaded.step([(eagle.HeadCache(), tokens, features, 0, True)])
    torch.testing.assert_close(got, want)


def test_a_head_that_misses_weights_is_refused_naming_them(tmp_path):
    from safetensors.torch import save_file

    head = tiny_head()
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.") and k != "fc.weight"}
    (tmp_path / "config.json").write_text(json.dumps(dict(LAYER, architectures=["LlamaForCausalLMEagle3"],
                                                          draft_vocab_size=20, target_hidden_size=24)))
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="fc.weight"):
        eagle.load_head(tmp_path, target_layers=6)


def test_save_and_load_round_trip(tmp_path):
    head = tiny_head()
    eagle.save_head(head, tmp_path, dtype=torch.float32)
    loaded = eagle.load_head(tmp_path)
    assert loaded.window == head.window and loaded.aux_layers == head.aux_layers
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
