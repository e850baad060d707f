"""No module of the package over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES: a file or a
function that grows past them is split along what it does, so that a newcomer finds one thing in each."""

import ast

import pytest
from paths import REPOSITORY

PACKAGE = REPOSITORY / "fl_lightning"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function or method in `source` longer than `limit` lines, its
    decorators and docstring included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(decorator.lineno for decorator in child.decorator_list)])
                if child.end_lineno - first + 1 > limit:
                    found.append((name, child.end_lineno - first + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{name}.")

    visit(ast.parse(source), "")
    return found


def test_long_functions_are_found_with_their_decorators_and_inside_classes():
    body = "\n".join(f"    x = {i}" for i in range(3))
    source = f"@decorate\ndef f():\n{body}\n\nclass C:\n    def g(self):\n        return 1\n"
    assert long_functions(source, limit=4) == [("f", 5)]
    assert long_functions(source, limit=1) == [("f", 5), ("C.g", 2)]


@pytest.mark.parametrize("limit_name", ["modules", "functions"])
def test_no_module_or_function_of_the_package_is_over_its_limit(limit_name):
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source, where = path.read_text(), path.relative_to(REPOSITORY)
        if limit_name == "modules" and len(source.splitlines()) > MAX_MODULE_LINES:
            over.append(f"{where}: {len(source.splitlines())} lines")
        if limit_name == "functions":
            over += [f"{where}: {name}, {lines} lines" for name, lines in long_functions(source, MAX_FUNCTION_LINES)]
    limit = MAX_MODULE_LINES if limit_name == "modules" else MAX_FUNCTION_LINES
    assert not over, f"over {limit} lines: " + "; ".join(over)
