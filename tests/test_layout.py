"""The package's layers, read from every module's import statements (inside functions too):
lower modules never import a stage, stages never import what sits on top of them, and no
import cycle anywhere. The stage and engine tables reach the stages by name instead."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tvmbert
from tvmbert.core import registry

PACKAGE = Path(tvmbert.__file__).parent
# Every module is in one layer; a new module must be put in one.
LOWER = {"errors", "artifacts", "config", "job", "models", "targets", "toolchain", "database", "catalog", "cpu_schedules",
         "measure", "passes", "runtime", "autodiff", "training", "viz", "registry", "compiler", "ir_io", "families", "package",
         "amx", "attention", "fma", "layer_norm", "kernel_calls", "packing", "scalar_math"}
STAGES = {"trace", "convert", "optimize", "tune", "build", "verify", "bench", "export"}
TOP = {"pipeline", "cli", "__init__", "__main__"}


def _modules() -> dict[str, Path]:
    """Dotted names under tvmbert ("bench.engines"; a package's __init__ is the package's name, tvmbert's is "__init__")."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The tvmbert modules ``name`` imports, wherever the import statement is."""
    package = ["tvmbert", *name.split(".")]
    if path.name != "__init__.py" or name == "__init__":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            # from PACKAGE import NAME: NAME is a module, or something the package defines.
            targets = [[*module, alias.name] if ".".join([*module[1:], alias.name]) in MODULES else module for alias in node.names]
        else:
            continue
        for target in targets:
            if target[0] == "tvmbert":
                found.add(".".join(target[1:]) or "__init__")
    found.discard(name)
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    top = name.split(".")[0]
    return "lower" if top in LOWER else "stage" if top in STAGES else "top" if top in TOP else "none"


def test_every_module_is_in_a_layer():
    assert {name: "none" for name in MODULES if _layer(name) == "none"} == {}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) == "lower"))
def test_a_lower_module_imports_no_stage(name):
    assert sorted(m for m in IMPORTS[name] if _layer(m) != "lower") == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) == "stage"))
def test_a_stage_imports_nothing_on_top_of_it(name):
    assert sorted(m for m in IMPORTS[name] if _layer(m) == "top") == []


def test_no_import_cycles():
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError(f"import cycle: {' -> '.join([*path[path.index(name):], name])}")
        if name not in done:
            path.append(name)
            for imported in sorted(IMPORTS[name]):
                visit(imported)
            path.pop()
            done.add(name)

    for name in sorted(MODULES):
        visit(name)


def test_the_tables_name_stage_code_that_exists():
    for stage in registry.STAGES.values():
        function = registry.resolve(stage.function)
        assert _layer(function.__module__.removeprefix("tvmbert.")) == "stage" and callable(function)
        assert ("force" in inspect.signature(function).parameters) == stage.cached
    for engine in registry.ENGINES.values():
        assert callable(registry.resolve(engine.factory))
