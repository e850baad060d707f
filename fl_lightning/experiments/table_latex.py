"""table.tex of `fl-lightning table --format latex`: the table as a LaTeX float in booktabs style, for
`\\input{table.tex}` in a paper whose preamble has `\\usepackage{booktabs}` (nothing else is needed).

It shows what table.md shows: per cell the mean ± sample std (bold: the best of its column), with a
reference the paper's number and the difference to it, with `--baseline` the paired difference and
its 95% interval (`$^{*}$` where the interval excludes 0). When every cell counts the same number of
seeds, the caption says how many and the cells leave it out; otherwise each cell has its (n). The
caption is the Markdown's (the variant and its overrides first, when it is one); the notes under
the Markdown table (runs left out, not started, ...) follow the float as comments.

Every text (method names such as `FedAvg + CONST` or `CTP-FL h=0`, column labels such as `α = 0.5`,
the caption) is escaped: LaTeX's special characters (`& % $ # _ { } ~ ^ \\`, `< > |`), `--` (which
LaTeX sets as a dash), Greek letters and the symbols the table uses (`±`, `Δ`, `−`, `–`) become
their LaTeX forms, and `α = 0.5` becomes `$\\alpha = 0.5$`.
"""

from __future__ import annotations

import re
import unicodedata

from fl_lightning.experiments.table_cells import Cell, Table

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


def latex_table(table: Table) -> str:
    seeds = {cell.n for cell in table.cells.values() if cell.n}
    same_n = len(seeds) == 1
    per_setting = 1 + 2 * table.reference + (table.baseline is not None)
    columns = 1 + per_setting * len(table.settings)
    caption = " ".join(table.caption()) + (f" Each cell: {seeds.pop()} seed(s)." if same_n else "")
    label = re.sub(r"[^A-Za-z0-9:.-]+", "-", table.plan or "table")
    lines = ["% fl-lightning table; \\input it where the preamble has \\usepackage{booktabs}.",
             r"\begin{table}[t]", r"\centering", rf"\caption{{{latex_text(caption)}}}", rf"\label{{tab:{label}}}",
             rf"\begin{{tabular}}{{l{'c' * (columns - 1)}}}", r"\toprule"]
    lines += _header(table, per_setting)
    lines.append(r"\midrule")
    for method in table.methods:
        row = [latex_text(method)]
        for setting in table.settings:
            row += _cells(table, method, setting, same_n)
        lines.append(" & ".join(row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    lines += [f"% {note}" for note in table.notes]
    return "\n".join(lines) + "\n"


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


def _cells(table: Table, method: str, setting: str, same_n: bool) -> list[str]:
    cell = table.cells[method, setting]
    cells = [_value(table, cell, same_n)]
    if table.reference:
        cells += [_math(table.number(cell.paper)), _math(table.number(cell.diff, sign=True))]
    if table.baseline is not None:  # its words are plain ASCII ("2 pairs; seed 3 unpaired"), its numbers LaTeX's
        cells.append(table.paired_text(method, setting, signed=lambda value: _math(table.number(value, sign=True)),
                                       dash="--", mark="$^{*}$"))
    return cells


def _value(table: Table, cell: Cell, same_n: bool) -> str:
    if cell.n == 0:
        return "pending" if cell.pending else "--"
    text = table.number(cell.mean) + ("" if cell.std is None else rf" \pm {table.number(cell.std)}")
    return (rf"$\mathbf{{{text}}}$" if cell.best else f"${text}$") + ("" if same_n else f" ({cell.n})")


def _math(number: str) -> str:
    """A number in math mode (a true minus sign), `--` for none."""
    return "--" if number == "–" else f"${number}$"
