"""Engine option num_layers (early exit after the first N decoder layers) on a tiny 3-layer model."""
import pytest
import torch

from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.config import ConfigError, load_config
from kvmesh.model.loader import truncate_layers
from kvmesh.services.engine.build import build_core, kv_layout
from kvmesh.services.engine.servicer import model_info
from kvmesh.services.engine.config import EngineConfig

PROMPT = [(17 * i + 2) % 256 for i in range(40)]
STEPS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=3)


@pytest.fixture(scope="module")
def tiny(folder):
    return load_tiny(folder)


def reference(model, prompt, num_layers, steps=STEPS):
    """Greedy tokens and their logprobs from dense forwards through the full model's own first
    `num_layers` layers, then its final norm and lm_head (nothing of truncate_layers involved)."""
    ids, logprobs = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            h = model.model.embed_tokens(torch.tensor([ids]))  # [1, T, hidden]
            cos, sin = model.rotary(torch.arange(len(ids)), h.dtype)
            for layer in list(model.model.layers)[:num_layers]:
                h = layer.forward_dense(h, cos, sin)
            lp = torch.log_softmax(model.compute_logits(model.model.norm(h))[0, -1], dim=-1)  # [vocab]
            ids.append(int(lp.argmax()))
            logprobs.append(lp.max().item())
    return ids[len(prompt):], logprobs


def _engine_cfg(**kw):
    return EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=16, max_num_seqs=4, **kw)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_output_equals_the_first_layers_reference(folder, tiny, num_layers):
    core = build_core(_engine_cfg(model=str(folder), num_layers=num_layers))  # the load path
    assert core.loaded.config.num_layers == num_layers and len(core.runner.kv_caches) == num_layers
    got = run_all(core, {"a": PROMPT}, greedy(STEPS, ignore_eos=True, logprobs=0))["a"]
    tokens, logprobs = reference(tiny.model, PROMPT, num_layers)
    assert got["tokens"] == tokens
    assert [e.logprob for e in got["logprobs"]] == pytest.approx(logprobs, abs=1e-4)
    full_tokens, _ = reference(tiny.model, PROMPT, 3)
    assert tokens != full_tokens          # the cut is real: fewer layers, another model


def test_all_layers_is_the_full_model_and_the_full_model_is_untouched(tiny):
    full = run_all(make_core(tiny), {"a": PROMPT}, greedy(STEPS, ignore_eos=True))["a"]["tokens"]
    cut = make_core(tiny, num_layers=1)                        # shares tiny's modules
    assert cut.loaded.model is not tiny.model and tiny.config.num_layers == 3
    assert len(tiny.model.model.layers) == 3
    assert full == reference(tiny.model, PROMPT, 3)[0]
    assert run_all(make_core(tiny), {"a": PROMPT}, greedy(STEPS, ignore_eos=True))["a"]["tokens"] == full
    assert make_core(tiny, num_layers=3).loaded is tiny


def test_kv_namespaces_and_model_info_follow_the_layer_count(tiny):
    full, cut = make_core(tiny), make_core(tiny, num_layers=2)
    assert full.namespace.digest() != cut.namespace.digest()
    assert cut.loaded.identity != tiny.identity and truncate_layers(tiny, 3).identity == tiny.identity
    layouts = kv_layout(full.loaded), kv_layout(cut.loaded)
    assert (layouts[0].num_layers, layouts[1].num_layers) == (3, 2)
    info = model_info(cut, _engine_cfg(num_layers=2))
    assert info.kv_namespace.layout.num_layers == 2 and info.weights_digest == tiny.weights_digest
    assert model_info(full, _engine_cfg()).kv_namespace.layout.num_layers == 3
    # the prefix cache of one never serves the other (same prompt, same salt)
    run_all(full, {"a": PROMPT}, greedy(2, ignore_eos=True))
    assert full.cached_prefix_tokens(PROMPT) == 32 and cut.cached_prefix_tokens(PROMPT) == 0


def test_too_many_layers_is_a_config_error_with_the_fix(folder, tiny):
    with pytest.raises(ConfigError, match=r"--num-layers 4 exceeds the 3 decoder layers.*use 1\.\.3, or 0"):
        make_core(tiny, num_layers=4)
    with pytest.raises(ConfigError, match="KVMESH_ENGINE_NUM_LAYERS"):
        build_core(_engine_cfg(model=str(folder), num_layers=9))


def test_flag_and_environment_variable():
    assert load_config(EngineConfig, "engine", ["--num-layers", "2"], environ={}).num_layers == 2
    assert load_config(EngineConfig, "engine", [], environ={"KVMESH_ENGINE_NUM_LAYERS": "5"}).num_layers == 5
    assert load_config(EngineConfig, "engine", [], environ={}).num_layers == 0
    with pytest.raises(ConfigError):
        load_config(EngineConfig, "engine", ["--num-layers", "-1"], environ={})


@pytest.mark.slow
def test_bundled_model_cut_after_loading_leaves_the_converted_weights_cache_whole(bundled_model):
    import json

    from kvmesh.model.gguf_loader import ensure_converted
    from kvmesh.model.loader import bundled_gguf_path

    core = make_core(bundled_model, num_layers=4, max_num_batched_tokens=64)
    prompt = bundled_model.tokenizer.encode("The capital of France is")
    got = run_all(core, {"a": prompt}, greedy(6, ignore_eos=True))["a"]["tokens"]
    assert got == reference(bundled_model.model, prompt, 4, steps=6)[0]
    assert model_info(core, EngineConfig(num_layers=4)).kv_namespace.layout.num_layers == 4
    folder, _ = ensure_converted(bundled_gguf_path(), progress=False)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 30
    assert bundled_model.config.num_layers == 30 and len(bundled_model.model.model.layers) == 30
