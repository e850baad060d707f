"""A registry of named constructors, as timm's models are registered: the built-in models
(fl_lightning.models) and datasets (fl_lightning.data), each registered by a decorator."""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

Entry = TypeVar("Entry", bound=Callable)


class Registry(Generic[Entry]):
    """Name -> entry, in registration order; a name registered twice is refused."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str) -> Callable[[Entry], Entry]:
        """A decorator that registers what it decorates under `name`."""

        def register(entry: Entry) -> Entry:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return register

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> Optional[Entry]:
        return self._entries.get(name)
