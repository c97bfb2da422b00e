"""The code keeps the shape it promises: no function body over 80 lines,
no file over 350, and no import cycle among minigrpo/ and rewards/, lazy imports inside functions included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION, MAX_FILE = 80, 350


def modules() -> dict[str, Path]:
    found = {}
    for package in ("minigrpo", "rewards"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports_of(tree: ast.AST, known: dict) -> set[str]:
    """The project modules a module imports anywhere in it (a package's own names count as the package)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out |= {sub} if sub in known else {node.module} if node.module in known else set()
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that reach each other (strongly connected, more than one)."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo += graph[m]
    groups = {frozenset([m] + [o for o in reach[m] if m in reach[o]]) for m in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def test_functions_and_files_stay_small():
    too_long = []
    for name, path in modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE:
            too_long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.end_lineno - node.body[0].lineno + 1  # a long signature of flags is not logic
                if body > MAX_FUNCTION:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name}: {body} lines")
    assert not too_long, too_long


def test_no_import_cycles():
    known = modules()
    graph = {name: imports_of(ast.parse(path.read_text()), known) - {name} for name, path in known.items()}
    assert not cycles(graph), cycles(graph)


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
