"""`kvmesh up --model PATH`: one flag sets the engines, the gateway's tokenizer, the router tier and
the served name; drafts default to n-gram for a model without a known draft; bad plans are refused
before anything starts (no processes here)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.cli import _plan, build_parser
from kvmesh.launcher import LaunchError, StackPlan, check_model, stack_services
from kvmesh.model.bundled import folder_digest, weight_files
from model_families import make_model


def _args(spec) -> dict[str, str]:
    a = list(spec.args)
    return {a[i]: a[i + 1] for i in range(0, len(a) - 1) if a[i].startswith("--")}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_model(folder, "qwen2")
    return folder


def test_one_flag_sets_every_service(qwen):
    plan = _plan(build_parser().parse_args(["up", "--model", str(qwen), "--cascade"]))
    specs = {s.name: s for s in stack_services(plan, Path("/d"))}
    name = str(qwen)  # as vLLM: the model as given is the served name
    for engine in ("engine", "engine-cheap"):
        assert _args(specs[engine])["--model"] == str(qwen)
        assert _args(specs[engine])["--served-model-name"] == name
    assert _args(specs["gateway"])["--model"] == str(qwen)
    router = _args(specs["router"])
    assert router["--tiers"].startswith(f"{name}=127.0.0.1:50061@1.0;") and router["--default-model"] == name
    draft = _args(specs["draft"])
    assert draft["--draft-model"] == "none"  # no known draft: n-gram drafts
    assert draft["--target-model"] == folder_digest(weight_files(qwen))  # what the engines report


def test_served_model_name_draft_model_and_chat_template(qwen, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    plan = _plan(build_parser().parse_args(["up", "--model", str(qwen), "--served-model-name", "tiny",
                                            "--draft-model", str(qwen), "--chat-template", str(template)]))
    specs = {s.name: s for s in stack_services(plan, Path("/d"))}
    assert _args(specs["engine"])["--served-model-name"] == "tiny"
    assert _args(specs["router"])["--tiers"] == "tiny=127.0.0.1:50061@1.0"
    assert _args(specs["draft"])["--draft-model"] == str(qwen)
    assert _args(specs["draft"])["--served-model-name"] == "tiny"  # its metrics' model_name
    assert _args(specs["gateway"])["--chat-template"] == str(template)
    check_model(plan)  # a draft model with the same tokenizer, a readable template


def test_bundled_model_keeps_its_own_draft_and_name():
    specs = {s.name: s for s in stack_services(StackPlan(), Path("/d"))}
    assert "--draft-model" not in _args(specs["draft"])
    assert _args(specs["engine"])["--served-model-name"] == "smollm2-135m-instruct"
    assert _args(specs["gateway"])["--model"] == "bundled"


def test_bad_plans_are_refused_before_starting(qwen, tmp_path):
    with pytest.raises(LaunchError, match="neither 'bundled', a .gguf file nor an HF folder"):
        check_model(StackPlan(model=str(tmp_path / "missing")))
    other = tmp_path / "llama"
    make_model(other, "llama")
    with pytest.raises(LaunchError, match="tokenizes differently.*share the served model's tokenizer"):
        check_model(StackPlan(model=str(qwen), draft_model=str(other)))
    with pytest.raises(LaunchError, match="neither a file nor a Jinja template"):
        check_model(StackPlan(model=str(qwen), chat_template=str(tmp_path / "nope.jinja")))
    with pytest.raises(ValueError, match="--served-model-name"):
        StackPlan(model="/models/my model")
