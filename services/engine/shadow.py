"""The guardrail's shadow check (services/engine/guardrail.py has the policy): the exact next-token
logits along a served answer, and for a replay the lossy ones, recomputed offline.

  * Exact: a dense fp32 prefill of the prompt alone (kvmesh.kv.blend.blend_prefill at ratio 1,
    no cache of any kind), then teacher forcing along the answer (continuation_logits): what a
    request that reuses nothing computes, up to the summation order of the paged kernels.
  * Lossy, served: the logits rows the engine's sampler saw (captured by the core).
  * Lossy, replayed (the path was disabled, the request served exactly): the prompt's leading KV
    as the lossy path would have given it, then the rest of the prompt and the answer computed
    over it, as the engine computes what it did not import:
      - codec: the exact prompt KV of the whole chunks the connector would fetch (at most up to
        the last whole block before the last prompt token), each chunk's keys un-rotated, encoded
        and decoded with the path's codec and rotated back -- what kv_transfer exports and
        kv_connector fetches;
      - blend: each document's KV computed alone (as segment_kv computes it, as ingest stores it), its chunks
        through the codec if the documents are stored lossy, blended into the prompt at the
        path's ratio (blend_prefill), up to the last whole block before the last prompt token --
        what services/engine/blending imports.
Both recompute densely and attend fully (kvmesh.kv.blend): on a model with a sliding window, a
check whose prompt and answer do not fit in the window measures nothing (run gives None) rather
than compare against what the model does not compute.
Runs on the step loop, between steps: it owns the model then.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvmesh.kv import codec
from kvmesh.kv.blend import Segment, blend_prefill, continuation_logits
from kvmesh.kv.keys import document_chunks
from kvmesh.kv.quality import Comparison, compare
from kvmesh.kv.rope import unrotate_keys
from kvmesh.services.engine.blending import BlendConfig, attention_window
from kvmesh.services.engine.guardrail import GuardTicket, ShadowCheck
from kvmesh.services.engine.kv_connector import stored_round_trip

Kv = tuple[torch.Tensor, torch.Tensor]
"""k, v [layers, n, kv_heads, head_dim], keys rotated to positions 0..n-1."""


class ShadowChecker:
    """Runs ShadowChecks on one engine's model."""

    def __init__(self, model, *, block_size: int, chunk_tokens: Optional[int], blend: BlendConfig) -> None:
        self.model = model
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        """The KV service's chunk size (None: no KV service, nothing to replay for a codec)."""
        self.blend = blend.for_model(model.config.num_layers)
        """As the engine's Blender derives it: select_layers fits the model (also for the dense
        prefills, which kvmesh.kv.blend validates the same way)."""
        self.window = attention_window(model.config)

    @torch.inference_mode()
    def run(self, check: ShadowCheck) -> Optional[Comparison]:
        """Exact against lossy along the check's answer; None when a replay has no lossy KV to
        give (a prompt shorter than one chunk, a blend without documents)."""
        prompt, answer = list(check.prompt_token_ids), list(check.answer_token_ids)
        if not prompt or not answer:
            return None
        if self.window is not None and len(prompt) + len(answer) > self.window:
            return None  # the dense recompute attends fully: past the window it is not this model
        exact, prompt_kv = self.exact(prompt, answer)
        if check.lossy_logits is not None:
            lossy = check.lossy_logits
        else:
            prefix = self._replay_prefix(check.ticket, prompt, prompt_kv)
            if prefix is None:
                return None
            lossy = self._continue(prefix, prompt, answer)
        return compare(exact, lossy.float(), torch.tensor(answer))

    @torch.inference_mode()
    def exact(self, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, Kv]:
        """The answer's exact logits rows [len(answer), vocab] float32 (row i: after the prompt
        and answer[:i]), and the prompt's exact KV: a dense prefill that reuses nothing."""
        res = self._dense(prompt)
        return continuation_logits(self.model, res.k, res.v, res.logits, answer), (res.k, res.v)

    def _dense(self, token_ids: list[int]):
        """A plain prefill of `token_ids` (blend_prefill at ratio 1, no cached segment)."""
        return blend_prefill(self.model, [Segment.new(token_ids)], 1.0, self.blend.select_layers,
                             self.blend.selection)

    def _continue(self, prefix: Kv, prompt: list[int], answer: list[int]) -> torch.Tensor:
        """Logits rows [len(answer), vocab] of the answer when the prompt's first n positions'
        KV is `prefix` and the rest of the prompt is computed over it."""
        n = prefix[0].shape[1]
        tail = len(prompt) - n  # >= 1: the last prompt token is always computed
        dummy = torch.zeros(self.model.config.vocab_size)  # row 0 (position n-1) is not compared
        rows = continuation_logits(self.model, prefix[0], prefix[1], dummy, prompt[n:] + answer)
        return rows[tail:tail + len(answer)]

    def _import_end(self, prompt_len: int, covered: int) -> int:
        """Positions imported of `covered` ready ones: whole blocks before the last prompt token."""
        return min(covered, (prompt_len - 1) // self.block_size * self.block_size)

    def _replay_prefix(self, ticket: GuardTicket, prompt: list[int], exact: Kv) -> Optional[Kv]:
        path = ticket.path
        if path.kind == "codec":
            return self._codec_prefix(path.codec, path.namespace.digest(), prompt, exact)
        if path.kind == "blend":
            return self._blend_prefix(ticket, prompt)
        raise ValueError(f"unknown lossy path kind {path.kind!r}")

    def _codec_prefix(self, spec: codec.CodecSpec, namespace: bytes, prompt: list[int], exact: Kv) -> Optional[Kv]:
        if self.chunk_tokens is None or spec is None:
            return None
        chunk = self.chunk_tokens
        n = self._import_end(len(prompt), len(prompt) // chunk * chunk)
        if n <= 0:
            return None
        whole = -(-n // chunk) * chunk  # <= len(prompt): n is within the prompt's whole chunks
        k, v = stored_round_trip(exact[0][:, :whole], exact[1][:, :whole], prompt, namespace, spec,
                                 self.model.rotary, chunk)
        return k[:, :n], v[:, :n]

    def _blend_prefix(self, ticket: GuardTicket, prompt: list[int]) -> Optional[Kv]:
        path, spans = ticket.path, sorted(ticket.document_spans)
        if not spans or self.chunk_tokens is None or path.recompute_ratio is None:
            return None
        ns = path.namespace.digest()
        segments: list[Segment] = []
        pos = 0
        for a, b in spans:
            if a < pos or b > len(prompt) or a >= b:
                return None  # overlapping or out-of-range spans: not a prompt this engine made
            if a > pos:
                segments.append(Segment.new(prompt[pos:a]))
            doc = prompt[a:b]
            alone = self._dense(doc)  # the document's KV computed alone, as ingest stores it
            k, v = unrotate_keys(alone.k, 0, self.model.rotary), alone.v  # position-free keys
            for s, e, _ in document_chunks(doc, self.chunk_tokens, ns):
                ck, cv = k[:, s:e], v[:, s:e]
                if path.codec is not None:
                    ck, cv = _round_trip(ck.to(v.dtype), cv, doc[s:e], ns, path.codec, s == 0)
                segments.append(Segment.cached(doc[s:e], ck, cv))
            pos = b
        if pos < len(prompt):
            segments.append(Segment.new(prompt[pos:]))
        if segments[-1].is_cached:  # as plan_documents: the last prompt token is computed
            last = segments.pop()
            m = len(last.token_ids) - 1
            if m:
                segments.append(Segment.cached(last.token_ids[:m], last.k[:, :m], last.v[:, :m]))
            segments.append(Segment.new(last.token_ids[m:]))
        res = blend_prefill(self.model, segments, path.recompute_ratio, self.blend.select_layers,
                            self.blend.selection)
        n = self._import_end(len(prompt), len(prompt))
        return (res.k[:, :n], res.v[:, :n]) if n > 0 else None


def _round_trip(k: torch.Tensor, v: torch.Tensor, ids: list[int], namespace: bytes, spec: codec.CodecSpec,
                sequence_start: bool) -> Kv:
    """Position-free k and v of one chunk as they come back from the KV service stored with `spec`."""
    blob = codec.encode(k, v, codec.ChunkMeta(namespace, tuple(ids)), spec, sequence_start=sequence_start)
    dk, dv, _ = codec.decode(blob, namespace=namespace, dtype=v.dtype)
    return dk, dv
