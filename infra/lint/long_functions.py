"""Fails when a function outside the tests is longer than the project's limit (80 lines).

A function's length is counted from its `def` line to its last line, decorators left out,
so a docstring counts: the rule is about what a reader must hold at once.
"""

import ast
import sys
from pathlib import Path

LIMIT = 80
ROOTS = ("tasks", "flows", "infra", "ckptops_records.py")


def long_functions(root: Path, limit: int = LIMIT) -> list[tuple[str, int, str, int]]:
    found = []
    for top in ROOTS:
        base = root / top
        files = [base] if base.is_file() else sorted(base.rglob("*.py")) if base.is_dir() else []
        for path in files:
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        found.append((str(path.relative_to(root)), node.lineno, node.name, length))
    return found


def main() -> int:
    found = long_functions(Path(__file__).resolve().parents[2])
    for path, line, name, length in found:
        print(f"{path}:{line}: {name} is {length} lines (the limit is {LIMIT})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
