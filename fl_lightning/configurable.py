"""Components chosen in the config by `class_path` record the arguments they were built with."""

from __future__ import annotations

import inspect


class Configurable:
    """Records its constructor's arguments (defaults filled in) as `init_args` before `__init__`
    runs, so that a run's config.yaml is written from what was asked for, never read back from
    attribute names that a subclass may store differently."""

    init_args: dict

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        # bind_partial: unpickling calls __new__ without arguments, then restores init_args.
        signature = inspect.signature(cls.__init__)
        bound = signature.bind_partial(instance, *args, **kwargs)
        bound.apply_defaults()
        named = [name for name, p in list(signature.parameters.items())[1:]
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        instance.init_args = {name: bound.arguments[name] for name in named if name in bound.arguments}
        return instance

    @property
    def class_path(self) -> str:
        cls = type(self)
        return f"{cls.__module__}.{cls.__qualname__}"
