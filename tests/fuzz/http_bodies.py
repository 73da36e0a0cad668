"""Hostile HTTP requests for the gateway, built from its published /openapi.json.

Schemathesis (tests/fuzz/test_http_fuzz.py) draws bodies that a JSON encoder can write: valid
ones, and ones that break the schema. What it never sends is what breaks JSON decoders and
encoders further in, so this module adds it:

- JSON tokens Python's json module reads into trouble: numbers past float range (1e400 -> inf),
  NaN/Infinity, integers of thousands of digits, nesting thousands of levels deep;
- lone UTF-16 surrogates (``"\\ud800"``) in values and in object keys, NUL and control characters;
- wrong types and unknown fields at every property the schema names, and inside chat messages;
- bodies that are empty, not JSON, not UTF-8, truncated, top-level non-objects, BOM-prefixed,
  or with duplicate keys; odd Content-Type and Authorization headers;
- path parameters with percent-encoded bytes that are not UTF-8, NUL, dot segments, 10 kB ids.

Operations, property names and required fields come from the document, so a new property or
operation is fuzzed without a change here; `VALID` holds one valid value per required property.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

VALID = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
         "tokens": [104, 105], "input": "hi"}
"""A valid value for each property a body schema requires (KeyError here: the schema gained a
required property; add a value for it)."""


@dataclass(frozen=True)
class Raw:
    """A JSON token written as it is (json.dumps cannot write 1e400 or a 5,000-digit integer)."""

    text: str


def dumps(value: Any) -> str:
    """JSON text of `value`, with `Raw` tokens inlined and lone surrogates as \\u escapes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{dumps(str(k))}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate becomes the escape \ud800


def _nested(depth: int, kind: str) -> Raw:
    if kind == "array":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


RAW_TOKENS = st.sampled_from([
    Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("-0"),
    Raw("9" * 5000), Raw("-" + "9" * 5000), Raw("1" + "0" * 30), Raw("18446744073709551616"),
    _nested(100, "array"), _nested(1500, "array"), _nested(1500, "object"), _nested(20000, "array"),
])
HOSTILE_STRINGS = st.sampled_from([
    "\ud800", "a\udc00b", "\ud83d", "\udfff\ud800", "\x00", "\x1b[31m", "", " ", "tiny", "cascade",
    "tiny\x00", "<|im_start|>", "<|im_end|>", "{{ messages }}", "\u202e", "\ufeff", "x" * 300,
    "word " * 2000, "\U0001f642" * 50,
])
_scalars = st.one_of(
    RAW_TOKENS, HOSTILE_STRINGS, st.text(max_size=12), st.booleans(), st.none(),
    st.sampled_from([0, -1, 1, 2, 16, 17, 256, 257, 2**31, 2**32, 2**63, 2**64, -2**63, 10**30]),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.5, -0.0, 1e-300, 1e300]))
_keys = st.one_of(st.sampled_from(["type", "text", "role", "content", "id", "top_k", "lossy", "kv_codec",
                                   "\ud800", "", "__proto__"]), st.text(max_size=8))
values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(_keys, inner, max_size=4)),
                      max_leaves=8)
"""Any JSON value, hostile leaves included."""


def _message(props: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A chat message with some fields hostile (role, content, name, a content part, unknown)."""
    names = sorted(props.get("messages", {}).get("items", {}).get("properties", {})) or ["role", "content"]

    @st.composite
    def build(draw) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "user", "content": "hi"}
        for _ in range(draw(st.integers(1, 2))):
            msg[draw(st.sampled_from([*names, "unknown"]))] = draw(st.one_of(
                values, st.sampled_from(["system", "developer", "assistant", "tool"]),
                st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]),
                                                "text": values}), max_size=3)))
        return msg
    return build()


def body_schemas(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """POST path -> its JSON body schema (references resolved one level), from /openapi.json."""
    schemas = document["components"]["schemas"]
    out = {}
    for path, ops in document["paths"].items():
        op = ops.get("post")
        if op is None:
            continue
        node = op["requestBody"]["content"]["application/json"]["schema"]
        ref = node["$ref"] if "$ref" in node else node["oneOf"][0]["$ref"]  # /tokenize: prompt or messages
        schema = dict(schemas[ref.rsplit("/", 1)[1]])
        props = {}
        for name, prop in schema.get("properties", {}).items():  # resolve the messages' item ref
            items = prop.get("items", {})
            if "$ref" in items:
                prop = {**prop, "items": schemas[items["$ref"].rsplit("/", 1)[1]]}
            props[name] = prop
        out[path] = {**schema, "properties": props}
    return out


def bodies(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body (the schema's required properties) with 0-3 properties set to hostile values,
    removed, or added unknown."""
    props = schema["properties"]
    base = {name: VALID[name] for name in schema.get("required", [])}

    @st.composite
    def build(draw) -> dict[str, Any]:
        body = dict(base)
        for _ in range(draw(st.integers(0, 3))):
            name = draw(st.one_of(st.sampled_from(sorted(props)), _keys))
            how = draw(st.sampled_from(["hostile", "hostile", "remove", "messages"]))
            if how == "remove":
                body.pop(name, None)
            elif how == "messages" and "messages" in props:
                body["messages"] = draw(st.lists(_message(props), min_size=1, max_size=3))
            else:
                body[name] = draw(values)
        return body
    return build()


_BROKEN = st.sampled_from([
    b"", b" ", b"{", b'{"model": "tiny", ', b"[]", b"null", b'"x"', b"1e400", b"\xff\xfe", b"\x00",
    b'\xef\xbb\xbf{"model": "tiny", "prompt": "hi"}', b'{"model": "tiny", "prompt": "\xff\xfe"}',
    b'{"model": "tiny", "prompt": "hi", "prompt": 5}', b'{"model": "tiny", "prompt": "hi"}{}',
    b'{"model": "tiny", "prompt": "\\ud800\\udc00"}', b'{"model": "tiny", "prompt": "\\uZZZZ"}',
    "{\"model\": \"tiny\", \"prompt\": \"hi\"}".encode("utf-16"),
])


def raw_bodies(schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Encoded `bodies`, some cut short, and bodies that are not a JSON object at all."""
    encoded = bodies(schema).map(lambda b: dumps(b).encode("utf-8", "surrogatepass"))
    truncated = st.tuples(encoded, st.integers(0, 200)).map(lambda t: t[0][:t[1]])
    return st.one_of(encoded, encoded, encoded, truncated, _BROKEN)


headers = st.fixed_dictionaries({}, optional={
    "content-type": st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-16",
                                     "multipart/form-data; boundary=x", ""]),
    "authorization": st.sampled_from(["Bearer any-key", "", "Bearer", "Basic eDp5", "Bearer " + "k" * 10000]),
    "traceparent": st.sampled_from(["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "garbage",
                                    "00-" + "0" * 32 + "-" + "0" * 16 + "-01"]),
})
"""Request headers (latin-1 text, as HTTP carries them)."""

model_ids = st.one_of(
    st.sampled_from(["tiny", "cascade", "%ED%A0%80", "%FF", "%00", "..%2F..%2Fhealth", "a" * 10000, "%25",
                     "tiny%20", "tiny/extra", "%C0%AE%C0%AE"]),
    st.text(st.characters(min_codepoint=0x30, max_codepoint=0x7A), max_size=20))
"""Path parameter ids for GET /v1/models/{model_id}, already percent-encoded."""
