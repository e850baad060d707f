import os

import pytest

os.environ.setdefault("WANDB_SILENT", "true")

MULTIPROCESS_GROUP = "multiprocess"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Groups for pytest-xdist's `--dist loadgroup` (tryfirst: xdist reads them in its own hook).

    The tests that start several processes all run on one worker, one at a time: two of them at
    once would put four or more busy processes on two cores, and their process groups could time
    out. The tests sharing a module-scoped fixture (a reference run, most often) run on one worker,
    so that the fixture is computed once rather than once per worker. pytest-xdist 3.8 applies a group
    by rewriting item._nodeid, which pytest 9.2 no longer reads: with those two versions the groups
    are marked but not honoured (docs/performance.md, "The test suite")."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group(MULTIPROCESS_GROUP))
        elif uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def uses_a_module_fixture(item) -> bool:
    definitions = getattr(item, "_fixtureinfo", None)
    return definitions is not None and any(
        fixture.scope == "module" for chain in definitions.name2fixturedefs.values() for fixture in chain)


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory):
    """A small CIFAR-10 folder in the real python-pickle layout."""
    from fl_lightning.data.generate import write_cifar

    root = tmp_path_factory.mktemp("cifar")
    write_cifar(root, variant="cifar10", num_train=240, num_test=60, seed=0)
    return root


@pytest.fixture
def reductions(monkeypatch) -> list[int]:
    """The size of every reduction across ranks a diagnostic makes (Diagnostic.sum_over_ranks), in order."""
    from fl_lightning.diagnostics.base import Diagnostic

    sizes: list[int] = []
    original = Diagnostic.sum_over_ranks

    def counted(fabric, values):
        sizes.append(values.numel())
        return original(fabric, values)

    monkeypatch.setattr(Diagnostic, "sum_over_ranks", staticmethod(counted))
    return sizes
