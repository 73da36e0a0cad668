"""`kvmesh bench NAME --model PATH`: the flag reaches each benchmark's model loading, rows carry the
model, and a benchmark that cannot run on the model refuses before anything starts, saying why.
No benchmark is run: loading is intercepted at its first step."""
from __future__ import annotations

import pytest

from kvmesh import cli
from kvmesh.loadtest import models, registry
from kvmesh.loadtest.models import BenchModel, BenchRefused, bench_model, chat_frame
from kvmesh.model.config import ModelConfig
from model_families import family_model

MODEL_BENCHES = sorted(set(registry.BENCHES) - set(registry.BUNDLED_ONLY) - set(registry.NO_MODEL))


class Loaded(Exception):
    """Raised by the intercepted loader: the benchmark got this far with `source`."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.source = source


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return family_model(tmp_path_factory.mktemp("qwen2"), "qwen2").folder


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return family_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=8).folder


def roomy(source: str) -> BenchModel:
    """A stand-in config with room for every workload (128k context, no window)."""
    return BenchModel(source, ModelConfig(name="roomy", vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2,
                                          num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
                                          rms_norm_eps=1e-5, max_position_embeddings=131072,
                                          tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(1,)))


def test_the_bench_flag_reaches_run_bench(monkeypatch):
    seen = {}
    monkeypatch.setattr(registry, "run_bench", lambda name, **kw: seen.update(name=name, **kw) or [])
    args = cli.build_parser().parse_args(["bench", "spec", "--quick", "--model", "/models/qwen"])
    assert args.fn(args) == 0
    assert seen == {"name": "spec", "quick": True, "json_path": None, "model": "/models/qwen"}
    assert cli.build_parser().parse_args(["bench", "spec"]).model == "bundled"


@pytest.mark.parametrize("name", MODEL_BENCHES)
def test_every_model_bench_loads_the_given_model(name, monkeypatch):
    """The model reaches the bench's first load of the model (weights or tokenizer), and nothing
    is loaded from 'bundled' on the way."""
    from kvmesh.loadtest import quant_bench
    from kvmesh.model import loader

    def load(source, *a, **kw):
        raise Loaded(source)

    monkeypatch.setattr(models, "bench_model", roomy)
    for target in (loader, quant_bench):
        monkeypatch.setattr(target, "load_model", load)
    monkeypatch.setattr(loader, "load_tokenizer", load)
    with pytest.raises(Loaded) as got:
        registry.run_bench(name, quick=True, model="/models/qwen")
    assert got.value.source == "/models/qwen"


def test_rows_carry_the_model(monkeypatch):
    from kvmesh.loadtest import engine_bench

    calls = []

    def fake_run(quick: bool = False, engine_args=None, model: str = "bundled"):
        calls.append(model)
        return [{"system": "kvmesh", "metric": "ttft_s", "value": 1.0, "unit": "s"}]

    monkeypatch.setattr(engine_bench, "run", fake_run)
    assert registry.run_bench("engine", quick=True, model="/m/q.gguf")[0]["model"] == "/m/q.gguf"
    assert registry.run_bench("engine", quick=True)[0]["model"] == "bundled"
    assert calls == ["/m/q.gguf", "bundled"]


@pytest.mark.parametrize("name", sorted(registry.BUNDLED_ONLY))
def test_bundled_only_benches_refuse_another_model_and_say_why(name):
    with pytest.raises(BenchRefused, match=f"kvmesh bench {name} runs on the bundled model only: "):
        registry.run_bench(name, quick=True, model="/models/qwen")


def test_a_bench_that_loads_no_model_refuses_one_and_says_why():
    with pytest.raises(BenchRefused, match="kvmesh bench loadgen takes no --model: it measures the load harness"):
        registry.run_bench("loadgen", quick=True, model="/models/qwen")


def test_a_workload_longer_than_the_context_is_refused_before_anything_starts(qwen2):
    bm = bench_model(str(qwen2))
    assert bm.config.context_length == 256 and bm.engine_args() == ["--model", str(qwen2)]
    with pytest.raises(BenchRefused, match=r"kvmesh bench engine: model '.*' has a context of 256 tokens; "
                                           r"its prompts of up to 2048 tokens need 2049"):
        registry.run_bench("engine", quick=True, model=str(qwen2))


def test_blending_past_a_sliding_window_is_refused(mistral):
    bm = bench_model(str(mistral))
    bm.require_full_attention("blend", 8, "prompts")
    with pytest.raises(BenchRefused, match="sliding window of 8 tokens and blending attends fully"):
        bm.require_full_attention("blend", 9, "prompts")


def test_blend_select_layers_fit_the_model(qwen2):
    assert bench_model(str(qwen2)).select_layers(2) == 1  # as the engine caps it on 2 layers


def test_bundled_model_needs_no_engine_flag():
    assert BenchModel("bundled", roomy("bundled").config).engine_args() == []


def test_an_unknown_source_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'bundled', a .gguf file nor a Hugging Face folder"):
        bench_model(str(tmp_path / "missing"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_chat_frame_is_the_models_template_around_the_documents(family, tmp_path):
    from kvmesh.model.loader import load_tokenizer

    folder = family_model(tmp_path / family, family).folder
    tok = load_tokenizer(str(folder))
    head, tail = chat_frame(tok, str(folder), "Answer from these.\n\n", "\n\nQuestion: why?")
    whole = tok.apply_chat_template([{"role": "user", "content": "Answer from these.\n\nDOCS\n\nQuestion: why?"}])
    before, after = whole.split("DOCS")
    assert (head, tail) == (tok.encode(before), tok.encode(after))  # as the gateway encodes a rendered prompt
    assert len(head) > len(tok.encode("Answer from these.\n\n"))  # the template's own tokens are there


def test_the_bundled_chat_frame_is_the_chatml_turn_its_figures_were_measured_with():
    from kvmesh.model.loader import load_tokenizer

    tok = load_tokenizer("bundled")
    head, tail = chat_frame(tok, "bundled", "Read.\n\n", "\n\nQ?")
    assert head == tok.encode("<|im_start|>user\nRead.\n\n")
    assert tail == tok.encode("\n\nQ?<|im_end|>\n<|im_start|>assistant\n")
