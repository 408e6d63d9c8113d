"""The package's import graph: no circles, and no arrows from the op layer back up into the orchestration.

Every ``import`` and ``from … import`` in fusion/ counts, inside functions too (lazy imports), and so does a
module named in an ``importlib.import_module("fusion…")`` call. Layers, bottom up:

- base: the shape proofs (fusion/shapes/), the op references (fusion/reference/), graph helpers (fusion/_graph.py);
- ops: the rules and the registry (fusion/rules/), the model-local functions (fusion/function/);
- orchestration: everything else (rewrite, optimize, report, verify, the command line, genai, Olive).

A module may import its own layer and the ones below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fusion"

BASE = ("fusion.shapes", "fusion.reference", "fusion._graph")
OPS = ("fusion.rules", "fusion.function")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Return the fusion modules ``name`` imports (a ``from package import submodule`` counts as the submodule)."""
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target.startswith("fusion") and target != name:
            found.add(target)

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    def within(prefixes: tuple[str, ...]) -> bool:
        return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)

    return 0 if within(BASE) else 1 if within(OPS) else 2


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_analysis_sees_every_kind_of_import() -> None:
    """The analysis itself: a lazy import, a relative one, a submodule through ``from``, and ``import_module``."""
    graph = _graph()
    assert "fusion.rules.registry" in graph["fusion.rewrite"]  # module level, from a submodule
    assert "fusion.rules.residual_norm" in graph["fusion.optimize"]  # inside a function
    assert "fusion.olive" in graph["fusion.olive_command"]  # importlib.import_module("fusion.olive")
    assert "fusion.rules.causal_conv1d_update" in graph["fusion.rules.registry"]  # from package import submodule
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("layer", [0, 1], ids=["base", "ops"])
def test_no_arrows_up(layer: int) -> None:
    arrows = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        if _layer(module) == layer
        for target in targets
        if _layer(target) > layer
    )
    assert arrows == []


def test_the_registry_is_what_the_orchestration_iterates() -> None:
    """No orchestration module names an op's rule module to fuse with it: they go through the registry (the
    helper passes of ``optimize`` — attention, residual norms, layout — are not ``ai.mambafuse`` ops)."""
    from fusion.rules.registry import FUSIONS

    op_rules = {f"fusion.rules.{fusion.name}" for fusion in FUSIONS}
    assert len(op_rules) == len(FUSIONS) >= 3
    graph = _graph()
    users = sorted(module for module, targets in graph.items() if _layer(module) == 2 and targets & op_rules)
    assert users == []


def test_the_package_imports_no_repository_tooling() -> None:
    """fusion/ is what the wheel installs with contrib_ops/: it never imports the repository's model building
    (models/), benchmarks or tests, which a user's own directory may shadow (an ML project's ``models/``)."""
    tooling = ("models", "benchmarks", "tests")
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in tooling]
    assert found == []
