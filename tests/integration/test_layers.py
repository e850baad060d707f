"""The package's import graph, read from the source of every file of fl_lightning/ (imports at the
top of a file and inside functions alike): no cycle between files, and no file imports from a layer
above its own.

The layers, lowest first (LAYERS): the errors every layer may raise; helpers that import nothing of the
package but errors (dotted paths, the choices of settings, flat vectors, the metrics' names and the rule of a
run's best value); the data and model registries (which know nothing of the settings); the settings
(config.py, which checks dataset and model names against those registries); the run folder, checkpoints,
logging and the cluster; the pieces of training (the LightningModule, client updates, server optimizers,
constraints); the algorithms; the callbacks and diagnostics; the federation; `fit`; the command line's parser
(`cli`), which the experiments use to read their grid points; the experiments' reader of run folders
(`experiments.runs`), then their plans (`experiments.plans`: the plan file, its grid, the tuning rule), then
running them (`experiments.sweeps`) and reading what they logged (`experiments.results`: tables, compare, the
dashboard) side by side, results never importing sweeps (NEVER); and last the commands (`commands`, and
`python -m fl_lightning`). Each package is one floor, each module outside a package one entry: a module
belongs to the layer of the longest prefix listed for it; within a layer any import is allowed that makes no
cycle.

Imports in `if TYPE_CHECKING:` blocks never run on import, but they may close no cycle either (a
module that needs a type of a module importing it is one module in two files) nor reach above
their layer:
jsonargparse runs them for every module whose signatures it reads (fit.py's import of the federation
there once made parsing a command line import Lightning).
"""

import ast
from pathlib import Path

import pytest
from paths import REPOSITORY

PACKAGE = REPOSITORY / "fl_lightning"

LAYERS = [
    ("errors", ["fl_lightning", "fl_lightning.errors"]),
    ("helpers",
     ["fl_lightning.atomic_files", "fl_lightning.choices", "fl_lightning.configurable", "fl_lightning.cpu",
      "fl_lightning.file_lock", "fl_lightning.flat", "fl_lightning.host_memory", "fl_lightning.metric_names",
      "fl_lightning.registry", "fl_lightning.yaml_text"]),
    ("data and models", ["fl_lightning.data", "fl_lightning.models"]),
    ("settings", ["fl_lightning.config", "fl_lightning.participation"]),
    ("run folder, logging and cluster",
     ["fl_lightning.run_dir", "fl_lightning.checkpoint", "fl_lightning.wandb_file", "fl_lightning.run_logging",
      "fl_lightning.run_folder",
      "fl_lightning.cluster", "fl_lightning.lost_ranks"]),
    ("training pieces",
     ["fl_lightning.module", "fl_lightning.clients", "fl_lightning.server_optimizers", "fl_lightning.constraints"]),
    ("algorithms", ["fl_lightning.algorithms"]),
    ("callbacks", ["fl_lightning.callbacks", "fl_lightning.diagnostics"]),
    ("federation", ["fl_lightning.federation"]),
    ("fit", ["fl_lightning.fit"]),
    ("command line", ["fl_lightning.cli"]),
    ("experiments' run folders", ["fl_lightning.experiments", "fl_lightning.experiments.runs"]),
    ("plans", ["fl_lightning.experiments.plans"]),
    ("sweeps and results", ["fl_lightning.experiments.sweeps", "fl_lightning.experiments.results"]),
    ("commands", ["fl_lightning.commands", "fl_lightning.__main__"]),
]


NEVER = [("fl_lightning.experiments.results", "fl_lightning.experiments.sweeps")]
"""Packages of one layer of which the first never reaches the second, even through other modules: reading
a plan's results (`fl-lightning table`) never loads what runs or submits it."""


def module_files() -> dict[str, Path]:
    """Module name -> its file, for every file of the package (a package is its __init__.py)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(module: str, path: Path, modules: dict[str, Path], typing_only: bool) -> set[str]:
    """The package's modules that `module` imports anywhere in its file: those its code imports
    (typing_only false), or those it imports only for type checkers, in `if TYPE_CHECKING:` blocks."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST, under_type_checking: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, under_type_checking)
            return
        if under_type_checking == typing_only:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # a relative import
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`
        for child in ast.iter_child_nodes(node):
            visit(child, under_type_checking)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return {name for name in found if name in modules and name != module}


def import_graph(typing_only: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    return {module: imported_modules(module, path, modules, typing_only) for module, path in modules.items()}


def layer_of(module: str) -> int:
    # The package itself is a layer's member by its name alone: as a prefix it would take in every module.
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or (prefix != "fl_lightning" and module.startswith(prefix + "."))]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as the modules along it (the first repeated at the end), or []."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module], _ = "open", path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported):], imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module], _ = "done", path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_the_graph_sees_imports_at_the_top_inside_functions_and_for_type_checkers(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from fl_lightning.errors import ConfigError\n"
        "if TYPE_CHECKING:\n"
        "    from fl_lightning.federation import RankInputs\n"
        "def build():\n"
        "    from fl_lightning.cli import parser\n"
        "    import fl_lightning.flat\n")
    modules = module_files()
    assert imported_modules("example", source, modules, typing_only=False) == {
        "fl_lightning.errors", "fl_lightning.cli", "fl_lightning.cli.parser", "fl_lightning.flat"}
    assert imported_modules("example", source, modules, typing_only=True) == {"fl_lightning.federation"}
    assert "fl_lightning.data.datasets" in import_graph()["fl_lightning.config"]  # inside DataArgs.__post_init__


def test_cycles_are_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_between_files():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_for_type_checkers_closes_a_cycle():
    """A module that names a type of a module importing it has the two halves of one module: they
    belong together, or the type below them both."""
    runtime, typing_only = import_graph(), import_graph(typing_only=True)
    cycle = find_cycle({module: runtime[module] | typing_only[module] for module in runtime})
    assert not cycle, "import cycle through `if TYPE_CHECKING:` imports: " + " -> ".join(cycle)


@pytest.mark.parametrize("typing_only", [False, True], ids=["imports", "imports for type checkers"])
def test_no_file_imports_from_a_layer_above_its_own(typing_only):
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"
              for module, imports in sorted(import_graph(typing_only).items()) for imported in sorted(imports)
              if layer_of(imported) > layer_of(module)]
    assert not upward, "\n".join(upward)


def reached_from(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module that importing `module` imports, through any chain of imports."""
    reached, pending = set(), [module]
    while pending:
        for imported in graph[pending.pop()] - reached:
            reached.add(imported)
            pending.append(imported)
    return reached


def test_reached_from_follows_chains_of_imports():
    assert reached_from("a", {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}) == {"b", "c"}


@pytest.mark.parametrize("reader, never", NEVER, ids=[f"{a} never reaches {b}" for a, b in NEVER])
def test_a_package_never_reaches_what_it_must_not(reader, never):
    graph = {module: runtime | typing for (module, runtime), typing in
             zip(import_graph().items(), import_graph(typing_only=True).values())}
    reaching = {module: sorted(reached for reached in reached_from(module, graph) if reached.startswith(never + "."))
                for module in graph if module == reader or module.startswith(reader + ".")}
    assert len(reaching) > 1, f"{reader} has no modules"
    assert not any(reaching.values()), "\n".join(f"{module} reaches {', '.join(found)}"
                                                for module, found in reaching.items() if found)
