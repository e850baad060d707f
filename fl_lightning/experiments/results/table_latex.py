"""table.tex of `fl-lightning table --format latex`: the table as a LaTeX float in booktabs style, for
`\\input{table.tex}` in a paper whose preamble has `\\usepackage{booktabs}` (nothing else is needed).

It shows what table.md shows: per cell the mean ± sample std (bold: the best of its column), with a
reference the paper's number and the difference to it, with `--baseline` the mean paired difference
(`$^{*}$` where its 95% interval excludes 0) and, on a row of its own under it, the interval (or
where there is none, the pairs counted). When every cell counts the same number of
seeds, the caption says how many and the cells leave it out; otherwise each cell has its (n).

The caption says what a reader of the paper needs: the metric and the setting that the runs share
(model, dataset, N clients, S per round, K local steps or E epochs, rounds:
table_sources.describe_setting; what differs between columns or blocks is in their labels), what ±
is and, with a baseline, what the difference and its interval are, in a sentence or two. The values
a tuning stage chose follow the tabular in the float, in small type, visible in the PDF. The notes
under the Markdown table (runs left out, not started, ...) are for the researcher, not the reader:
they follow the float as comments.

It fits the page: the tabular is measured when the paper is compiled (`\\setbox0`), set in a `table`
of one column where it fits one, in a `table*` across both columns of a two-column paper where it does
not, and in smaller type with narrower column gaps where it is wider than the text (footnotesize, then
scriptsize, then tiny, until it fits; wider still, split it into several tables; macros
`\\flTabular`, `\\flTableFloat` and `\\flTableSize`, defined anew by each table.tex).

Every text (method names such as `FedAvg + CONST` or `CTP-FL h=0`, column labels such as `α = 0.5`,
the caption) is escaped: LaTeX's special characters (`& % $ # _ { } ~ ^ \\`, `< > |`), `--` (which
LaTeX sets as a dash), Greek letters and the symbols the table uses (`±`, `Δ`, `−`, `–`) become
their LaTeX forms, and `α = 0.5` becomes `$\\alpha = 0.5$`.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Optional

from fl_lightning.experiments.results.cost_axes import AXIS_UNITS
from fl_lightning.experiments.results.statistics import MIN_PAIRS
from fl_lightning.experiments.results.table_cells import Cell, Table
from fl_lightning.experiments.runs import budget_phrase

_SPECIAL = {"\\": r"\textbackslash{}", "{": r"\{", "}": r"\}", "$": r"\$", "&": r"\&", "#": r"\#", "%": r"\%",
            "_": r"\_", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}",
            ">": r"\textgreater{}", "|": r"\textbar{}", "±": r"$\pm$", "−": "$-$", "–": "--", "—": "---",
            "×": r"$\times$", "→": r"$\rightarrow$", "≤": r"$\leq$", "≥": r"$\geq$", "\n": " "}
_GREEK_SMALL = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau upsilon "
                "phi chi psi omega").split()
_GREEK_CAPITAL = "Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega".split()


def _greek_letters() -> dict[str, str]:
    """α -> $\\alpha$, Δ -> $\\Delta$, ... (Unicode spells lambda LAMDA)."""
    def letter(case: str, name: str) -> str:
        return unicodedata.lookup(f"GREEK {case} LETTER {name.upper().replace('LAMBDA', 'LAMDA')}")

    return {**{letter("SMALL", name): f"$\\{name}$" for name in _GREEK_SMALL},
            **{letter("CAPITAL", name): f"$\\{name}$" for name in _GREEK_CAPITAL}}


_REPLACEMENTS = {**_SPECIAL, **_greek_letters()}
_SYMBOL_EQUALS_NUMBER = re.compile(r"\$(\\[A-Za-z]+)\$ = ([-+]?\d[\d.eE+-]*)")


def latex_text(text: str) -> str:
    """`text` as LaTeX sets it in running text (see the module's docstring)."""
    escaped = "".join(_REPLACEMENTS.get(character, character) for character in str(text))
    escaped = re.sub(r"-(?=-)", "-{}", escaped) if "--" in text else escaped
    return _SYMBOL_EQUALS_NUMBER.sub(r"$\1 = \2$", escaped)


SMALLER = (r"\footnotesize\setlength{\tabcolsep}{3pt}", r"\scriptsize\setlength{\tabcolsep}{2pt}",
           r"\tiny\setlength{\tabcolsep}{1pt}")
"""The sizes a tabular wider than the text is set in, each tried in turn until one fits."""


def latex_table(table: Table) -> str:
    seeds = {cell.n for cell in table.cells.values() if cell.n}
    # Cells with runs not reached (--target) count fewer values than runs: each says its n.
    same_n = seeds.pop() if len(seeds) == 1 and not any(cell.not_reached for cell in table.cells.values()) else None
    per_setting = 1 + 2 * table.reference + (table.baseline is not None)
    columns = 1 + per_setting * len(table.settings)
    label = re.sub(r"[^A-Za-z0-9:.-]+", "-", table.plan or "table")
    # No space may enter the box that measures the tabular: its macro opens and closes on the tabular's lines.
    tabular = [rf"\def\flTabular{{\begin{{tabular}}{{l{'c' * (columns - 1)}}}", r"\toprule",
               *_header(table, per_setting), r"\midrule"]
    for method in table.methods:
        tabular += _rows(table, method, same_n is not None)
    tabular += [r"\bottomrule", r"\end{tabular}}"]
    float_body = [r"\centering", rf"\caption{{{caption(table, same_n)}}}", rf"\label{{tab:{label}}}",
                  r"\flTableSize\flTabular"]
    tuned = tuned_values(table)
    if tuned:
        float_body.append(rf"\par\smallskip{{\footnotesize {tuned}\par}}")
    lines = ["% fl-lightning table: \\input it where the preamble has \\usepackage{booktabs} (nothing else). It is",
             "% set in one column (table) where it fits, else across both (table*), and in smaller type where it",
             "% is wider than the text.", r"\def\flTableSize{}", *tabular, r"\def\flTableFloat{", *float_body, "}",
             r"\setbox0=\hbox{\flTabular}",
             *(rf"\ifdim\wd0>\textwidth\def\flTableSize{{{size}}}\setbox0=\hbox{{\flTableSize\flTabular}}\fi"
               for size in SMALLER),
             r"\ifdim\wd0>\columnwidth", r"\begin{table*}[t]\flTableFloat\end{table*}",
             r"\else", r"\begin{table}[t]\flTableFloat\end{table}", r"\fi"]
    lines += [f"% {note}" for note in table.notes]
    return "\n".join(lines) + "\n"


def caption(table: Table, same_n: Optional[int]) -> str:
    """What a reader of the paper needs, in LaTeX: the metric and the setting the runs share
    (table_sources.describe_setting), what ± is, and with a baseline what the paired difference and its
    interval are; with a reference what the paper's number and Δ are. With a target, the caption of its
    costs (target_caption)."""
    if table.target is not None:
        return target_caption(table, same_n)
    metric = table.metric.replace("_", " ").capitalize() + (" (%)" if table.percent else "")
    at = {"final": "at the final round", "best": "at the best evaluation"}.get(
        table.at, budget_phrase(table.at) or f"mean of the last {table.at.partition(':')[2]} evaluations")
    seeds = f"over {same_n} seed{'s' * (same_n > 1)}" if same_n else "over the seeds counted (n)"
    text = [f"{metric}, {at}" + (f"; {table.setting}" if table.setting else "") + ".",
            f"Mean ± sample std {seeds}; bold: the best of each column."]
    if table.reference:
        own = " (at the paper's own settings)" if table.overrides else ""
        text.append(f"Paper: the published number{own}; Δ: ours minus the paper's.")
    caption = latex_text(" ".join(text))
    if table.baseline is not None:
        caption += " " + latex_text(
            f"vs {table.baseline}: the mean over seeds of the difference to the {table.baseline} run of the same "
            f"seed (the same partition and client sampling), with its 95% confidence interval (Student's t) below "
            "it; ")
        caption += "$^{*}$" + latex_text(f": the interval excludes 0 (fewer than {MIN_PAIRS} pairs, or a seed "
                                         "unpaired: the pairs counted instead).")
    return caption


def target_caption(table: Table, same_n: Optional[int]) -> str:
    """The caption of a table of costs to reach a target (--target): the axis and the target, what ± is
    and what not reached counts, and with a baseline what the ratio and its interval are."""
    target = table.target
    seeds = f"over {same_n} seed{'s' * (same_n > 1)}" if same_n else "over the seeds whose runs reached it (n)"
    text = [f"{AXIS_UNITS[target.axis].capitalize()} ({target.axis}) to reach {target.goal}: each run's at its "
            f"first evaluation {target.reached_by} {target.threshold:g}"
            + (f"; {table.setting}" if table.setting else "") + ".",
            f"Mean ± sample std {seeds}; runs that never reached it are counted as not reached; bold: the lowest "
            "of each column among the cells whose runs all reached it."]
    caption = latex_text(" ".join(text))
    if table.baseline is not None:
        caption += " " + latex_text(
            f"vs {table.baseline}: the geometric mean over seeds of the ratio to the {table.baseline} run's "
            "cost of the same seed, over the seeds whose runs both reached the target, with its 95% confidence "
            "interval on the log scale (Student's t) below it; ")
        caption += "$^{*}$" + latex_text(f": the interval excludes 1 (fewer than {MIN_PAIRS} pairs: the pairs "
                                         "counted instead).")
    return caption


def tuned_values(table: Table) -> str:
    """The values the tuning stages chose, in LaTeX, a method after another: `Tuned on a validation
    split, on seed 100, by the best val_accuracy: FedAvg: client_optimizer.lr=0.5 (α = 0.5),
    client_optimizer.lr=0.2 (α = 0.1); FedAvg + CONST: client_optimizer.lr=0.5.`; "" without any."""
    methods = []
    for method in table.methods:
        chosen = {setting: table.choices[method, setting] for setting in table.settings
                  if (method, setting) in table.choices}
        if not chosen:
            continue
        if len(chosen) == len(table.settings) and len(set(chosen.values())) == 1:
            methods.append(f"{method}: {next(iter(chosen.values()))}")
        else:
            methods.append(f"{method}: " + ", ".join(f"{values} ({table.labels[setting]})"
                                                      for setting, values in chosen.items()))
    if not methods:
        return ""
    return latex_text(f"Tuned on a validation split, {table.tuning}: " + "; ".join(methods) + ".")


def _header(table: Table, per_setting: int) -> list[str]:
    """One row of the settings' labels, or with a reference or a baseline, a row of labels over their
    columns (with a rule under each) and a row naming the columns."""
    labels = [latex_text(table.labels[setting]) for setting in table.settings]
    if per_setting == 1:
        return [" & ".join(["Method", *labels]) + r" \\"]
    names = ["Mean $\\pm$ std"] + ["Paper", r"$\Delta$"] * table.reference
    names += [f"vs {latex_text(table.baseline)}"] if table.baseline is not None else []
    groups = [rf"\multicolumn{{{per_setting}}}{{c}}{{{label}}}" for label in labels]
    rules = [rf"\cmidrule(lr){{{2 + i * per_setting}-{1 + (i + 1) * per_setting}}}" for i in range(len(labels))]
    return [" & ".join(["", *groups]) + r" \\", " ".join(rules), " & ".join(["Method", *names * len(labels)]) + r" \\"]


def _rows(table: Table, method: str, same_n: bool) -> list[str]:
    """The method's row; with a baseline, a second row under it where a paired difference has an interval
    (or its pairs counted) to show, under the difference."""
    first, second = [latex_text(method)], [""]
    for setting in table.settings:
        cell = table.cells[method, setting]
        first.append(_value(table, cell, same_n))
        if table.reference:
            first += [_math(table.number(cell.paper)), _math(table.number(cell.diff, sign=True))]
        second += [""] * (1 + 2 * table.reference)
        if table.baseline is not None:  # its words are plain ASCII ("2 pairs; seed 3 unpaired"), its numbers LaTeX's
            mean, detail, marked = table.paired_parts(
                method, setting, signed=lambda value: _math(table.paired_number(value)), dash="--")
            first.append(mean.removesuffix("$") + "^{*}$" if marked else mean)  # a marked mean is a number: $+1.20^{*}$
            second.append(detail)
    rows = [" & ".join(first) + r" \\"]
    if any(second):
        rows.append(" & ".join(second) + r" \\")
    return rows


def _value(table: Table, cell: Cell, same_n: bool) -> str:
    if cell.n == 0:
        return cell.not_reached_text or ("pending" if cell.pending else "--")
    text = table.number(cell.mean) + ("" if cell.std is None else rf" \pm {table.number(cell.std)}")
    value = (rf"$\mathbf{{{text}}}$" if cell.best else f"${text}$") + ("" if same_n else f" ({cell.n})")
    return value + (f"; {cell.not_reached_text}" if cell.not_reached else "")


def _math(number: str) -> str:
    """A number in math mode (a true minus sign), `--` for none."""
    return "--" if number == "–" else f"${number}$"
