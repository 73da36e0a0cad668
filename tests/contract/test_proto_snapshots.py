"""The wire contract of every proto under protos/: a snapshot of its packages, messages (field
numbers, names, types, labels, oneofs, reserved numbers and names), enums and services, committed
beside this test in proto_snapshots/, one file per .proto. A change to any of them fails here
until the snapshot is updated on purpose:

    KVMESH_UPDATE_PROTO_SNAPSHOTS=1 .venv/bin/python -m pytest -p no:cacheprovider -q tests/contract/test_proto_snapshots.py

then review `git diff tests/contract/proto_snapshots/` like any API change: protos are pre-1.0
and every caller lives in this repo, but a removed field's number (and name) is `reserved`, never
reused. Also checked: every message, field, oneof, enum, enum value, service and RPC has a comment.
"""
from __future__ import annotations

import importlib.resources
import os
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"
SNAPSHOTS = Path(__file__).resolve().parent / "proto_snapshots"
UPDATE = os.environ.get("KVMESH_UPDATE_PROTO_SNAPSHOTS") == "1"
HOW_TO_UPDATE = ("if the change is deliberate, update the snapshots with\n"
                 "    KVMESH_UPDATE_PROTO_SNAPSHOTS=1 .venv/bin/python -m pytest -p no:cacheprovider -q "
                 "tests/contract/test_proto_snapshots.py\n"
                 "and review `git diff tests/contract/proto_snapshots/` (reserve removed numbers, never reuse them)")

F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {getattr(F, name): name.removeprefix("TYPE_").lower() for name in F.Type.keys()}
# source_code_info paths (descriptor.proto field numbers)
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM, _MESSAGE_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2


def _compile() -> descriptor_pb2.FileDescriptorSet:
    sources = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    with tempfile.TemporaryDirectory(prefix="kvmesh-proto-snapshot-") as tmp:
        out = Path(tmp) / "set.pb"
        well_known = importlib.resources.files("grpc_tools") / "_proto"
        args = ["grpc_tools.protoc", f"-I{PROTOS}", f"-I{well_known}", "--include_source_info",
                f"--descriptor_set_out={out}", *sources]
        assert protoc.main(args) == 0, "protoc rejected the protos (see its errors above)"
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@pytest.fixture(scope="module")
def files() -> list[descriptor_pb2.FileDescriptorProto]:
    return list(_compile().file)


def _type(field: descriptor_pb2.FieldDescriptorProto,
          maps: dict[str, descriptor_pb2.DescriptorProto]) -> str:
    if field.type_name in maps:
        key, value = maps[field.type_name].field
        return f"map<{_type(key, maps)}, {_type(value, maps)}>"
    if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
        return field.type_name.lstrip(".")
    return _SCALARS[field.type]


def _label(field: descriptor_pb2.FieldDescriptorProto, map_field: bool) -> str:
    if map_field:
        return ""
    if field.label == F.LABEL_REPEATED:
        return "repeated "
    return "optional " if field.proto3_optional else ""


def _message(msg: descriptor_pb2.DescriptorProto, scope: str, out: list[str]) -> None:
    name = f"{scope}.{msg.name}"
    maps = {f".{name}.{n.name}": n for n in msg.nested_type if n.options.map_entry}
    out.append(f"message {name}")
    for r in msg.reserved_range:
        out.append(f"  reserved {r.start}" + (f" to {r.end - 1}" if r.end - 1 > r.start else ""))
    for reserved in msg.reserved_name:
        out.append(f'  reserved "{reserved}"')
    for field in sorted(msg.field, key=lambda f: f.number):
        oneof = ""
        if field.HasField("oneof_index") and not field.proto3_optional:
            oneof = f"  (oneof {msg.oneof_decl[field.oneof_index].name})"
        out.append(f"  {field.number} {_label(field, field.type_name in maps)}{_type(field, maps)} "
                   f"{field.name}{oneof}")
    for enum in msg.enum_type:
        _enum(enum, name, out)
    for nested in msg.nested_type:
        if not nested.options.map_entry:
            _message(nested, name, out)


def _enum(enum: descriptor_pb2.EnumDescriptorProto, scope: str, out: list[str]) -> None:
    out.append(f"enum {scope}.{enum.name}")
    for r in enum.reserved_range:
        out.append(f"  reserved {r.start}" + (f" to {r.end}" if r.end > r.start else ""))
    for reserved in enum.reserved_name:
        out.append(f'  reserved "{reserved}"')
    for value in sorted(enum.value, key=lambda v: v.number):
        out.append(f"  {value.number} {value.name}")


def render(f: descriptor_pb2.FileDescriptorProto) -> str:
    """The contract of one .proto as sorted text lines (declaration order is not part of it)."""
    out = [f"# protos/{f.name}: regenerate with KVMESH_UPDATE_PROTO_SNAPSHOTS=1 (see "
           "tests/contract/test_proto_snapshots.py)", f"package {f.package}"]
    out += [f"import {d}" for d in sorted(f.dependency)]
    for service in sorted(f.service, key=lambda s: s.name):
        out.append(f"service {f.package}.{service.name}")
        for m in sorted(service.method, key=lambda m: m.name):
            stream_in = "stream " if m.client_streaming else ""
            stream_out = "stream " if m.server_streaming else ""
            out.append(f"  rpc {m.name}({stream_in}{m.input_type.lstrip('.')}) returns "
                       f"({stream_out}{m.output_type.lstrip('.')})")
    for enum in sorted(f.enum_type, key=lambda e: e.name):
        _enum(enum, f.package, out)
    for msg in sorted(f.message_type, key=lambda m: m.name):
        _message(msg, f.package, out)
    return "\n".join(out) + "\n"


def _snapshot_path(f: descriptor_pb2.FileDescriptorProto) -> Path:
    return SNAPSHOTS / (f.name.removesuffix(".proto").replace("/", ".") + ".txt")


def test_every_proto_matches_its_snapshot(files):
    wanted = {_snapshot_path(f): render(f) for f in files}
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        for stale in set(SNAPSHOTS.glob("*.txt")) - set(wanted):
            stale.unlink()
        for path, text in wanted.items():
            path.write_text(text)
    problems = []
    for path, text in sorted(wanted.items()):
        if not path.exists():
            problems.append(f"{path.name}: no snapshot for this proto yet")
        elif path.read_text() != text:
            have, want = path.read_text().splitlines(), text.splitlines()
            gone = [line for line in have if line not in want]
            new = [line for line in want if line not in have]
            problems.append(f"{path.name}: the contract changed\n"
                            + "".join(f"    - {line}\n" for line in gone)
                            + "".join(f"    + {line}\n" for line in new))
    orphans = sorted(p.name for p in set(SNAPSHOTS.glob("*.txt")) - set(wanted))
    problems += [f"{name}: a snapshot without a proto (was it removed or renamed?)" for name in orphans]
    assert not problems, "\n".join(problems) + "\n" + HOW_TO_UPDATE


def _commented(f: descriptor_pb2.FileDescriptorProto) -> set[tuple[int, ...]]:
    return {tuple(loc.path) for loc in f.source_code_info.location
            if loc.leading_comments.strip() or loc.trailing_comments.strip()}


def _message_gaps(msg: descriptor_pb2.DescriptorProto, path: tuple[int, ...], name: str,
                  commented: set[tuple[int, ...]]) -> list[str]:
    if msg.options.map_entry:
        return []
    gaps = [] if path in commented else [f"message {name}"]
    for i, field in enumerate(msg.field):
        if path + (_MESSAGE_FIELD, i) not in commented:
            gaps.append(f"field {name}.{field.name}")
    for i, oneof in enumerate(msg.oneof_decl):
        synthetic = any(f.proto3_optional and f.oneof_index == i for f in msg.field)
        if not synthetic and path + (_MESSAGE_ONEOF, i) not in commented:
            gaps.append(f"oneof {name}.{oneof.name}")
    for i, enum in enumerate(msg.enum_type):
        gaps += _enum_gaps(enum, path + (_MESSAGE_ENUM, i), f"{name}.{enum.name}", commented)
    for i, nested in enumerate(msg.nested_type):
        gaps += _message_gaps(nested, path + (_MESSAGE_NESTED, i), f"{name}.{nested.name}", commented)
    return gaps


def _enum_gaps(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], name: str,
               commented: set[tuple[int, ...]]) -> list[str]:
    gaps = [] if path in commented else [f"enum {name}"]
    return gaps + [f"enum value {name}.{v.name}" for i, v in enumerate(enum.value)
                   if path + (_ENUM_VALUE, i) not in commented]


def test_every_declaration_has_a_comment(files):
    """Style habit 9: a comment on every message, field, enum value and RPC (say what it means,
    its units and what unset means)."""
    gaps = []
    for f in files:
        commented = _commented(f)
        for i, msg in enumerate(f.message_type):
            gaps += [f"{f.name}: {g}" for g in _message_gaps(msg, (_FILE_MESSAGE, i), msg.name, commented)]
        for i, enum in enumerate(f.enum_type):
            gaps += [f"{f.name}: {g}" for g in _enum_gaps(enum, (_FILE_ENUM, i), enum.name, commented)]
        for i, service in enumerate(f.service):
            if (_FILE_SERVICE, i) not in commented:
                gaps.append(f"{f.name}: service {service.name}")
            gaps += [f"{f.name}: rpc {service.name}.{m.name}" for j, m in enumerate(service.method)
                     if (_FILE_SERVICE, i, _SERVICE_METHOD, j) not in commented]
    assert not gaps, "add a comment (what it means, units, what unset means) to:\n  " + "\n  ".join(gaps)
