"""Hypothesis strategies for protobuf requests, built from message descriptors.

`requests(method, hints, seeds)` draws the serialized bytes of one request of a gRPC method:

- a random message: every field of the input type may be set (nested messages to a depth, repeated
  and map fields, one member of each oneof, enums in and out of range, integers at their type's
  edges, NaN/inf floats, hostile strings);
- a mutated seed: a valid request of the method (`seeds`) with one or two fields, top level or one
  level down, cleared or replaced by a random value, so that generated requests get past the first
  check and reach the service's deeper code;
- then, for some of them, a change on the wire that a message object cannot express: an unknown
  field appended, a string field holding bytes that are not UTF-8 (a lone surrogate), a known field
  with the wrong wire type, deeply nested unknown groups, a length past the end, truncation, or
  bytes that are no message at all.

`hints` maps a field's full name (``kvmesh.gateway.v1.CompleteRequest.model``) to a strategy drawn
instead of the generic one about half the time (a model the service knows, a key of the right
size): domain knowledge that makes more requests valid without narrowing what else is drawn.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

F = FieldDescriptor
MAX_DEPTH = 4
"""Message fields deeper than this stay unset (none of kvmesh's request types is recursive)."""

_INT_RANGES = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1),
    F.TYPE_SFIXED32: (-2**31, 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1),
    F.TYPE_SFIXED64: (-2**63, 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}

HOSTILE_TEXT = (
    "", " ", "\x00", "a\x00b", "\r\n", "\u202e\u2066", "\ufeff", "\U0001f642" * 3, "\u0301" * 40,
    "<|im_start|>", "<|im_end|>", "<|eos|>", "{{ 7*7 }}", "{% for x in y %}", "%s%n%x", "../../etc/passwd",
    "null", "NaN", "-1", "9" * 400, "x" * 300, "word " * 1200, "\\ud800", "\U0010ffff",
)
"""Strings worth trying in any string field (lone surrogates go in on the wire, see `_bad_utf8`)."""

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
strings = st.one_of(st.sampled_from(HOSTILE_TEXT), _text)


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in [lo, hi], biased to the edges and to small values."""
    edges = sorted({v for v in (lo, lo + 1, -1, 0, 1, 2, 16, 255, 256, 2**31 - 1, 2**32 - 1, hi - 1, hi)
                    if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(0, min(hi, 64)), st.integers(lo, hi))


def floats(width: int) -> st.SearchStrategy[float]:
    specials = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-7, 3.4e38, math.nan, math.inf, -math.inf]
    if width == 64:
        specials += [1e308, -1e308, 5e-324]
    return st.one_of(st.sampled_from(specials), st.floats(width=width))


def enums(field: FieldDescriptor) -> st.SearchStrategy[int]:
    """Declared values (mostly) and any other int32 (proto3 enums are open)."""
    values = [v.number for v in field.enum_type.values]
    return st.one_of(st.sampled_from(values), st.sampled_from(values), ints(-2**31, 2**31 - 1))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return ints(*_INT_RANGES[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_FLOAT:
        return floats(32)
    if t == F.TYPE_DOUBLE:
        return floats(64)
    if t == F.TYPE_STRING:
        return strings
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"\x00" * 32, b"\xff" * 16]))
    if t == F.TYPE_ENUM:
        return enums(field)
    raise TypeError(f"no strategy for field type {t} of {field.full_name}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _oneof(field: FieldDescriptor):
    """The real (not proto3-`optional` synthetic) oneof of `field`, or None."""
    return getattr(field, "real_containing_oneof", None)


class Generator:
    """Strategies for the messages of one service, with its `hints` (see the module docstring)."""

    def __init__(self, hints: Mapping[str, st.SearchStrategy[Any]] | None = None) -> None:
        self.hints = dict(hints or {})

    def value(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        """One value of a singular field (or one element of a repeated one)."""
        if field.type == F.TYPE_MESSAGE:
            base = self.message(field.message_type, depth + 1)
        else:
            base = _scalar(field)
        hint = self.hints.get(field.full_name)
        return base if hint is None else st.one_of(hint, base)

    def field(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        """What to assign to `field`: a value, a list, or a dict for a map."""
        if _is_map(field):
            entry = field.message_type
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            return st.dictionaries(self.value(key, depth), self.value(value, depth), max_size=4)
        if field.is_repeated:
            element = self.value(field, depth)
            lists = st.lists(element, max_size=6)
            if field.type != F.TYPE_MESSAGE:  # a long run exercises limits (many stop strings, a long prompt)
                lists = st.one_of(lists, st.lists(element, min_size=40, max_size=400))
            return lists
        return self.value(field, depth)

    def message(self, descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
        """A random `descriptor` message: each field set or not, one member of each oneof at most."""
        cls = GetMessageClass(descriptor)
        if depth > MAX_DEPTH:
            return st.just(cls())
        plain = [f for f in descriptor.fields if _oneof(f) is None]
        oneofs = [o for o in descriptor.oneofs if all(_oneof(f) is o for f in o.fields)]

        @st.composite
        def build(draw) -> Message:
            msg = cls()
            for f in plain:
                if draw(st.booleans()):
                    assign(msg, f, draw(self.field(f, depth)))
            for o in oneofs:
                chosen = draw(st.none() | st.sampled_from(list(o.fields)))
                if chosen is not None:
                    assign(msg, chosen, draw(self.field(chosen, depth)))
            return msg
        return build()

    def mutated(self, seed: Message) -> st.SearchStrategy[Message]:
        """`seed` with one or two fields (top level, or inside a message field the seed sets)
        cleared or set to a random value."""
        @st.composite
        def build(draw) -> Message:
            msg = type(seed)()
            msg.CopyFrom(seed)
            for _ in range(draw(st.integers(1, 2))):
                target, field = draw(st.sampled_from(_field_sites(msg)))
                if draw(st.integers(0, 4)) == 0:
                    target.ClearField(field.name)
                else:
                    target.ClearField(field.name)
                    assign(target, field, draw(self.field(field, 1)))
            return msg
        return build()


def _field_sites(msg: Message) -> list[tuple[Message, FieldDescriptor]]:
    """Every field of `msg`, and of each singular message field that `msg` sets."""
    sites = [(msg, f) for f in msg.DESCRIPTOR.fields]
    for f, value in msg.ListFields():
        if f.type == F.TYPE_MESSAGE and not f.is_repeated:
            sites += [(value, g) for g in value.DESCRIPTOR.fields]
    return sites


def assign(msg: Message, field: FieldDescriptor, value: Any) -> None:
    """Set `field` of `msg` to `value` (a message, scalar, list or dict as `Generator.field` draws)."""
    if _is_map(field):
        target = getattr(msg, field.name)
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        target = getattr(msg, field.name)
        if field.type == F.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


# ---- the wire level: what a message object cannot hold -------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


BAD_UTF8 = (b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xff", b"\xc0\x80", b"\xf4\x90\x80\x80", b"a\xe2\x82")
"""A lone surrogate (high, low) as UTF-8, a byte never in UTF-8, an overlong NUL, a code point past
U+10FFFF, a truncated sequence."""


def _string_paths(descriptor: Descriptor, depth: int = 0) -> list[list[FieldDescriptor]]:
    """Field paths (message fields, then a string field) to every string field, 2 levels down."""
    paths = []
    for f in descriptor.fields:
        if f.type == F.TYPE_STRING:
            paths.append([f])
        elif f.type == F.TYPE_MESSAGE and depth < 2:
            paths += [[f, *rest] for rest in _string_paths(f.message_type, depth + 1)]
    return paths


@st.composite
def _bad_utf8(draw, descriptor: Descriptor) -> bytes:
    """A field occurrence that puts non-UTF-8 bytes into a (possibly nested) string field; parsed
    after the rest of a message, it merges into it."""
    paths = _string_paths(descriptor)
    if not paths:
        return b""
    path = draw(st.sampled_from(paths))
    payload = draw(st.sampled_from(["", "ok ", "x" * 20])).encode() + draw(st.sampled_from(BAD_UTF8))
    out = length_delimited(path[-1].number, payload)
    for f in reversed(path[:-1]):
        out = length_delimited(f.number, out)
    return out


@st.composite
def _unknown_field(draw, descriptor: Descriptor) -> bytes:
    known = {f.number for f in descriptor.fields}
    number = draw(st.one_of(st.integers(1, 40), st.integers(1, 2**29 - 1)).filter(lambda n: n not in known))
    wire = draw(st.sampled_from([0, 1, 2, 5]))
    if wire == 0:
        return tag(number, 0) + varint(draw(st.integers(0, 2**64 - 1)))
    if wire == 1:
        return tag(number, 1) + draw(st.binary(min_size=8, max_size=8))
    if wire == 5:
        return tag(number, 5) + draw(st.binary(min_size=4, max_size=4))
    return length_delimited(number, draw(st.binary(max_size=32)))


@st.composite
def _wrong_wire_type(draw, descriptor: Descriptor) -> bytes:
    if not descriptor.fields:
        return b""
    f = draw(st.sampled_from(list(descriptor.fields)))
    wire = draw(st.sampled_from([0, 1, 2, 5]))
    body = {0: varint(7), 1: b"\x01" * 8, 2: varint(3) + b"abc", 5: b"\x01" * 4}[wire]
    return tag(f.number, wire) + body


def deep_groups(depth: int, number: int = 1999) -> bytes:
    """`depth` unknown groups nested in each other (protobuf parses groups recursively)."""
    return tag(number, 3) * depth + tag(number, 4) * depth


def wire_requests(descriptor: Descriptor, messages: st.SearchStrategy[Message]) -> st.SearchStrategy[bytes]:
    """Serialized `messages`, mostly as they are, else with one wire-level change (see the module
    docstring), or bytes that are no message."""
    serialized = messages.map(lambda m: m.SerializeToString())

    @st.composite
    def changed(draw) -> bytes:
        raw = draw(serialized)
        how = draw(st.sampled_from(["unknown", "bad_utf8", "wrong_wire", "groups", "past_end", "truncate"]))
        if how == "unknown":
            return raw + draw(_unknown_field(descriptor))
        if how == "bad_utf8":
            return raw + draw(_bad_utf8(descriptor))
        if how == "wrong_wire":
            return raw + draw(_wrong_wire_type(descriptor))
        if how == "groups":
            return raw + deep_groups(draw(st.sampled_from([1, 50, 101, 1000, 20000])))
        if how == "past_end":
            return raw + tag(draw(st.integers(1, 20)), 2) + varint(draw(st.integers(1, 2**40)))
        return raw[:draw(st.integers(0, max(len(raw) - 1, 0)))]

    noise = st.one_of(st.binary(max_size=64), st.sampled_from([b"\xff" * 10, b"\x80" * 11, b"\x0b" * 5000,
                                                               b"\x00", b"\x07", b"\x0f"]))
    return st.one_of(serialized, serialized, changed(), noise)


def requests(method: MethodDescriptor, gen: Generator, seeds: Sequence[Message] = ()
             ) -> st.SearchStrategy[bytes]:
    """Serialized requests of `method` (see the module docstring)."""
    messages = gen.message(method.input_type)
    if seeds:
        messages = st.one_of(messages, st.sampled_from(list(seeds)), st.one_of([gen.mutated(s) for s in seeds]))
    return wire_requests(method.input_type, messages)
