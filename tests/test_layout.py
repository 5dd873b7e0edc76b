"""The package's layout: imports point one way (entrypoints -> engine -> worker -> model ->
kernels; tokenization, config and the root utilities below all), every package says in
its docstring what it owns and may import, and the installed command's entry point exists.
A module may import its own package and any package of a lower layer, never a higher one
or a sibling of its own layer. Checked on the source (ast), so nothing is imported here."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxserve"

# Layers, lowest first. A module in layer i may import jaxserve modules of its own unit
# (the same package) and of layers < i. Units of one layer do not import each other.
LAYERS = [
    ["jaxserve.pytree", "jaxserve.sampling_params", "jaxserve.tokenization"],
    ["jaxserve.config"],
    ["jaxserve.configs", "jaxserve.kernels", "jaxserve.distributed", "jaxserve.lora"],
    ["jaxserve.model", "jaxserve.sample"],
    ["jaxserve.checkpoint", "jaxserve.spec_decode"],
    ["jaxserve.worker", "jaxserve.functional"],
    ["jaxserve.engine", "jaxserve.train"],
    ["jaxserve.api"],
    ["jaxserve.entrypoints"],
    ["jaxserve.bench"],
    ["jaxserve.cli"],
    ["jaxserve.__main__"],
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str:
    """The layer unit a dotted jaxserve module belongs to (its longest listed prefix)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    raise KeyError(module)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(path: Path):
    """(line, dotted module) of every jaxserve import in the file, lazy ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxserve."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jaxserve":
                for alias in node.names:
                    yield node.lineno, f"jaxserve.{alias.name}"
            elif node.module.startswith("jaxserve."):
                yield node.lineno, node.module


def test_every_module_is_in_a_layer():
    unplaced = []
    for module, _ in _modules():
        if module == "jaxserve":
            continue
        try:
            _unit(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_imports_point_down():
    wrong = []
    for module, path in _modules():
        if module == "jaxserve":
            continue  # the lazy public API re-exports from every layer
        unit = _unit(module)
        for line, target in _imports(path):
            other = _unit(target)
            if other != unit and RANK[other] >= RANK[unit]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {unit} "
                             f"(layer {RANK[unit]}) imports {target} (layer {RANK[other]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a model module importing the engine is reported."""
    pkg = tmp_path / "jaxserve"
    (pkg / "model").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "model" / "bad.py").write_text("from jaxserve.engine.engine import Engine\n")
    (pkg / "engine" / "engine.py").write_text("class Engine: ...\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    with pytest.raises(AssertionError, match=r"model/bad.py:1: jaxserve.model"):
        test_imports_point_down()


@pytest.mark.parametrize("package", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_each_package_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"jaxserve/{package}/__init__.py needs a docstring"
