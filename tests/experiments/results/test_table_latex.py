"""`fl-lightning table --format latex`: table.tex, booktabs style, on run folders written by hand. Its
structure is checked as text everywhere; where pdflatex is installed, it is also compiled as a paper
would \\input it, in a two-column article with booktabs alone, and must fit the page (skipped where
none is installed)."""

import copy
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hand_written_runs import direct_interval, write_run

from fl_lightning.commands.main import main
from fl_lightning.experiments.results.table_cells import Cell, Table
from fl_lightning.experiments.results.table_latex import latex_table, latex_text, tuned_values
from fl_lightning.experiments.results.table_sources import describe_setting

# Method folder names as a plan names its methods (and worse): each must come out as the name, in LaTeX.
METHODS = {"FedAvg": "FedAvg", "FedAvg + CONST": "FedAvg + CONST", "CTP-FL h=0": "CTP-FL h=0",
           "x_1 & 50% #2 {a} ~^$": r"x\_1 \& 50\% \#2 \{a\} \textasciitilde{}\textasciicircum{}\$"}
# setting -> method -> seed -> final test accuracy; CTP-FL h=0 at alpha 0.1 has two seeds.
FINALS = {"alpha-0.5": {"FedAvg": [0.60, 0.62, 0.58], "FedAvg + CONST": [0.66, 0.69, 0.65],
                        "CTP-FL h=0": [0.50, 0.61, 0.40], "x_1 & 50% #2 {a} ~^$": [0.61, 0.62, 0.59]},
          "alpha-0.1": {"FedAvg": [0.40, 0.42, 0.38], "FedAvg + CONST": [0.41, 0.45, 0.44],
                        "CTP-FL h=0": [0.30, 0.31], "x_1 & 50% #2 {a} ~^$": [0.35, 0.36, 0.30]}}


def write_runs(root: Path) -> None:
    for setting, methods in FINALS.items():
        for method, finals in methods.items():
            for seed, final in enumerate(finals):
                write_run(root / setting / method / f"seed{seed}", [final - 0.05, final])


@pytest.fixture
def tex(tmp_path) -> str:
    """table.tex of the runs, with the paper's numbers and the differences to FedAvg."""
    write_runs(tmp_path / "runs")
    (tmp_path / "paper.csv").write_text("method,alpha-0.5,alpha-0.1\nFedAvg,61.00,40.50\nfedavg+const,66.00,\n")
    out = tmp_path / "out"
    main(["table", "--plan", str(tmp_path / "runs" / "*" / "*" / "seed*"), "--out", str(out), "--format", "latex",
          "--baseline", "FedAvg", "--reference", str(tmp_path / "paper.csv")])
    return (out / "table.tex").read_text()


UNESCAPED = r"(?<!\\)"


def table_rows(tex: str) -> list[str]:
    """The lines of the tabular between \\midrule and \\bottomrule."""
    lines = tex.splitlines()
    return lines[lines.index(r"\midrule") + 1:lines.index(r"\bottomrule")]


def table_cells(tex: str) -> dict[str, tuple[list[str], list[str]]]:
    """Method -> the cells of its row and of the row under it (the paired differences' intervals; [] where
    it has none)."""
    cells = {}
    for row in table_rows(tex):
        first, *rest = row.removesuffix(r" \\").split(" & ")
        if first:
            method = first
            cells[method] = (rest, [])
        else:
            cells[method] = (cells[method][0], rest)
    return cells


def test_latex_table_structure(tex):
    body = "\n".join(line for line in tex.splitlines() if not line.startswith("%"))  # comments are free text
    plain = body.replace(r"\{", "").replace(r"\}", "")
    depth = 0
    for character in plain:
        depth += {"{": 1, "}": -1}.get(character, 0)
        assert depth >= 0
    assert depth == 0  # balanced braces
    for special in "%#_&":
        assert not re.search(UNESCAPED + re.escape(special), body.replace(" & ", " ")), special
    assert all(line.count("$") % 2 == 0 for line in body.replace(r"\$", "").splitlines())  # math opened is closed
    columns = re.search(r"\\begin\{tabular\}\{(l(?:c)+)\}", tex).group(1)
    assert columns == "l" + "c" * 2 * 4  # per setting: ours, paper, Δ, vs FedAvg
    rows = table_rows(tex)
    assert len(rows) == len(METHODS) + 3  # the compared methods' intervals on a row of their own; not the baseline's
    for row in rows:
        assert len(re.findall(UNESCAPED + "&", row)) == len(columns) - 1 and row.endswith(r" \\")
    order = ["CTP-FL h=0", "FedAvg", "FedAvg + CONST", "x_1 & 50% #2 {a} ~^$"]  # the folders' (+ CONST after its base)
    assert list(table_cells(tex)) == [METHODS[name] for name in order]
    lines = tex.splitlines()
    assert r" & \multicolumn{4}{c}{$\alpha = 0.1$} & \multicolumn{4}{c}{$\alpha = 0.5$} \\" in lines
    assert r"\cmidrule(lr){2-5} \cmidrule(lr){6-9}" in lines
    setting_columns = r"Mean $\pm$ std & Paper & $\Delta$ & vs FedAvg"
    assert f"Method & {setting_columns} & {setting_columns} " + r"\\" in lines
    assert [r"\toprule", r"\midrule", r"\bottomrule"] == [line for line in lines if line in (
        r"\toprule", r"\midrule", r"\bottomrule")]


def test_latex_cells_show_best_std_paper_and_paired_interval(tex):
    cells = table_cells(tex)
    (fedavg, below_fedavg), (const, below_const), (ctpfl, below_ctpfl) = (
        cells["FedAvg"], cells["FedAvg + CONST"], cells["CTP-FL h=0"])
    assert below_fedavg == []  # the baseline has no intervals
    # alpha 0.1 first (the folders' order); cells do not count the same seeds everywhere: each says its n.
    assert fedavg[:4] == [r"$40.00 \pm 2.00$ (3)", "$40.50$", "$-0.50$", "baseline"]
    assert const[4] == r"$\mathbf{66.67 \pm 2.08}$ (3)" and const[5:7] == ["$66.00$", "$+0.67$"]  # best of its column
    # +6, +7, +7 points over FedAvg at alpha 0.5: the interval, under the mean, excludes 0 and the mean is
    # marked; CTP-FL's does not.
    low, high = direct_interval([6.0, 7.0, 7.0])
    assert const[7] == "$+6.67^{*}$" and below_const[7] == f"[${low:+.2f}$, ${high:+.2f}$]"
    low, high = direct_interval([-10.0, -1.0, -18.0])
    assert low < 0 < high and ctpfl[7] == "$-9.67$"
    assert below_ctpfl[7] == f"[${low:+.2f}$, ${high:+.2f}$]"
    assert ctpfl[3] == "$-10.50$" and below_ctpfl[3] == "(2 pairs; seed 2 unpaired)"
    assert below_ctpfl[:3] == ["", "", ""]  # nothing under the value and the paper's columns
    assert ctpfl[0] == r"$30.50 \pm 0.71$ (2)" and ctpfl[1:3] == ["--", "--"]  # no paper number


def test_latex_text_escapes_what_latex_would_read_otherwise():
    assert latex_text("α = 0.5") == r"$\alpha = 0.5$"
    assert latex_text("CIFAR-100, α = 0.1") == r"CIFAR-100, $\alpha = 0.1$"
    assert latex_text("Δ: ours − paper, ±") == r"$\Delta$: ours $-$ paper, $\pm$"
    assert latex_text("--metric a_b") == r"-{}-metric a\_b"
    assert latex_text("50% & #1 {x} \\ ~ ^ < > |") == (r"50\% \& \#1 \{x\} \textbackslash{} \textasciitilde{} "
                                                         r"\textasciicircum{} \textless{} \textgreater{} \textbar{}")
    assert latex_text("γ = h = 0.3, μ=0.01") == r"$\gamma$ = h = 0.3, $\mu$=0.01"
    assert latex_text("Ω–λ") == r"$\Omega$--$\lambda$"


def test_the_caption_says_the_setting_and_the_statistics_in_a_few_sentences_without_command_line_flags(tex):
    caption = re.search(r"\\caption\{(.*)\}$", tex, re.MULTILINE).group(1)
    assert caption.startswith(r"Test accuracy (\%), at the final round; 4 rounds. Mean $\pm$ sample std over the "
                              r"seeds counted (n); bold: the best of each column.")
    assert "vs FedAvg: the mean over seeds of the difference to the FedAvg run of the same seed" in caption
    assert "-{}-" not in caption and "ddof" not in caption  # no command-line flags, no definitions of the code's
    assert caption.count(". ") <= 5


def test_the_setting_is_what_every_run_shares_as_a_paper_states_it():
    config = {"model": {"name": "lenet5"}, "data": {"name": "cifar10", "alpha": 0.5},
              "federation": {"num_clients": 100, "clients_per_round": 10, "local_steps": 50, "local_epochs": None,
                             "rounds": 300}}
    assert describe_setting([config]) == ("LeNet-5 on CIFAR-10, N = 100 clients, S = 10 per round, K = 50 local "
                                          "steps, 300 rounds")
    epochs = copy.deepcopy(config)
    epochs["federation"].update(local_steps=None, local_epochs=2)
    epochs["model"]["name"] = "my_model.make_net"
    # What differs between the runs (the model, the local work) is the columns' or blocks' to say.
    assert describe_setting([config, epochs]) == "CIFAR-10, N = 100 clients, S = 10 per round, 300 rounds"
    assert describe_setting([epochs]).startswith("make_net on CIFAR-10, N = 100 clients, S = 10 per round, E = 2 "
                                                 "local epochs")
    assert describe_setting([]) == ""


def test_the_tuned_values_are_a_visible_paragraph_in_the_float(tex):
    table = Table(metric="test_accuracy", at="final", methods=["FedAvg", "FedAvg + CONST", "SCAFFOLD"],
                  settings=["alpha-0.5", "alpha-0.1"], labels={"alpha-0.5": "α = 0.5", "alpha-0.1": "α = 0.1"},
                  cells={(m, s): Cell() for m in ("FedAvg", "FedAvg + CONST", "SCAFFOLD")
                         for s in ("alpha-0.5", "alpha-0.1")}, curves={}, percent=True, decimals=2, reference=False,
                  choices={("FedAvg", "alpha-0.5"): "client_optimizer.lr=0.5",
                           ("FedAvg", "alpha-0.1"): "client_optimizer.lr=0.2",
                           ("FedAvg + CONST", "alpha-0.5"): "client_optimizer.lr=0.5",
                           ("FedAvg + CONST", "alpha-0.1"): "client_optimizer.lr=0.5"},
                  tuning="on seed 100, by the best val_accuracy")
    tuned = (r"Tuned on a validation split, on seed 100, by the best val\_accuracy: FedAvg: client\_optimizer.lr=0.5 "
             r"($\alpha = 0.5$), client\_optimizer.lr=0.2 ($\alpha = 0.1$); FedAvg + CONST: client\_optimizer.lr=0.5.")
    assert tuned_values(table) == tuned
    lines = latex_table(table).splitlines()
    float_body = lines[lines.index(r"\def\flTableFloat{"):]
    assert rf"\par\smallskip{{\footnotesize {tuned}\par}}" in float_body[:float_body.index("}")]
    assert tuned_values(dataclasses.replace(table, choices={})) == "" and "Tuned" not in tex


PDFLATEX = shutil.which("pdflatex")
# The float each table.tex chose, said in the log: LaTeX's table and table* begin with these.
FLOAT_SPY = (r"\makeatletter\let\spyFloat\@float\def\@float#1{\typeout{FLOAT: #1}\spyFloat{#1}}"
             r"\let\spyDblFloat\@dblfloat\def\@dblfloat#1{\typeout{FLOAT: #1*}\spyDblFloat{#1}}\makeatother")


def compiled(tex: str, folder: Path, columns: str) -> str:
    """The log of a paper (an article in `columns`, booktabs its only package) that \\inputs `tex`."""
    folder.mkdir()
    (folder / "table.tex").write_text(tex)
    (folder / "paper.tex").write_text(
        f"\\documentclass[{columns}]{{article}}\n\\usepackage{{booktabs}}\n{FLOAT_SPY}\n\\begin{{document}}\n"
        "Some text.\n\n\\input{table.tex}\nMore text.\n\\end{document}\n")
    done = subprocess.run([PDFLATEX, "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=folder,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert (folder / "paper.pdf").stat().st_size > 0
    return (folder / "paper.log").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(PDFLATEX is None, reason="pdflatex is not installed (Debian: texlive-latex-base "
                    "texlive-latex-recommended, which .ci/run installs where it can)")
def test_latex_table_compiles_with_booktabs_and_fits_the_page(tex, tmp_path):
    # Two settings of a value, the paper's, Δ and the paired difference: wider than a column, across both.
    log = compiled(tex, tmp_path / "two_columns", "twocolumn")
    assert "FLOAT: table*" in log and "Overfull \\hbox" not in log
    assert "Missing character" not in log  # a character the fonts lack is only a warning, and a hole in the table
    # One setting, no baseline: a column is enough, in a two-column paper as in a one-column one.
    out = tmp_path / "narrow"
    main(["table", "--plan", str(tmp_path / "runs" / "alpha-0.5" / "*" / "seed*"), "--out", str(out), "--format",
          "latex"])
    for columns in ("twocolumn", "onecolumn"):
        log = compiled((out / "table.tex").read_text(), tmp_path / f"narrow_{columns}", columns)
        assert "FLOAT: table\n" in log and "Overfull \\hbox" not in log
