"""A registry of named constructors, as timm's models are registered: the built-in models
(fl_lightning.models) and datasets (fl_lightning.data), each registered by a decorator."""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

Entry = TypeVar("Entry", bound=Callable)


class Registry(Generic[Entry]):
    """Name -> entry, in registration order, each with the label a paper's table gives it; a name
    registered twice is refused."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._labels: dict[str, str] = {}

    def register(self, name: str, label: Optional[str] = None) -> Callable[[Entry], Entry]:
        """A decorator that registers what it decorates under `name`, labelled `label` in tables (default:
        the name)."""

        def register(entry: Entry) -> Entry:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            self._labels[name] = label or name
            return entry

        return register

    def label(self, name: str) -> Optional[str]:
        """The label of the entry that `name` names, read as a plan's axis value may spell it (any case,
        with or without - and _: tiny-imagenet, TinyImageNet); None for no entry."""
        wanted = _spelling(name)
        return next((label for entry, label in self._labels.items() if _spelling(entry) == wanted), None)

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> Optional[Entry]:
        return self._entries.get(name)


def _spelling(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")
