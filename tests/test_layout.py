"""The package reads top-down as the pipeline: no unit imports a unit below it, none imports the CLI.

Every import in unlimisum/ is read from the source (those inside functions too), reduced to the
top-level units it connects (``unlimisum.search.kernels`` -> ``unlimiformer``), and checked
against ``ORDER``: a unit may import only units before it. The package root (the public API, which
loads its names lazily) and ``__main__`` are the top and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "unlimisum"

# Top-down: each unit may import only those before it (docs/development.md, the layout).
ORDER = [
    "version", "errors", "config", "files", "visible", "measurements", "document", "events", "coverage", "evidence",
    "results",
    "ingest", "models", "tensor_cache", "search", "unlimiformer", "decoder_only", "summarizer", "training", "evaluation",
    "diagnostics", "runs", "cli",
]
TOP = {"__init__", "__main__"}  # the public API and `python -m unlimisum`
METHODS = ("unlimiformer", "decoder_only")  # side by side above the search: neither imports the other
MAX_MODULE_LINES = 800


def unit_of(module: str) -> str:
    """``unlimisum.runs.ray`` -> ``runs``; ``unlimisum`` and the names it defines (``unlimisum.summarize``) ->
    ``__init__``."""
    parts = module.split(".")
    if len(parts) == 1 or not (PACKAGE / parts[1]).is_dir() and not (PACKAGE / f"{parts[1]}.py").is_file():
        return "__init__"
    return parts[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported unlimisum module, line) for every import statement in ``path``, the source of ``module``,
    those inside functions too, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "unlimisum" or node.module is None:  # `from unlimisum import x`, `from . import x`
                found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((target, node.lineno))
    return [(name, line) for name, line in found if name == "unlimisum" or name.startswith("unlimisum.")]


def edges() -> list[tuple[str, str, str]]:
    """(from unit, to unit, "file:line") for every import between two different units."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(module_name(path)) if path.parent != PACKAGE or path.stem == "__init__" else path.stem
        for target, line in imports(path, module_name(path)):
            to = unit_of(target)
            if to != source:
                found.append((source, to, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return found


def test_every_unit_is_in_the_order():
    units = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").exists()) and path.name != "__pycache__"}
    assert units - TOP == set(ORDER), "add a new unit to ORDER where it belongs (and to the layout in docs/development.md)"


def test_no_unit_imports_a_unit_below_it():
    upward = [f"{where}: {source} imports {to}" for source, to, where in edges()
              if source not in TOP and (to in TOP or ORDER.index(to) > ORDER.index(source))]
    assert not upward, "imports against the layout:\n" + "\n".join(upward)


def test_the_two_methods_import_neither_each_other():
    between = [f"{where}: {source} imports {to}" for source, to, where in edges() if {source, to} == set(METHODS)]
    assert not between, between


def module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the modules of the package it imports (``from a.b import c`` where c is a
    module: a.b.c, not the package a.b)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
                targets |= submodules if len(submodules) == len(node.names) else submodules | {base}
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def test_no_import_circle_file_by_file():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds one
    assert not circles(module_graph()), circles(module_graph())


def test_no_module_is_over_the_size_a_reader_keeps_in_mind():
    long = {str(path.relative_to(PACKAGE.parent)): lines for path in PACKAGE.rglob("*.py")
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_outside_the_search_only_its_public_names_are_used():
    """The search (stores, kernels, their measurement) is one unit; the rest of the package uses the names its
    modules make public, never one with a leading underscore."""
    private = []
    for path in PACKAGE.rglob("*.py"):
        if "search" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound = set()  # local names of search modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("unlimisum.search"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        private.append(f"{path.name}:{node.lineno} imports {alias.name}")
                    elif node.module == "unlimisum.search":
                        bound.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_")):
                private.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not private, private


def test_nothing_below_the_cli_imports_it():
    into_cli = [where for source, to, where in edges() if to == "cli" and source not in ("cli", "__main__")]
    assert not into_cli, into_cli


def test_the_checker_sees_every_kind_of_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom unlimisum import coverage\nfrom . import output\n\n"
                      "def f():\n    from unlimisum.cli import app\n    import unlimisum.runs.runner\n")
    found = [name for name, _ in imports(sample, "unlimisum.runs.sample")]
    assert found == ["unlimisum.coverage", "unlimisum.runs.output", "unlimisum.cli", "unlimisum.runs.runner"]


def test_no_merge_conflict_markers_are_left_in_the_sources_or_docs():
    """A merge once left its ``<<<<<<<``/``>>>>>>>`` lines in BENCHMARKS.md; none may land again."""
    root = PACKAGE.parent
    files = [root / name for name in ("README.md", "BENCHMARKS.md", "pyproject.toml")]
    for folder in ("unlimisum", "tests", "bench", "docs", ".ci"):
        files += [path for path in (root / folder).rglob("*") if path.is_file() and path.suffix in
                  {".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml", ""} and "fixtures" not in path.parts]
    markers = ("<<<<<<< ", ">>>>>>> ")
    found = [f"{path.relative_to(root)}:{number}" for path in files
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if line.startswith(markers)]
    assert not found, "merge conflict markers: " + ", ".join(found)
