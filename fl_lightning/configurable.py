"""Objects that a config names by dotted path: components chosen by `class_path` (which record the
arguments they were built with), and the model factories and dataset loaders given as
`module.function`. `resolve_dotted_path` is the one way such a name becomes an object."""

from __future__ import annotations

import importlib
import inspect


def resolve_dotted_path(path: str) -> object:
    """The object that `path` names: `module.name`, or attributes below it (`package.module.Class.attr`),
    its module imported. Raises ValueError for a string that is no dotted path, ModuleNotFoundError
    when no module of the path exists (its `name` is the missing module), AttributeError when the
    module has no such name, and whatever the module raises while it is imported: an import that
    fails inside an existing module is never mistaken for a missing one."""
    parts = path.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise ValueError(f"{path!r} is not a dotted path (module.name)")
    split = len(parts) - 1
    while True:
        module_name = ".".join(parts[:split])
        try:
            found = importlib.import_module(module_name)
            break
        except ModuleNotFoundError as err:
            if err.name != module_name or split == 1:
                raise
            split -= 1  # not a module: the name of something in its parent
    for attribute in parts[split:]:
        found = getattr(found, attribute)
    return found


def missing_module(path: str, err: BaseException) -> bool:
    """Whether `err`, raised by `resolve_dotted_path(path)`, says that the path's top module is not on
    sys.path (rather than that the module exists and failed to import, or lacks the name)."""
    return isinstance(err, ModuleNotFoundError) and err.name == path.split(".")[0]


def why_unresolved(path: str, err: BaseException) -> str:
    """A dotted path that `resolve_dotted_path` could not resolve, with the cause: what the `got` of
    its ConfigError says."""
    hint = "; add its folder to PYTHONPATH" if missing_module(path, err) else ""
    return f"{path} ({type(err).__name__}: {err}{hint})"


def class_path_of(cls: type) -> str:
    """`module.Class`: the dotted path a config names `cls` by."""
    return f"{cls.__module__}.{cls.__qualname__}"


def init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The parameters of `cls.__init__` that can be given by name (neither self nor *args, **kwargs),
    in their order."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def subclasses(cls: type) -> list[type]:
    """Every subclass of `cls` imported so far, subclasses of subclasses included."""
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *subclasses(sub)]
    return found


class Configurable:
    """Records its constructor's arguments (defaults filled in) as `init_args` before `__init__`
    runs, so that a run's config.yaml is written from what was asked for, never read back from
    attribute names that a subclass may store differently."""

    init_args: dict

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        # bind_partial: unpickling calls __new__ without arguments, then restores init_args.
        bound = inspect.signature(cls.__init__).bind_partial(instance, *args, **kwargs)
        bound.apply_defaults()
        instance.init_args = {name: bound.arguments[name] for name in init_parameters(cls) if name in bound.arguments}
        return instance

    @property
    def class_path(self) -> str:
        return class_path_of(type(self))


class _FrozenOnceBuilt(type):
    """Marks an instance frozen once its outermost constructor has returned."""

    def __call__(cls, *args, **kwargs):
        instance = super().__call__(*args, **kwargs)
        object.__setattr__(instance, "_frozen", True)
        return instance


class FrozenConfigurable(Configurable, metaclass=_FrozenOnceBuilt):
    """A Configurable that is hyper-parameters only: its constructor sets its attributes, and nothing
    writes one afterwards, so one instance may serve any number of runs. What changes while a run
    trains is the run's, kept outside it (`fl_lightning.server_optimizers.ServerState`)."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"{type(self).__name__} holds hyper-parameters only and is frozen once built: "
                                 f"cannot set {name!r} (a run's state is kept by the run)")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"{type(self).__name__} is frozen once built: cannot delete {name!r}")
        super().__delattr__(name)
