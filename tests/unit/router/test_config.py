"""Router config: the tier/cascade specs, defaults and fix-it messages."""
from __future__ import annotations

import pytest

from kvmesh.config import ConfigError, load_config
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.topology import Cascade, Replica, Tier, parse_topology


def load(argv=(), env=None) -> RouterConfig:
    return load_config(RouterConfig, "router", list(argv), env or {})


def test_two_tiers_and_a_cascade_from_flags():
    cfg = load(["--tiers", "cheap=127.0.0.1:50062@0.6;strong=127.0.0.1:50061,127.0.0.1:50063@1.0",
                "--cascades", "auto=cheap,strong"])
    topo = cfg.topology
    assert topo.tiers == (
        Tier("cheap", (Replica("127.0.0.1:50062", "engine"),), 0.6),
        Tier("strong", (Replica("127.0.0.1:50061", "engine"),
                        Replica("127.0.0.1:50063", "engine")), 1.0))
    assert topo.cascades == (Cascade("auto", ("cheap", "strong")),)
    assert topo.default_model == "auto"  # the first cascade when none is named
    assert topo.model_names == ("cheap", "strong", "auto")
    assert (cfg.server.port, cfg.policy, cfg.probe_timeout_s) == (50081, "kv_aware", 0.2)


def test_env_and_openai_replicas():
    cfg = load(env={"KVMESH_ROUTER_TIERS": "big=https://api.example.com/v1/#gpt-x@2;local=[::1]:7",
                    "KVMESH_ROUTER_DEFAULT_MODEL": "local"})
    big, local = cfg.topology.tiers
    assert big == Tier("big", (Replica("https://api.example.com/v1", "openai", "gpt-x"),), 2.0)
    assert big.replicas[0].label == "https://api.example.com/v1#gpt-x"
    assert local.replicas == (Replica("[::1]:7", "engine"),)
    assert cfg.topology.default_model == "local"


def test_pd_roles_mark_engine_replicas():
    cfg = load(["--tiers", "m=127.0.0.1:1/prefill,127.0.0.1:2/decode,127.0.0.1:3@0.5", "--pd-min-prompt-tokens", "1024"])
    (tier,) = cfg.topology.tiers
    assert [(r.address, r.role) for r in tier.replicas] == [
        ("127.0.0.1:1", "prefill"), ("127.0.0.1:2", "decode"), ("127.0.0.1:3", "both")]
    assert tier.cost_per_token == 0.5 and tier.replicas[0].label == "127.0.0.1:1"
    assert cfg.pd_min_prompt_tokens == 1024


def test_default_model_without_cascades_is_the_first_tier():
    assert parse_topology("a=h:1;b=h:2", "", "").default_model == "a"


@pytest.mark.parametrize("tiers, cascades, fragment", [
    ("", "", "--tiers is empty"),
    ("cheap", "", "NAME=REPLICA"),
    ("cheap=localhost", "", "neither a kvmesh engine host:port"),
    ("cheap=h:1@x", "", "cost 'x' is not a number"),
    ("cheap=h:1@-1", "", "must be >= 0"),
    ("cheap=http://h:8000/v1", "", "needs its model name after '#'"),
    ("cheap=ftp://h/v1#m", "", "not an http(s) URL"),
    ("cheap=h:1,h:1", "", "lists a replica twice"),
    ("cheap=h:1/prefill,h:1/decode", "", "lists a replica twice"),
    ("cheap=h:1/prefil", "", "the role after '/' must be prefill or decode"),
    ("cheap=h:1;cheap=h:2", "", "defined twice"),
    ("bad name=h:1", "", "letters, digits"),
    ("cheap=h:1", "auto=cheap", "two or more tiers"),
    ("cheap=h:1", "auto=cheap,strong", "unknown tier 'strong'; known tiers: cheap"),
    ("cheap=h:1@2;strong=h:2@1", "auto=cheap,strong", "order its tiers cheapest first"),
    ("cheap=h:1;strong=h:2", "cheap=cheap,strong", "already a tier or cascade name"),
])
def test_bad_specs_say_how_to_fix_them(tiers, cascades, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        load(["--tiers", tiers, "--cascades", cascades])
    assert fragment in str(err.value)


def test_unknown_default_model_and_impossible_threshold():
    with pytest.raises(ConfigError, match="neither a tier nor a cascade; use one of a"):
        load(["--tiers", "a=h:1", "--default-model", "b"])
    with pytest.raises(ConfigError, match="can never be met"):
        load(["--cascade-threshold", "0.5"])
    with pytest.raises(ConfigError, match="one of kv_aware, round_robin, least_loaded"):
        load(["--policy", "random"])
