"""YAML text read into Python values, as `yaml.safe_load` reads it, by libyaml's parser when PyYAML
was built with it: the same values, several times faster, which counts where a table or a sweep
reads the config of every run folder and grid point."""

from __future__ import annotations

import yaml

_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str):
    """`yaml.safe_load(text)`: its value, or the yaml.YAMLError it raises."""
    try:
        return yaml.load(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        # libyaml words its errors otherwise ("did not find expected node content"): the message
        # is the pure-Python parser's, which says what it found where.
        return yaml.safe_load(text)
