"""Structured-output constraints and their grammars, shared by the gateway (which checks a
request's constraint before it goes upstream) and the engine (which enforces it).

The grammar library is llguidance; this module needs no tokenizer and no torch: it builds a
constraint's grammar and checks that it compiles, with the library's own message when it does not.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from functools import lru_cache

import llguidance

from kvmesh.errors import InvalidArgument
from kvmesh.limits import MAX_CONSTRAINT_CHARS


class ConstraintKind(str, enum.Enum):
    """The language a structured output is constrained to (mirrors kvmesh.engine.v1.StructuredOutput)."""

    JSON_SCHEMA = "json_schema"
    """One JSON value valid against a JSON Schema (`Constraint.text`)."""
    JSON_OBJECT = "json_object"
    """Any JSON object."""
    REGEX = "regex"
    """A match of the regular expression `Constraint.text`, whole."""
    CHOICE = "choice"
    """Exactly one of `Constraint.choices`."""
    GRAMMAR = "grammar"
    """A sentence of the Lark or GBNF grammar `Constraint.text`."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Constraint:
    """What the output must be (structured output): the sampler masks every token that cannot
    continue a valid output (services/engine/structured.py)."""

    kind: ConstraintKind
    text: str = ""
    """The JSON schema (JSON text), regex or grammar; empty for JSON_OBJECT and CHOICE."""
    choices: tuple[str, ...] = ()
    """CHOICE's strings."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))

    def validate(self) -> None:
        """Shape checks only (InvalidArgument); `check_grammar` compiles."""
        size = len(self.text) + sum(len(c) for c in self.choices)
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidArgument(f"the {self.kind} constraint is {size} characters long; the limit "
                                  f"is {MAX_CONSTRAINT_CHARS}")
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidArgument("a choice constraint needs at least one choice, each a "
                                      "non-empty string")
        elif self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR):
            if not self.text:
                raise InvalidArgument(f"the {self.kind} constraint is empty; send the {self.kind}")


JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (no whitespace between tokens): a model cannot spend its budget on blank lines,
and every output is as short as the value allows."""


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked: see `check_grammar`)."""
    try:
        return _grammar_text(c)
    except (ValueError, TypeError) as e:  # the library's own complaint about the specification
        raise InvalidArgument(f"the {c.kind} constraint is invalid: {e}") from None


def _grammar_text(c: Constraint) -> str:
    if c.kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise InvalidArgument(f"the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if c.kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if c.kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(c.text)
    if c.kind is ConstraintKind.CHOICE:
        return llguidance.grammar_from("choice", list(c.choices))  # type: ignore[arg-type]
    return llguidance.grammar_from("grammar", c.text)


@lru_cache(maxsize=256)
def check_grammar(c: Constraint) -> str:
    """The constraint's grammar, or InvalidArgument with the library's message. Needs no
    tokenizer, so the gateway checks with it too."""
    c.validate()
    grammar = grammar_text(c)
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message:
        raise InvalidArgument(f"the {c.kind} constraint does not compile: {message.strip()}")
    return grammar


