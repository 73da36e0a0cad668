"""GGUF loading on a synthetic file: dequantization, q/k un-permutation, names, cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kvmesh.model import gguf_loader
from kvmesh.model.gguf_loader import hf_name, load_gguf, unpermute_rope
from kvmesh.model.loader import load_model, load_tokenizer

from .conftest import make_tiny_hf
from .test_tokenizer import tiny_gguf_tokenizer, tiny_tokenizer_meta


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}


def write_gguf(path, hf_model) -> None:
    """Write a tiny HF Llama the way llama.cpp's converter would: Q4_1 linears, Q8_0 embedding."""
    cfg = hf_model.config
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    meta = tiny_tokenizer_meta()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(meta["tokenizer.chat_template"])
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            q8 = GGMLQuantizationType.Q8_0
            w.add_tensor("token_embd.weight", quantize(arr, q8), raw_dtype=q8)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", arr)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            key = _GGUF_NAMES[rest.removesuffix(".weight")]
            gname = f"blk.{layer}.{key}.weight"
            if key == "attn_q":
                arr = llama_cpp_permute(arr, cfg.num_attention_heads)
            elif key == "attn_k":
                arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
            if arr.ndim == 1:
                w.add_tensor(gname, arr)
            else:
                w.add_tensor(gname, quantize(arr, GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gguf")
    ck = make_tiny_hf(folder / "hf", tie=True, init=0.02, vocab=264)
    path = folder / "tiny.gguf"
    write_gguf(path, ck.hf_model)
    return path, ck


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 16, 40)
    for heads in (1, 3):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rope(permuted, heads), w)


def test_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="unexpected"):
        hf_name("blk.0.attn_qkv.weight")


def test_weights_equal_transformers_gguf_loader(tiny_gguf, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, ck = tiny_gguf
    ours = load_gguf(path, cache_dir=tmp_path, progress=False)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ck.hf_model)["tensors"]
    assert set(ours.state_dict) == set(theirs) - {"lm_head.weight"}
    for name, t in theirs.items():
        if name != "lm_head.weight":
            assert torch.equal(ours.state_dict[name], t), name
    # and both are the original weights up to Q4_1 rounding (a wrong un-permutation would not be)
    orig = ck.hf_model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    got = ours.state_dict["model.layers.1.self_attn.q_proj.weight"]
    assert (got - orig).abs().max() < 0.1 * orig.abs().max()
    c = ours.config
    assert (c.name, c.num_layers, c.num_kv_heads, c.tie_word_embeddings) == ("tiny-test", 2, 2, True)
    assert c.eos_token_ids == (2,)
    text = "the 42 ünï</s>"
    assert ours.tokenizer.encode(text) == tiny_gguf_tokenizer().encode(text)
    assert ours.tokenizer.decode(ours.tokenizer.encode(text)) == "the 42 ünï"


def test_cache_is_reused_and_keyed_by_content(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    first = load_model(str(path), cache_dir=tmp_path, progress=False)
    entries = list((tmp_path / "gguf").iterdir())
    assert [e.name for e in entries] == [f"{first.weights_digest}-v{gguf_loader.CONVERSION_VERSION}"]

    def no_convert(*_a, **_k):
        raise AssertionError("converted again despite a cache entry")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_convert)
    again = load_model(str(path), cache_dir=tmp_path)
    assert again.weights_digest == first.weights_digest
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(again.model.forward_dense(ids), first.model.forward_dense(ids))

    # a different file (one byte changed in the tensor data) gets its own entry
    copy = tmp_path / "copy.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    monkeypatch.undo()
    other = load_model(str(copy), cache_dir=tmp_path, progress=False)
    assert other.weights_digest != first.weights_digest
    assert len(list((tmp_path / "gguf").iterdir())) == 2


def test_failed_conversion_leaves_no_entry(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf

    def boom(src, out, **_k):
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_loader, "convert_gguf", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        load_gguf(path, cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_load_tokenizer_alone(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    tok = load_tokenizer(str(path), cache_dir=tmp_path, progress=False)  # converts into the cache
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
    assert tok.encode("the 42") == tiny_gguf_tokenizer().encode("the 42")
    lm = load_model(str(path), cache_dir=tmp_path)  # the model load then hits the cache
    assert lm.tokenizer.encode("the 42") == tok.encode("the 42")
    assert lm.model_dtype == lm.dtype == torch.float32
    folder = tmp_path / "gguf" / f"{lm.weights_digest}-v{gguf_loader.CONVERSION_VERSION}"
    assert load_tokenizer(str(folder)).encode("the 42") == tok.encode("the 42")  # an HF folder works too
