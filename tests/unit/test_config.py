"""kvmesh.config: flags > env > defaults, conversion, validation and fix-it messages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import pytest

from kvmesh.config import ConfigError, describe, load_config, setting


@dataclass(frozen=True)
class DemoConfig:
    """A demo service."""

    port: int = setting(50051, "gRPC port; 0 picks a free one.", min=0, max=65535)
    ratio: float = setting(0.5, "Recompute ratio.", min=0.0, max=1.0)
    name: str = setting("demo", "Served name.")
    verbose: bool = setting(False, "Log every call.")
    data_dir: Path = setting(Path("/tmp/kv"), "Where chunks live.")
    tiers: tuple[str, ...] = setting(("memory", "disk"), "Tiers, fastest first.",
                                     choices=("memory", "disk", "redis"))
    codec: Literal["raw", "int8", "kivi2"] = setting("raw", "Chunk codec.")
    mode: str = setting("fast", "Mode.", choices=("fast", "exact"))
    otlp_endpoint: Optional[str] = setting(None, "OTLP endpoint; unset disables tracing.")
    max_chunks: int | None = setting(None, "Chunk cap; unset = no cap.", min=1)
    api_key: str = setting("", "API key.", secret=True)

    def validate(self) -> None:
        if self.mode == "exact" and self.codec != "raw":
            raise ValueError("--mode exact needs --codec raw")


def load(argv: list[str] | None = None, env: dict[str, str] | None = None) -> DemoConfig:
    return load_config(DemoConfig, "demo", argv or [], env or {})


def test_defaults() -> None:
    cfg = load()
    assert cfg == DemoConfig()
    assert (cfg.port, cfg.tiers, cfg.otlp_endpoint) == (50051, ("memory", "disk"), None)


def test_precedence_flag_over_env_over_default() -> None:
    assert load(env={"KVMESH_DEMO_PORT": "7"}).port == 7
    assert load(["--port", "9"], {"KVMESH_DEMO_PORT": "7"}).port == 9
    assert load(["--port=9"]).port == 9
    assert load(env={"KVMESH_DEMO_NAME": "x"}).port == 50051


def test_type_conversion() -> None:
    cfg = load(["--ratio", "0.25", "--data-dir", "~/kv", "--codec", "int8",
                "--otlp-endpoint", "http://127.0.0.1:4317", "--max-chunks", "3"])
    assert cfg.ratio == 0.25
    assert cfg.data_dir == Path("~/kv").expanduser()
    assert cfg.codec == "int8"
    assert cfg.otlp_endpoint == "http://127.0.0.1:4317"
    assert cfg.max_chunks == 3
    assert load(env={"KVMESH_DEMO_MAX_CHUNKS": ""}).max_chunks is None
    assert load(["--max-chunks", "none"]).max_chunks is None


@pytest.mark.parametrize("raw,expected", [
    ("1", True), ("true", True), ("YES", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_bool_parsing(raw: str, expected: bool) -> None:
    assert load(env={"KVMESH_DEMO_VERBOSE": raw}).verbose is expected
    assert load([f"--verbose={raw}"]).verbose is expected


def test_bare_bool_flag_means_true() -> None:
    assert load(["--verbose"]).verbose is True


def test_bad_bool_names_the_accepted_words() -> None:
    with pytest.raises(ConfigError, match=r"KVMESH_DEMO_VERBOSE='maybe' is not a boolean: "
                                          r"true/false, 1/0, yes/no or on/off"):
        load(env={"KVMESH_DEMO_VERBOSE": "maybe"})


def test_tuple_parsing() -> None:
    assert load(["--tiers", "memory, redis,"]).tiers == ("memory", "redis")
    assert load(env={"KVMESH_DEMO_TIERS": "disk"}).tiers == ("disk",)
    assert load(["--tiers", ""]).tiers == ()


def test_bad_type_says_what_was_expected_and_shows_an_example() -> None:
    with pytest.raises(ConfigError) as err:
        load(["--port", "abc"])
    assert str(err.value) == "--port 'abc' is not a whole number; for example pass --port 50051"


def test_choices_error_lists_them() -> None:
    with pytest.raises(ConfigError) as err:
        load(env={"KVMESH_DEMO_MODE": "slow"})
    assert str(err.value) == ("KVMESH_DEMO_MODE='slow' is not one of fast, exact; use one of "
                              "fast, exact, for example set KVMESH_DEMO_MODE=fast")
    with pytest.raises(ConfigError,
                       match="--tiers 'memory,tape' is not one of memory, disk, redis"):
        load(["--tiers", "memory,tape"])
    with pytest.raises(ConfigError, match="--codec 'int4' is not one of raw, int8, kivi2"):
        load(["--codec", "int4"])


def test_min_max_errors_give_the_range() -> None:
    with pytest.raises(ConfigError) as err:
        load(["--port", "70000"])
    assert str(err.value) == ("--port '70000' is above the maximum 65535; use >= 0 and <= 65535, "
                              "for example pass --port 50051")
    with pytest.raises(ConfigError, match=r"KVMESH_DEMO_RATIO='-0.1' is below the minimum 0.0"):
        load(env={"KVMESH_DEMO_RATIO": "-0.1"})


def test_unknown_env_var_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        load(env={"KVMESH_DEMO_PROT": "1"})
    assert "unknown environment variable KVMESH_DEMO_PROT" in str(err.value)
    assert "did you mean KVMESH_DEMO_PORT?" in str(err.value)
    # Other services' variables are not ours to judge.
    assert load(env={"KVMESH_ROUTER_PROT": "1"}).port == 50051


def test_unknown_flag_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown flag --prot; did you mean --port\?"):
        load(["--prot", "1"])
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        load(["stray"])


def test_validate_hook_runs_after_conversion() -> None:
    assert load(["--mode", "exact"]).mode == "exact"
    with pytest.raises(ConfigError, match="demo config: --mode exact needs --codec raw"):
        load(["--mode", "exact", "--codec", "int8"])


def test_config_is_frozen() -> None:
    cfg = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_non_frozen_or_undocumented_classes_are_refused() -> None:
    @dataclass
    class Mutable:
        port: int = setting(1, "Port.")

    @dataclass(frozen=True)
    class Undocumented:
        port: int = 1

    with pytest.raises(TypeError, match="frozen"):
        load_config(Mutable, "demo", [], {})
    with pytest.raises(TypeError, match="needs a help text"):
        load_config(Undocumented, "demo", [], {})


def test_describe_is_one_line_and_masks_secrets() -> None:
    line = describe(load(env={"KVMESH_DEMO_API_KEY": "sk-secret"}))
    assert "\n" not in line
    assert line.startswith("DemoConfig(port=50051, ratio=0.5, name='demo'")
    assert "tiers=memory,disk" in line and "api_key=***" in line
    assert "sk-secret" not in line


def test_help_lists_every_field_with_its_env_var(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        load(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(DemoConfig):
        assert f"--{field.name.replace('_', '-')}" in text
        assert f"KVMESH_DEMO_{field.name.upper()}" in text
    assert "gRPC port; 0 picks a free one." in text
    assert "A demo service." in text


@dataclass(frozen=True)
class Listen:
    """Where a demo server listens."""

    host: str = setting("127.0.0.1", "Address the server binds.")
    port: int = setting(0, "Port; 0 picks a free one.", min=0, max=65535)


@dataclass(frozen=True)
class GroupedConfig:
    """A demo service whose server settings are a group."""

    listen: Listen = Listen(port=50071)
    name: str = setting("demo", "Served name.")


def load_grouped(argv: list[str] | None = None, env: dict[str, str] | None = None) -> GroupedConfig:
    return load_config(GroupedConfig, "demo", argv or [], env or {})


def test_a_groups_fields_are_flags_named_as_if_declared_at_the_top() -> None:
    assert load_grouped().listen == Listen(port=50071)  # the group's default instance
    cfg = load_grouped(["--port", "9"], {"KVMESH_DEMO_HOST": "0.0.0.0", "KVMESH_DEMO_PORT": "7"})
    assert cfg == GroupedConfig(Listen("0.0.0.0", 9), "demo")
    with pytest.raises(ConfigError) as err:
        load_grouped(["--port", "70000"])
    assert str(err.value) == ("--port '70000' is above the maximum 65535; use >= 0 and <= 65535, "
                              "for example pass --port 50071")


def test_a_groups_fields_get_typo_protection_and_describe_and_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="did you mean KVMESH_DEMO_PORT?"):
        load_grouped(env={"KVMESH_DEMO_PROT": "1"})
    with pytest.raises(ConfigError, match=r"unknown flag --prot; did you mean --port\?"):
        load_grouped(["--prot", "1"])
    assert describe(load_grouped()) == "GroupedConfig(host='127.0.0.1', port=50071, name='demo')"
    with pytest.raises(SystemExit):
        load_grouped(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--port PORT Port; 0 picks a free one. [env KVMESH_DEMO_PORT; default: 50071]" in text


def test_a_group_field_clashing_with_another_field_is_refused() -> None:
    @dataclass(frozen=True)
    class Clash:
        listen: Listen = Listen()
        port: int = setting(1, "Port.")

    with pytest.raises(TypeError, match="--port is declared twice"):
        load_config(Clash, "demo", [], {})
