"""The router's topology: tiers of replicas and cascade routes over tiers, parsed from two
compact textual specs (flags or KVMESH_ROUTER_* variables) into small frozen dataclasses.

    --tiers    "cheap=127.0.0.1:50062@0.6;strong=127.0.0.1:50061,127.0.0.1:50063@1.0"
    --cascades "auto=cheap,strong"

A tier is `NAME=REPLICA[,REPLICA...][@COST]`, tiers separated by `;`. COST is the tier's cost
per generated token (any unit, default 1.0). A REPLICA is a kvmesh engine `host:port`, or an
OpenAI-compatible HTTP endpoint `http(s)://host:port/v1#MODEL` (the part after `#` is the model
name sent in its requests). An engine may carry a P/D role, `host:port/prefill` or
`host:port/decode` (engines started with the same --role): a tier with both kinds serves long
prompts disaggregated (see the NOTE on P/D in pool.py). A cascade is `NAME=TIER,TIER[,...]`, cheapest tier first, cascades
separated by `;`. Names are letters, digits and `._:/-`, unique over tiers and cascades.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvmesh.config import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9._:/-]+$")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")

TIERS_HELP = (
    "Tiers: NAME=REPLICA[,REPLICA...][@COST], separated by ';'. A REPLICA is a kvmesh engine "
    "host:port or an OpenAI-compatible endpoint http(s)://host:port/v1#MODEL; COST is the cost "
    "per generated token (default 1.0). Example: "
    "'cheap=127.0.0.1:50062@0.6;strong=127.0.0.1:50061,127.0.0.1:50063@1.0'.")
CASCADES_HELP = (
    "Cascade routes: NAME=TIER,TIER[,...] (cheapest first), separated by ';'; a request naming "
    "one runs its first tier and escalates on low confidence. Example: 'auto=cheap,strong'. "
    "Empty = no cascades.")


@dataclass(frozen=True)
class Replica:
    """One place a tier's requests can run: a kvmesh engine or an OpenAI-compatible endpoint."""

    address: str                      # "host:port" (engine) or the base URL (".../v1")
    kind: Literal["engine", "openai"]
    model: str = ""                   # openai only: the model name its requests carry
    role: Literal["both", "prefill", "decode"] = "both"  # engines only: P/D disaggregation

    @property
    def label(self) -> str:
        """How the replica is named in metrics, logs and RouteInfo."""
        return self.address if self.kind == "engine" else f"{self.address}#{self.model}"


@dataclass(frozen=True)
class Tier:
    """A named pool of replicas serving one model, with its cost per generated token."""

    name: str
    replicas: tuple[Replica, ...]
    cost_per_token: float = 1.0


@dataclass(frozen=True)
class Cascade:
    """A named route that tries its tiers in order, cheapest first."""

    name: str
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    """Every tier and cascade, and the model a request naming none gets."""

    tiers: tuple[Tier, ...]
    cascades: tuple[Cascade, ...]
    default_model: str

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use: tiers first, then cascades."""
        return tuple(t.name for t in self.tiers) + tuple(c.name for c in self.cascades)


def _check_name(name: str, what: str, flag: str, example: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(f"{flag}: {what} name {name!r} must be letters, digits and ._:/- only, "
                          f"e.g. {example}")
    return name


def parse_replica(text: str, flag: str = "--tiers") -> Replica:
    """`host:port[/prefill|/decode]` → an engine replica; `http(s)://host:port/v1#MODEL` → an
    OpenAI one."""
    text = text.strip()
    if "://" in text:
        url, _, model = text.partition("#")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{flag}: replica {text!r} is not an http(s) URL; write "
                              "http://host:port/v1#MODEL")
        if not model:
            raise ConfigError(f"{flag}: OpenAI-compatible replica {text!r} needs its model name "
                              f"after '#', e.g. {url}#qwen2.5-0.5b-instruct")
        return Replica(url.rstrip("/"), "openai", model)
    text, slash, role = text.partition("/")
    if slash and role not in ("prefill", "decode"):
        raise ConfigError(f"{flag}: replica {text}/{role}: the role after '/' must be prefill or decode "
                          f"(P/D disaggregation), e.g. {text}/prefill")
    match = _HOST_PORT.match(text)
    if not match or not 0 < int(match.group(2)) <= 65535:
        raise ConfigError(f"{flag}: replica {text!r} is neither a kvmesh engine host:port "
                          "(e.g. 127.0.0.1:50061) nor an OpenAI-compatible URL "
                          "(e.g. http://127.0.0.1:8001/v1#MODEL)")
    return Replica(text, "engine", role=role or "both")


def parse_tiers(spec: str, flag: str = "--tiers") -> tuple[Tier, ...]:
    """Parse the --tiers spec (see the module docstring)."""
    tiers: list[Tier] = []
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue
        name, eq, rest = item.partition("=")
        if not eq or not rest.strip():
            raise ConfigError(f"{flag}: {item!r} is not NAME=REPLICA[,REPLICA...][@COST]; e.g. "
                              "strong=127.0.0.1:50061,127.0.0.1:50063@1.0")
        name = _check_name(name.strip(), "tier", flag, "strong")
        replicas_text, cost = rest, 1.0
        head, at, tail = rest.rpartition("@")
        if at and "/" not in tail and "#" not in tail:
            replicas_text = head
            try:
                cost = float(tail)
            except ValueError:
                raise ConfigError(f"{flag}: tier {name}: cost {tail!r} is not a number; write "
                                  f"{name}={head}@0.5") from None
            if not cost >= 0:
                raise ConfigError(f"{flag}: tier {name}: cost {tail} must be >= 0")
        replicas = tuple(parse_replica(r, flag) for r in replicas_text.split(",") if r.strip())
        if not replicas:
            raise ConfigError(f"{flag}: tier {name} has no replicas; list one or more host:port")
        labels = [r.label for r in replicas]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"{flag}: tier {name} lists a replica twice ({', '.join(labels)}); "
                              "list each once")
        if name in (t.name for t in tiers):
            raise ConfigError(f"{flag}: tier {name} is defined twice; merge its replicas into one "
                              "entry")
        tiers.append(Tier(name, replicas, cost))
    if not tiers:
        raise ConfigError(f"{flag} is empty; give at least one tier, e.g. "
                          "default=127.0.0.1:50061")
    return tuple(tiers)


def parse_cascades(spec: str, tiers: tuple[Tier, ...],
                   flag: str = "--cascades") -> tuple[Cascade, ...]:
    """Parse the --cascades spec against the known tiers (see the module docstring)."""
    costs = {t.name: t.cost_per_token for t in tiers}
    cascades: list[Cascade] = []
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue
        name, eq, rest = item.partition("=")
        name = _check_name(name.strip(), "cascade", flag, "auto")
        names = tuple(t.strip() for t in rest.split(",") if t.strip())
        if not eq or len(names) < 2:
            raise ConfigError(f"{flag}: {item!r} needs two or more tiers, cheapest first: "
                              f"{name}=cheap,strong")
        for tier in names:
            if tier not in costs:
                raise ConfigError(f"{flag}: cascade {name} names unknown tier {tier!r}; known "
                                  f"tiers: {', '.join(costs)} (defined by --tiers)")
        if len(set(names)) != len(names):
            raise ConfigError(f"{flag}: cascade {name} lists a tier twice; list each once")
        for cheap, dear in zip(names, names[1:]):
            if costs[dear] < costs[cheap]:
                raise ConfigError(
                    f"{flag}: cascade {name} escalates from {cheap} (@{costs[cheap]}) to the "
                    f"cheaper {dear} (@{costs[dear]}); order its tiers cheapest first or fix "
                    "the @COST in --tiers")
        if name in costs or name in (c.name for c in cascades):
            raise ConfigError(f"{flag}: cascade name {name} is already a tier or cascade name; "
                              "pick another")
        cascades.append(Cascade(name, names))
    return tuple(cascades)


def parse_topology(tiers: str, cascades: str, default_model: str) -> Topology:
    """Both specs plus the default model (empty = the first cascade, else the first tier)."""
    parsed_tiers = parse_tiers(tiers)
    parsed_cascades = parse_cascades(cascades, parsed_tiers)
    names = tuple(t.name for t in parsed_tiers) + tuple(c.name for c in parsed_cascades)
    default = default_model or (parsed_cascades[0].name if parsed_cascades
                                else parsed_tiers[0].name)
    if default not in names:
        raise ConfigError(f"--default-model {default!r} is neither a tier nor a cascade; use one "
                          f"of {', '.join(names)}")
    return Topology(parsed_tiers, parsed_cascades, default)
