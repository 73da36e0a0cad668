"""Why a request's bytes are not a valid protobuf message, naming the field where it can.

protobuf refuses a message whose `string` field holds bytes that are not UTF-8 (a UTF-16
surrogate encoded alone, say) with a bare DecodeError, and grpc answers a request it cannot
deserialize with INTERNAL. kvmesh's servers answer INVALID_ARGUMENT instead (the interceptor in
kvmesh.rpc.interceptors), with the field's path from `describe_invalid`: the wire format walked
with the message's descriptor, down to the first string field that does not decode.
"""
from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_MAX_DEPTH = 64


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        b = raw[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def invalid_string_field(descriptor: Descriptor, raw: bytes, path: str = "", depth: int = 0) -> str | None:
    """The path (``messages[2].content``) of the first string field in `raw` (a serialized
    `descriptor` message) whose bytes are not UTF-8, or None. Raises ValueError where the bytes
    are not protobuf wire format at all."""
    if depth > _MAX_DEPTH:
        raise ValueError("messages nested too deep")
    counts: dict[int, int] = {}
    i = 0
    while i < len(raw):
        key, i = _varint(raw, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(raw, i)
            continue
        if wire == 1 or wire == 5:
            i += 8 if wire == 1 else 4
            continue
        if wire != 2:
            raise ValueError(f"wire type {wire} of field {number}")
        size, i = _varint(raw, i)
        if i + size > len(raw):
            raise ValueError(f"field {number} runs past the message")
        body = raw[i:i + size]
        i += size
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue  # unknown fields are kept, never decoded
        name = f"{path}.{field.name}" if path else field.name
        if field.is_repeated and not _is_map(field):
            index = counts.get(number, 0)
            counts[number] = index + 1
            name = f"{name}[{index}]"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                body.decode("utf-8")
            except UnicodeDecodeError:
                return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = invalid_string_field(field.message_type, body, name, depth + 1)
            if found is not None:
                return found
    return None


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def describe_invalid(descriptor: Descriptor, raw: bytes) -> str:
    """A message for a request `raw` that protobuf refused to parse as `descriptor`."""
    try:
        field = invalid_string_field(descriptor, raw)
    except ValueError as e:
        return f"the request is not a valid {descriptor.full_name} message ({e})"
    if field is not None:
        return (f"invalid value for '{field}': not valid UTF-8 (a lone UTF-16 surrogate?); "
                "string fields must hold valid Unicode")
    return f"the request is not a valid {descriptor.full_name} message"
