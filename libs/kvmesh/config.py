"""One frozen config dataclass per service, filled from flags and `KVMESH_<SERVICE>_*` env vars.

    @dataclass(frozen=True)
    class KvcacheConfig:
        \"\"\"The kvcache service.\"\"\"
        port: int = setting(50071, "gRPC port; 0 picks a free one.", min=0, max=65535)
        tiers: tuple[str, ...] = setting(("memory", "disk"), "Storage tiers, fastest first.",
                                         choices=("memory", "disk", "redis"))

    cfg = load_config(KvcacheConfig, "kvcache")   # --port 1 > KVMESH_KVCACHE_PORT=2 > default
    log.info("config: %s", describe(cfg))

Supported field types: str, int, float, bool (1/0, true/false, yes/no, on/off), pathlib.Path,
Literal[...], tuple[X, ...] (comma-separated) and Optional[X] (an empty value or "none" unsets
it). Every problem is a `ConfigError` naming the flag or variable, the bad value and the fix.

A field whose type is itself a frozen settings dataclass is a group: its fields are flags of
their own, named as if declared at the top (`--port`, `KVMESH_KVCACHE_PORT`), and the field's
default instance gives their defaults. Settings every service shares are declared once that way:

        server: ServerSettings = ServerSettings(port=50071)   # cfg.server.port
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

_META_KEY = "kvmesh.setting"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class _Meta:
    help: str
    choices: tuple[Any, ...] | None
    min: float | None
    max: float | None
    secret: bool
    aliases: tuple[str, ...] = ()


def setting(default: Any, help: str, *, choices: typing.Iterable[Any] | None = None,
            min: float | None = None, max: float | None = None, secret: bool = False,
            aliases: typing.Iterable[str] = ()) -> Any:
    """Declare a config field: its default, help text (shown by --help) and constraints.

    `choices` limits the value (each element, for tuples); `min`/`max` bound numbers
    (inclusive); `secret` masks the value in `describe`; `aliases` are former names of the field,
    whose flags and variables still work for a release, with a warning that names the new one.
    """
    meta = _Meta(help, tuple(choices) if choices is not None else None, min, max, secret,
                 tuple(aliases))
    return dataclasses.field(default=default, metadata={_META_KEY: meta})


class _BadValue(ValueError):
    """Raised by converters; the message describes what was expected."""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported config type {tp}: only Optional[X] unions are allowed")
    return tp, False


def _converter(tp: Any) -> Callable[[str], Any]:
    """A function str -> value for the annotation `tp`; raises _BadValue on bad input."""
    inner, optional = _unwrap_optional(tp)
    if optional:
        convert_inner = _converter(inner)
        return lambda raw: None if raw.strip().lower() in ("", "none") else convert_inner(raw)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        options = typing.get_args(tp)

        def literal(raw: str) -> Any:
            for option in options:
                if str(option) == raw.strip():
                    return option
            raise _BadValue(f"one of {', '.join(map(str, options))}")
        return literal
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported config type {tp}: use tuple[X, ...]")
        element = _converter(args[0])
        return lambda raw: tuple(element(part.strip()) for part in raw.split(",") if part.strip())
    if tp is bool:
        def boolean(raw: str) -> bool:
            word = raw.strip().lower()
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            raise _BadValue("a boolean: true/false, 1/0, yes/no or on/off")
        return boolean
    simple: dict[Any, tuple[Callable[[str], Any], str]] = {
        int: (lambda raw: int(raw.strip()), "a whole number"),
        float: (lambda raw: float(raw.strip()), "a number"),
        str: (str, "a string"),
        Path: (lambda raw: Path(raw).expanduser(), "a path"),
    }
    if tp not in simple:
        raise TypeError(f"unsupported config type {tp!r}")
    fn, expected = simple[tp]

    def convert(raw: str) -> Any:
        try:
            return fn(raw)
        except ValueError:
            raise _BadValue(expected) from None
    return convert


def _check_constraints(value: Any, meta: _Meta) -> str | None:
    """The problem with an already-converted value, or None when it satisfies `meta`."""
    for item in value if isinstance(value, tuple) else (value,):
        if item is None:
            continue
        if meta.choices is not None and item not in meta.choices:
            return f"not one of {', '.join(map(str, meta.choices))}"
        if meta.min is not None and item < meta.min:
            return f"below the minimum {meta.min}"
        if meta.max is not None and item > meta.max:
            return f"above the maximum {meta.max}"
    return None


def _render(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return str(value).lower()
    return "" if value is None else str(value)


@dataclasses.dataclass(frozen=True)
class _Field:
    path: tuple[str, ...]  # attribute path from the config root: ("port",), ("server", "port")
    flag: str
    env: str
    convert: Callable[[str], Any]
    is_bool: bool
    default: Any
    meta: _Meta

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def alias_flags(self) -> tuple[str, ...]:
        return tuple("--" + a.replace("_", "-") for a in self.meta.aliases)

    @property
    def alias_envs(self) -> tuple[str, ...]:
        prefix = self.env[: len(self.env) - len(self.name)]
        return tuple(prefix + a.upper() for a in self.meta.aliases)


def _is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _fields(cls: type, service: str) -> list[_Field]:
    fields = list(_walk(cls, env_prefix(service), None, ()))
    seen: set[str] = set()
    for f in fields:
        if f.flag in seen:
            raise TypeError(f"{cls.__name__}: {f.flag} is declared twice (a group's field and "
                            "another field share the name); rename one")
        seen.add(f.flag)
    return fields


def _walk(cls: type, prefix: str, defaults: Any, path: tuple[str, ...]) -> Iterator[_Field]:
    """The flags of `cls`, groups flattened; `defaults` (a `cls` instance) overrides the defaults
    its fields declare."""
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__} must be a @dataclass(frozen=True)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if defaults is None else getattr(defaults, f.name)
        if _is_group(hints[f.name]):
            if not isinstance(default, hints[f.name]):
                raise TypeError(f"{cls.__name__}.{f.name} needs a default instance, e.g. "
                                f"{f.name}: {hints[f.name].__name__} = {hints[f.name].__name__}()")
            yield from _walk(hints[f.name], prefix, default, path + (f.name,))
            continue
        meta = f.metadata.get(_META_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} needs a help text: declare it with "
                            "kvmesh.config.setting(default, help)")
        yield _Field(path + (f.name,), "--" + f.name.replace("_", "-"), prefix + f.name.upper(),
                     _converter(hints[f.name]), _unwrap_optional(hints[f.name])[0] is bool,
                     default, meta)


def _assemble(cls: type[T], values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> T:
    """`cls` built from the resolved values by path, its groups built first."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.init:
            kwargs[f.name] = (_assemble(hints[f.name], values, path + (f.name,))
                              if _is_group(hints[f.name]) else values[path + (f.name,)])
    return cls(**kwargs)


def command(service: str) -> str:
    """The command that starts `service` (`python -m kvmesh.services.<service>`), as help and error
    texts name it."""
    return f"python -m kvmesh.services.{service}"


def env_prefix(service: str) -> str:
    """`KVMESH_<SERVICE>_`, the prefix of a service's environment variables."""
    return f"KVMESH_{service.upper().replace('-', '_')}_"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message}; see {self.prog} --help")


def _build_parser(cls: type, service: str, fields: list[_Field]) -> _Parser:
    doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else None
    from kvmesh import __version__

    parser = _Parser(
        prog=command(service), description=doc, allow_abbrev=False,
        epilog=f"Every flag can also be set with its {env_prefix(service)}* environment variable "
               "(shown with each flag); a flag wins over the variable, the variable over the "
               "default.")
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}",
                        help="print the kvmesh version and exit")
    for f in fields:
        shown = "***" if f.meta.secret and f.default else _render(f.default) or "unset"
        text = f"{f.meta.help} [env {f.env}; default: {shown}]".replace("%", "%%")
        metavar = ("{" + ",".join(map(str, f.meta.choices)) + "}" if f.meta.choices
                   else f.name.upper())
        if f.meta.aliases:
            text += f" (formerly {', '.join(f.alias_flags)}, still accepted for one release)"
        parser.add_argument(f.flag, *f.alias_flags, dest=f.name, default=argparse.SUPPRESS, help=text,
                            metavar=metavar, nargs="?" if f.is_bool else None,
                            const="true" if f.is_bool else None)
    return parser


def _unknown_flag(extra: list[str], fields: list[_Field], service: str) -> ConfigError:
    word = extra[0].split("=", 1)[0]
    if not word.startswith("-"):
        return ConfigError(f"unexpected argument {word!r}; {command(service)} takes only --flags")
    close = difflib.get_close_matches(word, [f.flag for f in fields], n=1)
    hint = f"did you mean {close[0]}?" if close else f"see {command(service)} --help"
    return ConfigError(f"unknown flag {word}; {hint}")


def _check_env_names(environ: Mapping[str, str], fields: list[_Field], service: str) -> None:
    prefix, known = env_prefix(service), {e for f in fields for e in (f.env, *f.alias_envs)}
    for name in sorted(environ):
        if name.startswith(prefix) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = (f"did you mean {close[0]}?" if close
                    else f"{command(service)} --help lists the known ones.")
            raise ConfigError(f"unknown environment variable {name} (no such {service} setting); "
                              f"{hint} Unset or rename it.")


def _resolve(f: _Field, flags: Mapping[str, str], environ: Mapping[str, str]) -> Any:
    old_env = next((e for e in f.alias_envs if e in environ), None)
    if f.name in flags:
        raw, where, fix = flags[f.name], f"{f.flag} {flags[f.name]!r}", f"pass {f.flag} "
    elif old_env is not None and f.env not in environ:
        log.warning("%s is deprecated and will be removed in the next release; set %s instead",
                    old_env, f.env)
        raw, where, fix = environ[old_env], f"{old_env}={environ[old_env]!r}", f"set {f.env}="
    elif f.env in environ:
        raw, where, fix = environ[f.env], f"{f.env}={environ[f.env]!r}", f"set {f.env}="
    else:
        problem = _check_constraints(f.default, f.meta)
        if problem:
            raise ConfigError(f"the default of {f.flag} ({f.default!r}) is {problem}; pass "
                              f"{f.flag} or set {f.env} to a valid value")
        return f.default
    rendered = _render(f.default)
    example = ""
    if rendered and _check_constraints(f.default, f.meta) is None:
        example = f"for example {fix}{rendered}"
    try:
        value = f.convert(raw)
    except _BadValue as e:
        raise ConfigError(f"{where} is not {e}; {example or f'give {e}'}") from None
    problem = _check_constraints(value, f.meta)
    if problem:
        bounds = []
        if f.meta.choices is not None:
            bounds.append(f"one of {', '.join(map(str, f.meta.choices))}")
        if f.meta.min is not None:
            bounds.append(f">= {f.meta.min}")
        if f.meta.max is not None:
            bounds.append(f"<= {f.meta.max}")
        raise ConfigError(f"{where} is {problem}; use {' and '.join(bounds)}"
                          + (f", {example}" if example else ""))
    return value


def load_config(cls: type[T], service: str, argv: list[str] | None = None,
                environ: Mapping[str, str] | None = None) -> T:
    """Build `cls` from `argv` (default sys.argv[1:]) and `environ` (default os.environ).

    Precedence: flag > `KVMESH_<SERVICE>_<FIELD>` > default. Unknown flags and unknown
    `KVMESH_<SERVICE>_*` variables are errors (typo protection). After conversion and the
    per-field checks, the dataclass's own `validate()` runs if it has one (a ValueError from it
    becomes a ConfigError). `--help` prints every flag with its env var and exits.
    """
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    fields = _fields(cls, service)
    parser = _build_parser(cls, service, fields)
    namespace, extra = parser.parse_known_args(argv)
    if extra:
        raise _unknown_flag(extra, fields, service)
    for f in fields:
        for old in f.alias_flags:
            if any(a == old or a.startswith(old + "=") for a in argv):
                log.warning("%s is deprecated and will be removed in the next release; pass %s instead",
                            old, f.flag)
    _check_env_names(environ, fields, service)
    flags = vars(namespace)
    cfg = _assemble(cls, {f.path: _resolve(f, flags, environ) for f in fields})
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{service} config: {e}") from e
    return cfg


def describe(cfg: object) -> str:
    """One line with every field of `cfg` (secrets masked, groups flattened as their flags are),
    for logging once at start."""
    return f"{type(cfg).__name__}(" + ", ".join(_described(cfg)) + ")"


def _described(cfg: object) -> Iterator[str]:
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _described(value)
            continue
        meta = f.metadata.get(_META_KEY)
        if meta is not None and meta.secret and value:
            shown = "***"
        elif isinstance(value, (Path, tuple)):
            shown = _render(value)
        else:
            shown = repr(value)
        yield f"{f.name}={shown}"
