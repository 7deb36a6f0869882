"""Fails when the packages of `tasks/` import each other in a circle.

Each folder of `tasks/` and each top-level module is one node; an edge runs from the node a
module belongs to to the node of each `tasks.` module it imports (at the top or inside a
function alike: a late import still ties the two). Prints every cycle's nodes.
"""

import ast
import sys
from pathlib import Path


def node_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tasks" or len(parts) < 2:
        return None
    return parts[1]


def graph(root: Path) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    nodes = {path.stem for path in (root / "tasks").iterdir() if path.suffix == ".py" or path.is_dir()}
    for path in sorted((root / "tasks").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__" and len(rel) == 2:
            continue
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        source = node_of(module)
        package = module.split(".") if rel[-1] == "__init__" else module.split(".")[:-1]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
            for target in targets:
                other = node_of(target)
                if other and other != source and other in nodes:
                    edges.setdefault(source, set()).add(other)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    edges = graph(root)
    found = cycles(edges)
    for component in found:
        links = [f"{a} -> {b}" for a in component for b in sorted(edges.get(a, ())) if b in component]
        print(f"tasks/: import cycle between {', '.join(component)} ({'; '.join(links)})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
