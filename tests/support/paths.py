"""Where the tests find the repository's files, wherever a test file sits under tests/."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""This folder: the tests' helpers, importable by their names (pyproject's `pythonpath`); a process a
test starts gets it on its PYTHONPATH to import them too (recording_callbacks, holds)."""
TESTS = SUPPORT.parent
REPOSITORY = TESTS.parent
CONFIGS = REPOSITORY / "configs"
QUICKSTART = str(CONFIGS / "quickstart.yaml")
"""The quickstart config, as a command line names it."""
EXAMPLES = REPOSITORY / "examples"
