"""Blending fitted to the model it runs on: select_layers capped for shallow models (the shadow
checker derives it as the engine's Blender does, so its checks run on a 2-layer model), sliding
windows (a prompt longer than the window is not blended, a shadow check that would not fit is
skipped), and the served name an engine reports when none is given."""
from __future__ import annotations

import pytest
import torch

from engine_utils import make_core, make_tiny_checkpoint
from kvmesh.kv.namespace import EXACT
from kvmesh.kv.quality import DEFAULT_BUDGET
from kvmesh.model.loader import load_model
from kvmesh.services.engine.blending import BlendConfig, Blender, attention_window
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.guardrail import GuardTicket, LossyPath, ShadowCheck
from kvmesh.services.engine.servicer import model_info
from kvmesh.services.engine.shadow import ShadowChecker
from model_families import family_model

CHUNK = 8


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return load_model(str(make_tiny_checkpoint(tmp_path_factory.mktemp("two"), num_layers=2)), progress=False)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A 2-layer Mistral attending through an 8-token window."""
    m = family_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=8)
    return load_model(str(m.folder), progress=False)


def blend_check(loaded, prompt: list[int], answer: list[int], ratio: float,
                spans: tuple[tuple[int, int], ...]) -> ShadowCheck:
    """A replay check of a blend at `ratio` of the documents at `spans`."""
    namespace = make_core(loaded, num_blocks=16).namespace
    path = LossyPath(namespace.with_storage(f"blend:{EXACT}:{ratio}"), "blend", None, ratio, DEFAULT_BUDGET)
    return ShadowCheck(GuardTicket(path, False, spans), tuple(prompt), tuple(answer))


def test_blend_config_caps_select_layers_to_the_model():
    assert BlendConfig(select_layers=2).for_model(2).select_layers == 1
    assert BlendConfig(select_layers=2).for_model(30).select_layers == 2
    assert BlendConfig(select_layers=5).for_model(4).select_layers == 3


def test_shadow_checks_run_on_a_two_layer_model(two_layers):
    """The engine's default BlendConfig (select_layers 2) on a 2-layer model: the exact side is
    the model's own dense forward, a blend replay at ratio 1 loses nothing, pure reuse loses
    something -- where blend_prefill used to refuse select_layers 2 for 2 layers."""
    checker = ShadowChecker(two_layers.model, block_size=4, chunk_tokens=CHUNK, blend=BlendConfig())
    assert checker.blend.select_layers == 1
    prompt = [(7 * i + 3) % 250 for i in range(40)]
    answer = [(11 * i + 5) % 250 for i in range(6)]
    rows, _ = checker.exact(prompt, answer)
    dense = two_layers.model.forward_dense(torch.tensor([prompt + answer]))[0]  # [T, vocab]
    torch.testing.assert_close(rows, dense[len(prompt) - 1:-1].float(), atol=1e-4, rtol=1e-4)

    spans = ((0, 16), (16, 32))
    full = checker.run(blend_check(two_layers, prompt, answer, 1.0, spans))
    reuse = checker.run(blend_check(two_layers, prompt, answer, 0.0, spans))
    assert full is not None and reuse is not None
    assert full.kl < 1e-6 and full.top1 == 1.0
    assert reuse.kl > 1e-4


def test_the_engine_blender_and_namespace_use_the_capped_layers(two_layers):
    core = make_core(two_layers, num_blocks=16)
    blender = Blender(two_layers.model, core.scheduler, BlendConfig(0.5, 2))
    assert blender.config.select_layers == 1
    assert blender.config.namespace(core.namespace, 0.5).storage.endswith(":0.5000:1:deviation+deep-attention")


def test_attention_window_is_the_narrowest_windowed_layer(windowed, two_layers):
    assert attention_window(windowed.config) == 8
    assert attention_window(two_layers.config) is None


def test_blending_past_the_window_is_refused_with_the_reason(windowed, two_layers):
    core = make_core(windowed, num_blocks=16)
    assert core.blender.refusal(8) == ""
    reason = core.blender.refusal(9)
    assert "sliding window of 8 tokens" in reason and "9-token prompt is computed exactly" in reason
    assert make_core(two_layers, num_blocks=16).blender.refusal(100_000) == ""


def test_shadow_checks_past_the_window_measure_nothing(windowed):
    """The checker's dense recompute attends fully: beyond the window it would compare against
    what the model does not compute, so such a check gives no result (the guardrail counts none)."""
    checker = ShadowChecker(windowed.model, block_size=4, chunk_tokens=4, blend=BlendConfig())
    codec_path = LossyPath(make_core(windowed, num_blocks=16).namespace, "codec", None, None, DEFAULT_BUDGET)

    def check(prompt, answer):
        return ShadowCheck(GuardTicket(codec_path, True), tuple(prompt), tuple(answer),
                           lossy_logits=torch.zeros(len(answer), windowed.config.vocab_size))

    assert checker.run(check([5, 6, 7, 8, 9], [10, 11, 12])) is not None  # 8 tokens: inside the window
    assert checker.run(check([5, 6, 7, 8, 9, 10], [10, 11, 12])) is None


def test_the_served_name_derives_from_the_model(two_layers):
    assert EngineConfig().model_name == "smollm2-135m-instruct"
    assert EngineConfig(model="/models/qwen").model_name == "/models/qwen"
    assert EngineConfig(model="/models/qwen", served_model_name="qwen").model_name == "qwen"
    info = model_info(make_core(two_layers, num_blocks=16), EngineConfig(model=two_layers.source))
    assert info.model == two_layers.source
