"""A model directory that borrows tensors and the tokenizer from another model
(borrowed.json) is assembled once into the cache and loaded like any model; changing
any of its files gives a new assembly, never a stale one."""

import json

import torch
from safetensors.torch import save_file

from specdec import model_files
from specdec.runtime import modeling


def test_borrowing_directory_is_assembled_and_follows_its_files(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    target_dir, _, target = tiny_pair
    partial = tmp_path / "partial"
    partial.mkdir()
    state = {k: v.contiguous() for k, v in target.state_dict().items() if k != "model.embed_tokens.weight"}
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(target.config.to_dict()))
    (partial / "borrowed.json").write_text(json.dumps(
        {"from": str(target_dir), "tensors": ["model.embed_tokens.weight"], "tokenizer": True}))
    (partial / "draft_vocab.json").write_text(json.dumps({"token_ids": [0, 2, 5, 7]}))

    first = model_files.resolve(str(partial))
    assert first == model_files.resolve(str(partial))  # cached
    model, tokenizer = modeling.load_model(str(partial))
    assert model_files.vocab_fingerprint(tokenizer) == model_files.vocab_fingerprint(model_files.load_tokenizer(str(target_dir)))
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, target(ids).logits, atol=1e-5)
    assert modeling.restrict_output(model, str(partial)).tolist() == [0, 2, 5, 7]

    (partial / "draft_vocab.json").write_text(json.dumps({"token_ids": [0, 2, 5]}))
    assert model_files.resolve(str(partial)) != first
    model, _ = modeling.load_model(str(partial))
    assert modeling.restrict_output(model, str(partial)).tolist() == [0, 2, 5]


def test_a_files_digest_is_read_once_while_it_stays_as_it_was(tmp_path, monkeypatch):
    """A start names a GGUF file several times (its tokenizer, its model, its blocks):
    its content is hashed once, and again only where the file changed."""
    import hashlib

    from specdec import cache, model_files

    reads, sha256 = [], hashlib.sha256

    def counted(*args):
        reads.append(1)
        return sha256(*args)

    monkeypatch.setattr(cache.hashlib, "sha256", counted)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(4096))
    first = model_files._file_digest(path)
    assert model_files._file_digest(path) == first and len(reads) == 1
    path.write_bytes(b"GGUF" + bytes(4097))
    assert model_files._file_digest(path) != first and len(reads) == 2
