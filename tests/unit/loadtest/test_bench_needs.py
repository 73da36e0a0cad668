"""A benchmark whose optional packages are missing stops before it starts, naming what to install."""
from __future__ import annotations

import importlib
import importlib.util

import pytest

from kvmesh.loadtest import registry


def _hide(monkeypatch, *missing: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **kw: None if name.split(".")[0] in missing else real(name, *a, **kw))


@pytest.mark.parametrize("name", sorted(registry.NEEDS))
def test_a_missing_package_stops_the_bench_before_it_starts(name, monkeypatch):
    module, _ = registry.NEEDS[name][0]
    _hide(monkeypatch, module)
    imported = []
    monkeypatch.setattr(importlib, "import_module", lambda m, *a: imported.append(m))
    with pytest.raises(SystemExit) as e:
        registry.run_bench(name, quick=True)
    message = str(e.value)
    assert imported == []  # the benchmark's module was never loaded, so no work began
    assert "\n" not in message and repr(module) in message and f".[{registry.EXTRA}]" in message


def test_a_bench_with_its_packages_installed_passes_the_check(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **kw: object())  # all installed
    for name in registry.BENCHES:
        registry.check_needs(name)


def test_every_needed_package_is_in_the_extra_named():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    extra = " ".join(project["optional-dependencies"][registry.EXTRA]).lower()
    for needs in registry.NEEDS.values():
        for module, _ in needs:
            assert module in extra, f"{module} is not in the {registry.EXTRA!r} extra"
