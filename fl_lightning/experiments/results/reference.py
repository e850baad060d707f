"""The papers' numbers beside a table (`fl-lightning table`).

Reference CSV (the papers' numbers; `--reference`, or the plan's `reference:` when the table shows
the plan's `metric`): a header row
`method,<setting>,<setting>,...`, then one row per method. Method names are the plan's (matched
exactly, else by their folder form, "FedAvg + CONST" = "fedavg+const"); setting columns are the
plan's setting names, i.e. the run folders' names (`dataset-cifar10_alpha-0.5`; the Markdown labels
are accepted too); values are in percent (`71.2`; a trailing `± 0.3` is ignored), an empty field
meaning not reported. Methods or settings of the CSV that the table lacks are ignored. For example

    method,alpha-0.5,alpha-0.1
    FedAvg,71.20,65.02
    FedAvg + CONST,74.51,

Every column of the table is then followed by `paper` and `Δ` (ours minus the paper's, in
percentage points), and the CSV gets `<setting>:paper` and `<setting>:diff`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Optional

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import slug


def read_reference(path: Path) -> dict[str, dict[str, Optional[float]]]:
    """The reference CSV (see the module docstring): method -> column -> the paper's number (percent)."""
    try:
        lines = list(csv.reader(io.StringIO(Path(path).read_text(encoding="utf-8-sig"))))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ConfigError("reference", "a readable CSV file (method, then one column per setting)",
                          f"{path} ({err})") from err
    header = [column.strip() for column in lines[0]] if lines else []
    if not header or header[0] != "method":
        raise ConfigError("reference", "a CSV whose first column is `method`", f"{path} (columns {header})")
    table: dict[str, dict[str, Optional[float]]] = {}
    for line, fields in enumerate(lines[1:], start=2):
        if not any(text.strip() for text in fields):
            continue
        row = dict(zip(header, fields))
        method = (row.get("method") or "").strip()
        values = {}
        for column, text in row.items():
            if column == "method":
                continue
            number = (text or "").split("±")[0].strip()
            if not number:
                values[column] = None
                continue
            try:
                values[column] = float(number)
            except ValueError:
                raise ConfigError("reference", "numbers in percent or empty fields",
                                  f"{text!r} in {path}, line {line}, column {column}") from None
        table[method] = values
    return table


def paper_numbers(path: Path, methods: list[str], settings: list[str], labels: dict[str, str]
                  ) -> dict[tuple[str, str], Optional[float]]:
    """(method, setting) -> the paper's number (percent) for every cell of a table; None where it has none."""
    if not path.is_file():
        raise ConfigError("reference", "an existing CSV file of the papers' numbers", str(path))
    reference = read_reference(path)
    by_slug = {slug(name): values for name, values in reference.items()}
    numbers = {}
    for method in methods:
        values = reference.get(method) or by_slug.get(slug(method)) or {}
        for setting in settings:
            numbers[method, setting] = values.get(setting, values.get(labels[setting]))
    return numbers
