"""Every supported family against transformers on tiny random models built here: Llama 3 style
(plain, and each RoPE scaling: llama3, linear, dynamic), Qwen2 (q/k/v biases, tied embeddings,
with and without its sliding window) and Mistral (sliding window, untied), each loaded from its HF
folder and, where GGUF has the family's RoPE, from a GGUF file written like llama.cpp's converter
writes it. Checked: dense logits on varied prompts, the paged engine (chunked prefill, prompt
logprobs, then a prefix-cache hit), and 32 greedy tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_utils import greedy, make_core, run_all
from kvmesh.model.config import ModelConfig
from kvmesh.model.loader import load_model
from model_families import family_model, tiny_models, write_gguf

TOL = 1e-4
CASES = {
    "llama": dict(family="llama"),
    "llama-llama3": dict(family="llama", rope_scaling="llama3"),
    "llama-linear": dict(family="llama", rope_scaling="linear"),
    "llama-dynamic": dict(family="llama", rope_scaling="dynamic"),
    "llama-bias-tied": dict(family="llama", attention_bias=True, tie=True, template_file=True),
    "qwen2": dict(family="qwen2"),
    "qwen2-window": dict(family="qwen2", sliding_window=6, tie=False),
    "mistral": dict(family="mistral"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    torch.set_num_threads(1)
    m = family_model(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CASES[request.param])
    return request.param, m


def _reference(m):
    """The transformers model kvmesh must equal. Dynamic NTK: transformers re-derives the base
    from each call's length, kvmesh fixes it at factor x the original context (as vLLM); the
    reference is then transformers' plain RoPE at that base (checked equal to its dynamic model at
    that length in test_dense_logits)."""
    if m.rope_scaling != "dynamic":
        return m.hf_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = m.hf_model.config
    theta = load_model(str(m.folder)).model.rotary.theta
    plain = LlamaConfig(**{**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                           "max_position_embeddings": 4 * cfg.max_position_embeddings})
    ref = LlamaForCausalLM(plain).eval()
    ref.load_state_dict(m.hf_model.state_dict())
    return ref


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


def _prompts(m, vocab: int) -> torch.Tensor:
    """Two rows: text through the model's tokenizer (repeated to length), and random ids. The
    dynamic model's rows are exactly factor x its original context long (see `_reference`)."""
    n = 64 if m.rope_scaling == "dynamic" else 48
    from model_families import build_tokenizer

    text = build_tokenizer(m.family).encode("Serving a language model: 1,234 engines, 0.25 seconds. " * 8).ids
    g = torch.Generator().manual_seed(7)
    return torch.stack([torch.tensor(text[:n]), torch.randint(0, vocab, (n,), generator=g)])


def test_config_maps_the_family(case):
    name, m = case
    loaded = load_model(str(m.folder))
    c = loaded.config
    assert c.family == CASES[name]["family"]
    # the chat template from tokenizer_config.json, or from chat_template.jinja
    assert loaded.tokenizer.chat_template == tiny_models.TEMPLATES[c.family]
    assert ("chat_template" in (m.folder / "tokenizer_config.json").read_text()) != bool(
        CASES[name].get("template_file"))
    bias = name == "llama-bias-tied"
    assert c.qkv_bias == (c.family == "qwen2" or bias) and c.o_bias == bias
    assert c.tie_word_embeddings == m.hf_model.config.tie_word_embeddings
    window = {"mistral": 8, "qwen2-window": 6}.get(name)
    assert [c.window_of(i) for i in range(c.num_layers)] == (
        [None, None] if window is None else [None, 6] if name == "qwen2-window" else [8, 8])
    assert (c.rope_scaling and c.rope_scaling.rope_type) == CASES[name].get("rope_scaling")
    assert ModelConfig.from_hf_config(c.to_hf_config()) == dataclasses.replace(c, name=c.name)


def test_dense_logits(case):
    name, m = case
    loaded = load_model(str(m.folder))
    ids = _prompts(m, loaded.config.vocab_size)
    want = _hf_logits(m.hf_model, ids)
    torch.testing.assert_close(loaded.model.forward_dense(ids), want, atol=TOL, rtol=0)
    if m.rope_scaling == "dynamic":
        torch.testing.assert_close(_hf_logits(_reference(m), ids), want, atol=TOL, rtol=0)
        # shorter calls: transformers keeps plain RoPE there, kvmesh's base stays fixed
        assert not torch.allclose(loaded.model.forward_dense(ids[:, :20]), _hf_logits(m.hf_model, ids[:, :20]),
                                  atol=TOL)


def test_gguf_dense_logits(case, tmp_path):
    name, m = case
    if m.rope_scaling == "dynamic":
        pytest.skip("GGUF has no dynamic (NTK) RoPE type; such files are refused (test_gguf_refusals)")
    if name == "qwen2-window":
        pytest.skip("llama.cpp's qwen2 architecture has no sliding window: its converter drops it")
    path = write_gguf(tmp_path / f"{name}.gguf", m)
    loaded = load_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    assert loaded.config.family == CASES[name]["family"]
    assert loaded.config.rope_description() == load_model(str(m.folder)).config.rope_description() or (
        name == "llama-llama3")  # from GGUF, llama3 arrives as llama.cpp's per-frequency divisors
    ids = _prompts(m, loaded.config.vocab_size)
    torch.testing.assert_close(loaded.model.forward_dense(ids), _hf_logits(m.hf_model, ids), atol=TOL, rtol=0)


def test_engine_chunked_prefill_prefix_hit_and_greedy(case):
    """Prompt logprobs over 16-token prefill chunks; then a prompt sharing 32 tokens hits the
    prefix cache and its generated tokens' logprobs still equal transformers'; then 32 greedy
    tokens equal transformers' greedy tokens."""
    name, m = case
    ref = _reference(m)
    loaded = load_model(str(m.folder))
    core = make_core(loaded, max_num_batched_tokens=16, max_num_seqs=4)
    ids = _prompts(m, loaded.config.vocab_size)
    first = ids[0, :40].tolist()
    got = run_all(core, {"a": first}, greedy(1, ignore_eos=True, prompt_logprobs=3))["a"]
    want = torch.log_softmax(_hf_logits(ref, torch.tensor([first]))[0], -1)
    assert len(got["prompt_logprobs"]) == len(first) - 1
    for pos, entry in enumerate(got["prompt_logprobs"]):
        assert entry.logprob == pytest.approx(want[pos, first[pos + 1]].item(), abs=TOL)
        assert [v for _, v in entry.top] == pytest.approx(want[pos].topk(3).values.tolist(), abs=TOL)

    second = first[:32] + ids[1, :9].tolist()
    core.validate(second, greedy(8, ignore_eos=True, logprobs=3))
    hit = run_all(core, {"b": second}, greedy(8, ignore_eos=True, logprobs=3))["b"]
    assert hit["final"].usage.cached_prompt_tokens == 32
    full = second + hit["tokens"]
    want = torch.log_softmax(_hf_logits(ref, torch.tensor([full]))[0], -1)
    for i, entry in enumerate(hit["logprobs"]):
        pos = len(second) - 1 + i
        assert entry.token_id == int(want[pos].argmax())
        assert entry.logprob == pytest.approx(want[pos].max().item(), abs=TOL)

    prompt = ids[1, :16].tolist()
    tokens = run_all(core, {"g": prompt}, greedy(32, ignore_eos=True))["g"]["tokens"]
    seq = list(prompt)
    for _ in range(32):  # transformers' greedy decoding, one full forward per token
        seq.append(int(_hf_logits(ref, torch.tensor([seq]))[0, -1].argmax()))
    assert tokens == seq[len(prompt):]
    assert len(set(tokens)) > 1  # not a degenerate constant stream


def test_unsupported_checkpoints_are_refused_naming_what_loads(tmp_path):
    import json

    from kvmesh.model.config import UnsupportedModelError

    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    for extra, message in (
            ({"architectures": ["Phi3ForCausalLM"]},
             "architecture 'Phi3ForCausalLM' is not supported; supported: LlamaForCausalLM .*MistralForCausalLM"
             ".*Qwen2ForCausalLM"),
            ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
             "rope scaling 'yarn' is not supported; supported: linear, dynamic, llama3"),
            ({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias"),
            ({"model_type": "gemma"}, "model_type 'gemma' is not supported")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(UnsupportedModelError, match=message):
            load_model(str(tmp_path))


def test_gguf_refusals():
    from kvmesh.model.config import UnsupportedModelError
    from kvmesh.model.gguf_loader import config_from_metadata

    meta = {"general.architecture": "llama", "llama.attention.head_count": 2, "llama.embedding_length": 16,
            "llama.feed_forward_length": 32, "llama.block_count": 1, "llama.context_length": 64,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 32}
    assert config_from_metadata(meta, set()).family == "llama"
    with pytest.raises(UnsupportedModelError, match="architecture 'phi3' is not supported; supported: llama, qwen2"):
        config_from_metadata({**meta, "general.architecture": "phi3"}, set())
    with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn' is not supported"):
        config_from_metadata({**meta, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, set())
    linear = config_from_metadata({**meta, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                                  set())
    assert linear.rope_scaling.rope_type == "linear" and linear.context_length == 256


def test_sharded_safetensors_folder(tmp_path):
    """The same weights saved in several shards (model.safetensors.index.json) load alike."""
    import shutil

    m = family_model(tmp_path / "one", "qwen2")
    sharded = tmp_path / "sharded"
    m.hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(m.folder / f, sharded / f)
    ids = _prompts(m, m.hf_model.config.vocab_size)
    torch.testing.assert_close(load_model(str(sharded)).model.forward_dense(ids), _hf_logits(m.hf_model, ids),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_keep_qwen2_biases(tmp_path, weights):
    """Weight-only quantization (kvmesh up --cascade's cheap tier) quantizes the q/k/v weights
    and adds their biases unquantized: logits stay near the fp32 model's, far from the same
    quantized model without biases."""
    m = family_model(tmp_path, "qwen2", seed=5)
    ids = _prompts(m, m.hf_model.config.vocab_size)
    exact = _hf_logits(m.hf_model, ids)
    quantized = load_model(str(m.folder), weights=weights).model
    got = quantized.forward_dense(ids)
    err = (got - exact).abs().mean().item()
    with torch.no_grad():
        for layer in quantized.model.layers:
            layer.self_attn.qkv_proj.bias.zero_()
    assert err < 0.5 * (quantized.forward_dense(ids) - exact).abs().mean().item()
