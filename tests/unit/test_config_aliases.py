"""A renamed setting keeps its former flag and variable for a release, with a warning naming the
new one; `--version` on every service; help and errors name the real command."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from kvmesh import __version__
from kvmesh.config import ConfigError, load_config, setting


@dataclass(frozen=True)
class Renamed:
    """A config whose field was renamed."""

    served_model_name: str = setting("", "The name clients use.", aliases=("served_name",))


def test_the_former_flag_and_variable_still_work_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        assert load_config(Renamed, "demo", ["--served-name", "a"], {}).served_model_name == "a"
        assert load_config(Renamed, "demo", ["--served-name=b"], {}).served_model_name == "b"
    assert caplog.text.count("--served-name is deprecated") == 2
    assert "pass --served-model-name instead" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        assert load_config(Renamed, "demo", [], {"KVMESH_DEMO_SERVED_NAME": "c"}).served_model_name == "c"
    assert "KVMESH_DEMO_SERVED_NAME is deprecated" in caplog.text and "KVMESH_DEMO_SERVED_MODEL_NAME" in caplog.text
    # the new names win, and warn of nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = load_config(Renamed, "demo", [], {"KVMESH_DEMO_SERVED_NAME": "old",
                                                "KVMESH_DEMO_SERVED_MODEL_NAME": "new"})
        assert cfg.served_model_name == "new"
        assert load_config(Renamed, "demo", ["--served-model-name", "x"], {}).served_model_name == "x"
    assert "deprecated" not in caplog.text


def test_help_names_the_real_command_and_the_former_flag(capsys):
    with pytest.raises(SystemExit) as done:
        load_config(Renamed, "engine", ["--help"], {})
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m kvmesh.services.engine")
    assert "--served-model-name SERVED_MODEL_NAME, --served-name SERVED_MODEL_NAME" in out
    assert "formerly --served-name" in out
    with pytest.raises(ConfigError, match=r"see python -m kvmesh.services.engine --help"):
        load_config(Renamed, "engine", ["--nope"], {})


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        load_config(Renamed, "engine", ["--version"], {})
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"kvmesh {__version__}"


def test_kvmesh_version(capsys):
    from kvmesh.cli import main

    for argv in (["--version"], ["up", "--version"], ["docs", "list", "--version"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0 and capsys.readouterr().out.strip() == f"kvmesh {__version__}", argv
