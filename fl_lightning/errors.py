"""Errors that any layer may raise: the bottom of the import graph, importing nothing of the package."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field and what was expected."""

    def __init__(self, field_name: str, expected: str, got: object):
        super().__init__(f"{field_name}: expected {expected}, got {got!r}")
        self.field_name = field_name
