"""Structured output: each constrained request's grammar state, and the token masks of a step.

The grammar library is llguidance (a Rust Earley parser over the tokenizer's token trie): a
`Constraint` compiles to a grammar, each request gets a matcher, and each step asks the
matchers for the tokens that can continue a valid output, as one bitmask row per logits row.

NOTE (state and speculation). A matcher advances only over tokens the request really emits
(`advance`), so preemption (the output is kept) and request migration (the resumed tokens are
replayed) leave it right. A step that verifies drafts x_1..x_k needs the mask after each prefix
x_1..x_j: `draft_masks` consumes the drafts one by one, writing the mask before each, and rolls
them all back. A draft the grammar forbids ends that walk; its row's mask forbids it, so the
verification rejects it (greedy: the argmax is never a masked token; sampled: its probability
is 0), and the rows after it are never used. Once the verdict is known, `advance` consumes the
emitted tokens: the grammar state moves over accepted tokens only.
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from kvmesh.errors import InvalidArgument
from kvmesh.model.tokenizer import Tokenizer
from kvmesh.grammar import Constraint, check_grammar
from kvmesh.services.engine.logits import unpack_bitmask

class GrammarState:
    """One request's matcher: where its output is in the grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, tokens: Sequence[int]) -> None:
        """Consumes emitted tokens. A token the grammar forbids (only through a resumed output
        made elsewhere) puts the matcher in its error state: from then on it masks nothing."""
        for t in tokens:
            if self.matcher.is_stopped() or not self.matcher.consume_token(t):
                return

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar admits no further token."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def active(self) -> bool:
        """The matcher constrains the next token (not in its error state)."""
        return not self.matcher.is_error()


class StructuredOutput:
    """Compiles constraints for one model's tokenizer and fills each step's masks.

    The llguidance tokenizer (a ~0.3 s build) is made at the first constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self._eos)
            self._executor = llguidance.LLExecutor(num_threads=2)
        return self._ll

    def start(self, c: Constraint) -> GrammarState:
        """A new request's grammar state (InvalidArgument when the constraint does not compile)."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), check_grammar(c), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"the {c.kind} constraint does not compile: {matcher.get_error()}")
        return GrammarState(matcher)

    def masks(self, states: Sequence[GrammarState | None]) -> torch.Tensor | None:
        """allowed [R, V] bool, row i the next-token mask of states[i] (all True for None or a
        matcher in error); None when no row is constrained. The masks are computed in parallel."""
        live = [(s.matcher, i) for i, s in enumerate(states) if s is not None and s.active]
        if not live:
            return None
        llg_torch = _llg_torch()
        bitmask = llg_torch.allocate_token_bitmask(len(states), self.vocab_size)  # [R, W], all allowed
        llg_torch.fill_next_token_bitmask_par(self._executor, live, bitmask)
        return unpack_bitmask(bitmask, self.vocab_size)

    def draft_masks(self, state: GrammarState | None, drafts: Sequence[int]) -> torch.Tensor | None:
        """allowed [k + 1, V]: row j the mask after drafts[:j] (see the NOTE); None if unconstrained."""
        if state is None or not state.active:
            return None
        llg_torch = _llg_torch()
        bitmask = llg_torch.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        consumed = 0
        for j in range(len(drafts) + 1):
            llg_torch.fill_next_token_bitmask(state.matcher, bitmask, j)
            if j == len(drafts) or state.matcher.is_stopped() or not state.matcher.try_consume_tokens([drafts[j]]):
                break
            consumed += 1
        state.matcher.rollback(consumed)
        return unpack_bitmask(bitmask, self.vocab_size)


def _llg_torch():
    """llguidance's torch helpers, imported at the first constrained step: the import pulls in
    torch._dynamo and triton (about 2 s), which an engine serving no grammar never needs."""
    import llguidance.torch

    return llguidance.torch
