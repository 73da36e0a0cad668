"""The model a benchmark runs on (`kvmesh bench NAME --model PATH`) and what a workload needs of it.

The default is the bundled SmolLM2-135M, and on it every benchmark runs exactly as it always did.
Another model ('bundled', a .gguf file or an HF folder, as `kvmesh up --model` takes) runs the
benchmarks whose workloads are text and the model's own chat template; a workload the model
cannot run (prompts longer than its context, blending past a sliding window) is refused before
anything starts, with the reason, rather than measured wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvmesh.model.config import ModelConfig

BUNDLED = "bundled"


class BenchRefused(SystemExit):
    """A benchmark that cannot run on the model it was given; the message says why (and exits 1
    from the `kvmesh` command, as an unknown benchmark does)."""


@dataclass(frozen=True)
class BenchModel:
    """A benchmark's model: its source as given and its config (read without the weights)."""

    source: str
    config: ModelConfig

    @property
    def bundled(self) -> bool:
        return self.source == BUNDLED

    def engine_args(self) -> list[str]:
        """Flags that make an engine (or draft) process serve this model: none for the bundled
        model, so its runs start exactly the processes they always did."""
        return [] if self.bundled else ["--model", self.source]

    def require_context(self, bench: str, tokens: int, what: str) -> None:
        """BenchRefused unless `tokens` (prompt + output of the workload's longest sequence) fit
        the model's context."""
        if tokens > self.config.context_length:
            raise BenchRefused(f"kvmesh bench {bench}: model {self.source!r} has a context of "
                               f"{self.config.context_length} tokens; {what} need {tokens}")

    def require_full_attention(self, bench: str, tokens: int, what: str) -> None:
        """BenchRefused when a sliding window narrower than `tokens` would make a dense blend
        (kvmesh.kv.blend attends fully) compute what the model does not."""
        from kvmesh.services.engine.blending import attention_window

        window = attention_window(self.config)
        if window is not None and tokens > window:
            raise BenchRefused(f"kvmesh bench {bench}: model {self.source!r} attends through a sliding window of "
                               f"{window} tokens and blending attends fully, so {what} ({tokens} tokens) "
                               "cannot be blended on it (the engine computes such prompts exactly instead)")

    def select_layers(self, select_layers: int) -> int:
        """A blend's select_layers on this model, as the engine derives it (BlendConfig.for_model)."""
        from kvmesh.services.engine.blending import BlendConfig

        return BlendConfig(select_layers=select_layers).for_model(self.config.num_layers).select_layers


def bench_model(source: str = BUNDLED, *, cache_dir: Optional[str | Path] = None) -> BenchModel:
    """`source`'s config without loading its weights (a GGUF file is converted into the cache first,
    as the engine would); FileNotFoundError naming what to give for a path that is neither."""
    from kvmesh.model.bundled import bundled_gguf_path, read_eos_ids
    from kvmesh.model.gguf_loader import ensure_converted

    path = bundled_gguf_path() if source == BUNDLED else Path(source)
    if path.is_dir():
        folder = path
    elif path.suffix == ".gguf" and path.is_file():
        folder, _ = ensure_converted(path, cache_dir=cache_dir, progress=False)
    else:
        raise FileNotFoundError(f"--model {source!r} is neither 'bundled', a .gguf file nor a Hugging Face folder")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"--model {source!r}: {cfg_file} missing, not a Hugging Face checkpoint folder")
    hf = json.loads(cfg_file.read_text())
    eos = read_eos_ids(folder, hf)
    return BenchModel(source, ModelConfig.from_hf_config({**hf, "eos_token_id": eos} if eos is not None else hf))


def chat_frame(tok, source: str, user_head: str, user_tail: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the documents of one user turn whose text is `user_head`, the
    documents, then `user_tail`, ending with the assistant's header: the model's chat template
    rendered around a marker. The bundled model keeps the ChatML turn its figures were measured
    with (without the default system prompt its template would add)."""
    if source == BUNDLED:
        return (tok.encode(f"<|im_start|>user\n{user_head}"),
                tok.encode(f"{user_tail}<|im_end|>\n<|im_start|>assistant\n"))
    marker = "\u2063DOCUMENTS\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": f"{user_head}{marker}{user_tail}"}],
                                   add_generation_prompt=True)
    if text.count(marker) != 1:
        raise BenchRefused(f"the chat template of {source!r} does not keep the user's text as given; "
                           "pass a template that does (kvmesh up --chat-template) to benchmark blending")
    head, tail = text.split(marker)
    return tok.encode(head), tok.encode(tail)  # the template writes any BOS itself
