"""The package's imports point down the layers (README.md, "Layers"; pure: reads the source with `ast`).

| layer (bottom to top) | modules                                          |
|-----------------------|--------------------------------------------------|
| layout                | dtensor_mimo/layout/                             |
| data                  | dtensor_mimo/data/                               |
| models                | dtensor_mimo/models/ (models/hf too)             |
| parallelize           | dtensor_mimo/parallelize/                        |
| bridge                | dtensor_mimo/bridge/                             |
| assemble              | dtensor_mimo/assemble.py                         |
| sequence              | dtensor_mimo/sequence/ (the token loss too)      |
| schedule              | dtensor_mimo/schedule/                           |
| mimo                  | dtensor_mimo/mimo.py                             |
| optim                 | dtensor_mimo/optim/ (optimizer, training step)   |
| plan                  | dtensor_mimo/plan/ (the layout planner)          |
| train                 | dtensor_mimo/train/                              |
| (package facade)      | dtensor_mimo/__init__.py: re-exports, any layer  |
| (entry points)        | any `__main__.py`: a command, any layer          |

A module may import its own layer and the layers below it, never one above: every import that
runs counts, at module level or inside a function. Imports under ``if TYPE_CHECKING:`` only
name types for annotations and never run, so they are not counted. `ALLOWED` lists the
exceptions, each with its reason; it is empty. A ``__main__.py`` is exempt like the facade: it is
the command ``python -m <package>`` runs and nothing imports it (none calls a higher layer today:
``python -m dtensor_mimo.plan`` starts ``python -m dtensor_mimo.train plan`` as a process).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "dtensor_mimo"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

LAYERS = ["layout", "data", "models", "parallelize", "bridge", "assemble", "sequence", "schedule", "mimo", "optim", "plan",
          "train"]

ALLOWED: dict[tuple[str, str], str] = {
    # (file relative to the repository, imported module): why this upward import is acceptable
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str | None:
    """The layer of `module` (a dotted name inside the package); None for the package facade."""
    parts = module.split(".")
    if parts == [PACKAGE]:
        return None
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module}: no layer for {parts[1]!r}; add it to LAYERS in {__file__} "
                             "(and to README.md's layers table)")
    return parts[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, imported package module, the statement) for every import of the package that runs."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the `else:` branch does run
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, ast.unparse(node)) for a in node.names
                         if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            if target.split(".")[0] == PACKAGE:
                if target == PACKAGE:  # `from dtensor_mimo import data`: each name is the import
                    found.extend((node.lineno, f"{PACKAGE}.{a.name}" if a.name.split(".")[0] in LAYERS
                                  else PACKAGE, ast.unparse(node)) for a in node.names)
                else:
                    found.append((node.lineno, target, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _violations() -> tuple[list[str], set[tuple[str, str]]]:
    problems, used = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        layer = _layer(module)
        if layer is None or path.name == "__main__.py":
            continue  # the facade re-exports from every layer; an entry point is imported by nobody
        rel = str(path.relative_to(ROOT.parent))
        for line, target, statement in _runtime_imports(ast.parse(path.read_text()), module,
                                                        path.name == "__init__.py"):
            other = _layer(target)
            if other is not None and LAYERS.index(other) <= LAYERS.index(layer):
                continue
            if (rel, target) in ALLOWED:
                used.add((rel, target))
                continue
            above = "the package facade" if other is None else f"layer {other!r}"
            problems.append(f"{rel}:{line} (layer {layer!r}) imports {above}: {statement}")
    return problems, used


def test_imports_point_down_the_layers() -> None:
    problems, _ = _violations()
    assert not problems, "imports of a higher layer (move the code down, or import under TYPE_CHECKING " \
                         "for annotations only):\n" + "\n".join(problems)


def test_allow_list_has_no_stale_entries() -> None:
    _, used = _violations()
    assert set(ALLOWED) == used, f"ALLOWED entries no longer needed: {sorted(set(ALLOWED) - used)}"


def test_every_module_has_a_layer() -> None:
    for path in ROOT.rglob("*.py"):
        _layer(_module_name(path))  # raises naming the module


def test_the_check_sees_what_it_should() -> None:
    """The walker itself: function-level imports count; TYPE_CHECKING ones do not (but its else does)."""
    source = ("from typing import TYPE_CHECKING\n"
              "from dtensor_mimo.layout import MimoLayout\n"
              "if TYPE_CHECKING:\n    from dtensor_mimo.train import loss\nelse:\n    import dtensor_mimo.mimo\n"
              "def f():\n    from dtensor_mimo.schedule import runtime\n"
              "from . import batch\n")
    found = [(line, target) for line, target, _ in _runtime_imports(ast.parse(source), "dtensor_mimo.data.x", False)]
    assert found == [(2, "dtensor_mimo.layout"), (6, "dtensor_mimo.mimo"), (8, "dtensor_mimo.schedule"),
                     (9, "dtensor_mimo.data")]
