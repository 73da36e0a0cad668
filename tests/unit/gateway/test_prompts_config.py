"""Chat rendering / tokenization, the real tokenizer loader, and config validation."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gateway_utils import tiny_tokenizer
from kvmesh.config import ConfigError, load_config
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.prompts import PromptBuilder, load_tokenizer
from kvmesh.services.gateway.spec import ChatTurn


async def test_chat_template_and_roles():
    b = PromptBuilder(tiny_tokenizer())
    p = await b.chat((ChatTurn("developer", "be brief"), ChatTurn("user", "hi")))
    assert p.text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert p.token_ids.count(256) == 3 and p.token_ids[0] == 256  # special tokens matched whole
    assert b.token_text(104) == "h"


async def test_long_prompts_tokenize_off_loop():
    b = PromptBuilder(tiny_tokenizer())
    p = await b.completion("x" * 20000, 0)
    assert len(p.token_ids) == 20000


@pytest.mark.slow
def test_bundled_tokenizer_loads_from_gguf_metadata():
    tok = load_tokenizer("bundled")
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_missing_tokenizer_source_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="--model"):
        load_tokenizer(str(tmp_path / "nothing.gguf"))


def test_config_defaults_and_fix_it_errors(tmp_path):
    cfg = load_config(GatewayConfig, "gateway", [], {})
    assert (cfg.http_host, cfg.http_port, cfg.server.port, cfg.router_address) == (
        "127.0.0.1", 8000, 50051, "127.0.0.1:50081")
    assert cfg.keys_file is None and not cfg.open_to_network_without_keys
    with pytest.raises(ConfigError, match="keys add"):
        load_config(GatewayConfig, "gateway", ["--keys-file", str(tmp_path / "none.json")], {})
    with pytest.raises(ConfigError, match="needs a port"):
        load_config(GatewayConfig, "gateway", [], {"KVMESH_GATEWAY_ROUTER_ADDRESS": "router"})
    with pytest.raises(ConfigError, match="different ports"):
        load_config(GatewayConfig, "gateway", ["--http-port", "9000", "--port", "9000"], {})
    wide = load_config(GatewayConfig, "gateway", ["--http-host", "0.0.0.0"], {})
    assert wide.open_to_network_without_keys



def test_the_gateway_process_tokenizes_without_torch():
    """The gateway only tokenizes: neither its modules nor loading the bundled model's tokenizer
    may import torch (hundreds of MB and seconds of start-up in every gateway process)."""
    code = ("import sys, kvmesh.services.gateway.__main__; "
            "from kvmesh.services.gateway.prompts import load_tokenizer; "
            "tok = load_tokenizer('bundled'); assert tok.encode('hello'); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
