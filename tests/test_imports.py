"""The package's floor plan: imports point down the layers, and no module imports itself back.

The graph is read from the code (every import at any depth, function-level ones included;
`if TYPE_CHECKING:` blocks excluded), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import batchlab

SRC = Path(batchlab.__file__).resolve().parent

# bottom first: a module imports modules of its own unit (top-level module or folder) or of a
# lower layer, never of its own layer's other units or of a higher one
LAYERS: list[set[str]] = [
    {"atomic", "collector", "config", "kept", "paths"},
    {"data"},
    {"validate", "model"},
    {"evaluate", "inference"},  # ONNX and onnxruntime: no torch training, no tracking
    {"tracking"},  # the only mlflow imports
    {"training"},  # the loop: nothing of the seeds, the sweep or the study
    {"seeds", "study"},  # the study analyses rows: it trains nothing and knows no sweep
    {"stages", "audit"},
    {"orchestration"},
    {"sweep"},  # only the commands (and flows/) above it
    {"commands"},  # each command's function, imported when it runs
    {"cli"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    found = {}
    for file in SRC.rglob("*.py"):
        parts = ("batchlab", *file.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = file
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(file: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of `file`, at any depth, but those under `if TYPE_CHECKING:`."""

    def visit(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    return visit(ast.parse(file.read_text()))


def _imports(name: str, file: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports (a `from pkg import sub` imports the submodule)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(file):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        subs = {f"{base}.{alias.name}" for alias in node.names} & modules
        found.update(subs)
        if len(subs) < len(node.names) and base in modules:
            found.add(base)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, set(modules)) for name, file in modules.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_a_cycle_is_found_where_there_is_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in _graph()} - {"__init__"}
    assert units == set(RANK), f"give these a layer in LAYERS, or drop them from it: {units ^ set(RANK)}"


def test_imports_point_down_the_layers() -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        # batchlab/__init__.py holds the version and imports nothing: below everything
        if "__init__" not in (_unit(module), _unit(target))
        and _unit(target) != _unit(module)
        and RANK[_unit(target)] >= RANK[_unit(module)]
    )
    assert not _graph()["batchlab"]
    assert upward == [], "imports that point up or sideways (see LAYERS): " + ", ".join(upward)


def test_the_sweep_reaches_training_through_the_training_package_never_through_the_stages() -> None:
    """stages.py holds the four stage entry points; the tracked training that the sweep reuses is
    training/tracked.py, and the paths are paths.py."""
    reaching = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets
                      if _unit(m) == "sweep" and _unit(t) == "stages")  # fmt: skip
    assert reaching == []


def test_at_most_twelve_modules_at_the_top_of_the_package() -> None:
    top = sorted(p.stem for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top


def test_the_architecture_page_names_every_module() -> None:
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    words = set(re.findall(r"[a-z_]+", page))
    unnamed = sorted(m for m in _graph() if m != "batchlab" and m.rpartition(".")[2] not in words)
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"


def test_no_module_over_300_lines_and_no_function_over_70() -> None:
    long_modules = {
        str(f.relative_to(SRC)): n for f in _modules().values() if (n := len(f.read_text().splitlines())) > 300
    }
    long_functions = {
        f"{file.relative_to(SRC)}:{node.name}": node.end_lineno - node.lineno + 1
        for file in _modules().values()
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 70
    }
    assert long_modules == {} and long_functions == {}, (long_modules, long_functions)


def _third_party_imports(file: Path) -> set[str]:
    """The top-level names of what `file` imports from outside (absolute imports), at any depth."""
    found: set[str] = set()
    for node in _import_nodes(file):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_sweep_plans_and_stores_and_imports_no_torch() -> None:
    """sweep/ decides what to measure, keys it, runs it through an executor and stores the answer;
    whatever needs torch (training, branching, the exact noise scale, the clock's threads) is a
    function of training/ or seeds/."""
    sweep = {name: file for name, file in _modules().items() if _unit(name) == "sweep"}
    torch_users = sorted(name for name, file in sweep.items() if "torch" in _third_party_imports(file))
    assert torch_users == [], f"sweep/ modules that import torch: {torch_users}"
    assert "torch" in _third_party_imports(SRC / "training" / "train.py")  # the check sees an import that is there
