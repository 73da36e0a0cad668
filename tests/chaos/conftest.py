"""The chaos tests' prompts (fault injection under load: see each module's docstring)."""
from __future__ import annotations

import pytest

from chaos_utils import STREAMS
from kvmesh.model.loader import load_tokenizer
from kvmesh.model.perplexity import reference_text


@pytest.fixture(scope="module")
def long_prompts():
    """16 chat prompts of ~175 tokens, each around a different passage of the reference text."""
    tok = load_tokenizer("bundled")
    text = tok.encode(reference_text())
    out = []
    for i in range(STREAMS):
        passage = tok.decode(text[2000 + 150 * i: 2000 + 150 * i + 140])
        out.append(tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"{passage}\n\nWhat is this text about?"}], add_generation_prompt=True)))
    assert min(map(len, out)) > 128  # two 64-token chunks at least: the KV service is asked
    return out
