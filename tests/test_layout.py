"""The package's layers, read from every module's import statements (inside functions too): a
module's layer is its folder, ranked in LAYERS; a module imports only from its own folder or a
lower one, and no import cycle anywhere. The stage and engine tables reach the stages by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tvmbert
from tvmbert.core import registry
from tvmbert.kernels import KERNELS
from tvmbert.passes.pipeline import PASS_NAMES

PACKAGE = Path(tvmbert.__file__).parent
# Lowest first; each folder's __init__ says what it holds and what it may import. The package's
# own __init__ and __main__ are the top (the public API and `python -m tvmbert`).
LAYERS = ("core", "deploy", "serve", "embed", "frontend", "ir", "kernels", "passes", "tuning", "training", "stages", "cli")
TOP = {"__init__", "__main__"}


def _modules() -> dict[str, Path]:
    """Dotted names under tvmbert ("stages.bench.engines"; a package's __init__ is the package's name, tvmbert's is "__init__")."""
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


def _rank(name: str) -> int:
    folder = name.split(".")[0]
    return len(LAYERS) if folder in TOP else LAYERS.index(folder) if folder in LAYERS else -1


def test_every_module_is_in_a_layer_folder():
    assert sorted(name for name in MODULES if _rank(name) < 0) == []
    assert sorted(path.name for path in PACKAGE.iterdir() if path.suffix == ".py") == ["__init__.py", "__main__.py"]


@pytest.mark.parametrize("folder", LAYERS)
def test_every_layer_says_what_it_holds_and_may_import(folder):
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    assert "import" in doc, f"tvmbert/{folder}/__init__.py has no docstring saying what it may import"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] in LAYERS))
def test_a_module_imports_only_its_own_layer_or_lower(name):
    assert sorted(m for m in IMPORTS[name] if _rank(m) > _rank(name)) == []


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


def test_the_tables_name_code_that_exists():
    for stage in registry.STAGES.values():
        function = registry.resolve(stage.function)
        assert function.__module__.startswith("tvmbert.stages.") and callable(function)
        assert ("force" in inspect.signature(function).parameters) == stage.cached
    for engine in registry.ENGINES.values():
        assert callable(registry.resolve(engine.factory))
    for kernel in KERNELS:
        assert kernel.graph_pass in PASS_NAMES
