"""Dotted paths resolved to objects (and the errors that tell a missing module from a module that fails to
import), the class path a config names a class by, the parameters a config can give, subclasses found,
and the constructor arguments a Configurable records."""

import collections
import inspect
import json
import os
import pickle
import sys
import textwrap

import pytest

from fl_lightning.configurable import (
    Configurable,
    class_path_of,
    init_parameters,
    missing_module,
    resolve_dotted_path,
    subclasses,
    why_unresolved,
)


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Writes modules of a user's (name -> source; a name with dots makes packages) into a folder on
    sys.path; they are forgotten after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(modules: dict) -> None:
        for name, source in modules.items():
            parts = name.split(".")
            folder = tmp_path.joinpath(*parts[:-1])
            folder.mkdir(parents=True, exist_ok=True)
            for depth in range(1, len(parts)):
                tmp_path.joinpath(*parts[:depth], "__init__.py").touch()
            (folder / f"{parts[-1]}.py").write_text(textwrap.dedent(source))
            written.append(parts[0])

    yield write
    for name in list(sys.modules):
        if name.split(".")[0] in written:
            del sys.modules[name]


def test_a_dotted_path_names_a_modules_attribute():
    assert resolve_dotted_path("os.path.join") is os.path.join
    assert resolve_dotted_path("json.dumps") is json.dumps


def test_a_dotted_path_may_go_on_below_a_class():
    assert resolve_dotted_path("collections.OrderedDict.fromkeys") == collections.OrderedDict.fromkeys


def test_a_module_not_yet_imported_is_imported(user_modules):
    user_modules({"my_loaders": "def load(root, download):\n    return ('loaded', root, download)\n"})
    assert "my_loaders" not in sys.modules
    load = resolve_dotted_path("my_loaders.load")
    assert load("data", False) == ("loaded", "data", False)


def test_a_class_inside_a_submodule_that_its_package_does_not_import_is_found(user_modules):
    user_modules({"my_package.components": """
        class Scaler:
            @staticmethod
            def create():
                return "scaler made"
    """})
    assert resolve_dotted_path("my_package.components.Scaler.create")() == "scaler made"


@pytest.mark.parametrize("path", ["json", "", "os..path", "os.path.", ".os.path", "1st.load", "my-module.load",
                                  "os.path join"])
def test_a_string_that_is_no_dotted_path_is_refused(path):
    with pytest.raises(ValueError) as caught:
        resolve_dotted_path(path)
    assert str(caught.value) == f"{path!r} is not a dotted path (module.name)"


def test_a_missing_top_module_is_a_module_not_found_error_naming_it():
    path = "no_such_module_anywhere.load"
    with pytest.raises(ModuleNotFoundError) as caught:
        resolve_dotted_path(path)
    assert caught.value.name == "no_such_module_anywhere"
    assert missing_module(path, caught.value)
    assert why_unresolved(path, caught.value) == (
        "no_such_module_anywhere.load (ModuleNotFoundError: No module named 'no_such_module_anywhere'; "
        "add its folder to PYTHONPATH)")


def test_a_module_that_exists_but_imports_a_missing_one_is_not_taken_for_missing(user_modules):
    user_modules({"needs_a_dependency": "import absent_dependency_of_the_user\n\ndef load(root, download):\n"
                                        "    pass\n"})
    path = "needs_a_dependency.load"
    with pytest.raises(ModuleNotFoundError) as caught:
        resolve_dotted_path(path)
    assert caught.value.name == "absent_dependency_of_the_user"
    assert not missing_module(path, caught.value)
    # No advice about PYTHONPATH: the module was found, its own import failed.
    assert why_unresolved(path, caught.value) == (
        "needs_a_dependency.load (ModuleNotFoundError: No module named 'absent_dependency_of_the_user')")


def test_a_submodule_that_imports_a_missing_one_is_not_taken_for_the_name_of_something_in_its_package(
        user_modules):
    user_modules({"my_models.broken": "import absent_dependency_of_the_user\nclass Net:\n    pass\n"})
    with pytest.raises(ModuleNotFoundError) as caught:
        resolve_dotted_path("my_models.broken.Net")
    assert caught.value.name == "absent_dependency_of_the_user"


def test_whatever_a_module_raises_while_imported_comes_out(user_modules):
    user_modules({"raises_on_import": "raise RuntimeError('the config file of this module is missing')\n"})
    with pytest.raises(RuntimeError, match="the config file of this module is missing") as caught:
        resolve_dotted_path("raises_on_import.load")
    assert not missing_module("raises_on_import.load", caught.value)


def test_a_name_the_module_lacks_is_an_attribute_error():
    path = "json.no_such_function"
    with pytest.raises(AttributeError) as caught:
        resolve_dotted_path(path)
    assert not missing_module(path, caught.value)
    assert why_unresolved(path, caught.value) == (
        "json.no_such_function (AttributeError: module 'json' has no attribute 'no_such_function')")


def test_a_missing_submodule_of_an_existing_package_is_a_name_its_package_lacks():
    with pytest.raises(AttributeError, match="'no_such_submodule'") as caught:
        resolve_dotted_path("json.no_such_submodule.thing")
    assert not missing_module("json.no_such_submodule.thing", caught.value)


class Outer:
    class Inner:
        pass


def test_the_class_path_is_the_module_and_the_qualified_name():
    assert class_path_of(collections.OrderedDict) == "collections.OrderedDict"
    assert class_path_of(Outer.Inner) == f"{__name__}.Outer.Inner"


def test_the_class_path_resolves_back_to_the_class(user_modules):
    user_modules({"my_components": "class Scaled:\n    pass\n"})
    scaled = resolve_dotted_path("my_components.Scaled")
    assert class_path_of(scaled) == "my_components.Scaled"
    assert resolve_dotted_path(class_path_of(scaled)) is scaled
    assert resolve_dotted_path(class_path_of(Outer.Inner)) is Outer.Inner


def test_init_parameters_are_those_given_by_name_in_their_order():
    class Component:
        def __init__(self, only_positional, /, lr, betas=(0.9, 0.999), *args, eps, decay=0.0, **kwargs):
            pass

    parameters = init_parameters(Component)
    assert list(parameters) == ["lr", "betas", "eps", "decay"]
    assert parameters["betas"].default == (0.9, 0.999)
    assert parameters["eps"].default is inspect.Parameter.empty
    assert parameters["decay"].kind is inspect.Parameter.KEYWORD_ONLY


def test_subclasses_include_the_subclasses_of_subclasses():
    class Base:
        pass

    class First(Base):
        pass

    class FirstChild(First):
        pass

    class FirstGrandchild(FirstChild):
        pass

    class Second(Base):
        pass

    assert subclasses(Base) == [First, FirstChild, FirstGrandchild, Second]
    assert subclasses(FirstGrandchild) == []


class Momentum(Configurable):
    def __init__(self, lr, betas=(0.9, 0.999), *, eps=1e-8, nesterov=False):
        # Stored under other names than the arguments: init_args must not depend on them.
        self.learning_rate = lr
        self.coefficients = list(betas)
        self.seen_in_init = dict(self.init_args)


class WithExtras(Configurable):
    def __init__(self, scale, *args, **kwargs):
        self.scale = scale


def test_init_args_hold_every_argument_by_name_with_the_defaults_filled_in():
    made = Momentum(0.1, eps=1e-6)
    assert made.init_args == {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-6, "nesterov": False}
    assert Momentum(lr=0.5, betas=(0.8, 0.9), nesterov=True).init_args == {
        "lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-8, "nesterov": True}


def test_init_args_are_recorded_before_init_runs():
    made = Momentum(0.3)
    assert made.seen_in_init == {"lr": 0.3, "betas": (0.9, 0.999), "eps": 1e-8, "nesterov": False}


def test_init_args_leave_out_what_no_config_can_name():
    made = WithExtras(2.0, "positional extra", flag=True)
    assert made.init_args == {"scale": 2.0}


def test_a_call_that_init_cannot_take_is_refused():
    with pytest.raises(TypeError):
        Momentum(0.1, (0.9, 0.99), 1e-6)  # eps is keyword-only
    with pytest.raises(TypeError):
        Momentum(0.1, momentum=0.9)


def test_a_configurable_unpickles_with_its_init_args():
    made = Momentum(0.2, nesterov=True)
    copy = pickle.loads(pickle.dumps(made))
    assert copy.init_args == {"lr": 0.2, "betas": (0.9, 0.999), "eps": 1e-8, "nesterov": True}
    assert copy.learning_rate == 0.2


def test_the_class_path_of_a_configurable_names_its_own_class(user_modules):
    user_modules({"my_callbacks": """
        from fl_lightning.configurable import Configurable

        class Base(Configurable):
            def __init__(self, every=1):
                self.every = every

        class Printer(Base):
            def __init__(self, folder, every=2):
                super().__init__(every)
    """})
    printer = resolve_dotted_path("my_callbacks.Printer")("logs")
    assert printer.class_path == "my_callbacks.Printer"
    assert resolve_dotted_path(printer.class_path) is type(printer)
    # The subclass's own signature is recorded, not its base's.
    assert printer.init_args == {"folder": "logs", "every": 2}
