"""`fl-lightning table --format latex`: table.tex, booktabs style, on run folders written by hand. Its
structure is checked as text everywhere; where a LaTeX engine is installed, it is also compiled in a
minimal document with booktabs alone (and skipped where none is)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hand_written_runs import direct_interval, write_run

from fl_lightning.commands.main import main
from fl_lightning.experiments.table_latex import latex_text

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
    assert len(rows) == len(METHODS)
    for row in rows:
        assert len(re.findall(UNESCAPED + "&", row)) == len(columns) - 1 and row.endswith(r" \\")
    order = ["CTP-FL h=0", "FedAvg", "FedAvg + CONST", "x_1 & 50% #2 {a} ~^$"]  # the folders' (+ CONST after its base)
    assert [row.split(" & ")[0] for row in rows] == [METHODS[name] for name in order]
    lines = tex.splitlines()
    assert r" & \multicolumn{4}{c}{$\alpha = 0.1$} & \multicolumn{4}{c}{$\alpha = 0.5$} \\" in lines
    assert r"\cmidrule(lr){2-5} \cmidrule(lr){6-9}" in lines
    setting_columns = r"Mean $\pm$ std & Paper & $\Delta$ & vs FedAvg"
    assert f"Method & {setting_columns} & {setting_columns} " + r"\\" in lines
    assert [r"\toprule", r"\midrule", r"\bottomrule"] == [line for line in lines if line in (
        r"\toprule", r"\midrule", r"\bottomrule")]


def test_latex_cells_show_best_std_paper_and_paired_interval(tex):
    cells = {row.split(" & ")[0]: row.removesuffix(r" \\").split(" & ")[1:] for row in table_rows(tex)}
    fedavg, const, ctpfl = cells["FedAvg"], cells["FedAvg + CONST"], cells["CTP-FL h=0"]
    # alpha 0.1 first (the folders' order); cells do not count the same seeds everywhere: each says its n.
    assert fedavg[:4] == [r"$40.00 \pm 2.00$ (3)", "$40.50$", "$-0.50$", "baseline"]
    assert const[4] == r"$\mathbf{66.67 \pm 2.08}$ (3)" and const[5:7] == ["$66.00$", "$+0.67$"]  # best of its column
    # +6, +7, +7 points over FedAvg at alpha 0.5: the interval excludes 0 and is marked; CTP-FL's does not.
    low, high = direct_interval([6.0, 7.0, 7.0])
    assert const[7] == f"$+6.67$ [${low:+.2f}$, ${high:+.2f}$]$^{{*}}$"
    low, high = direct_interval([-10.0, -1.0, -18.0])
    assert low < 0 < high and ctpfl[7] == f"$-9.67$ [${low:+.2f}$, ${high:+.2f}$]"
    assert ctpfl[3] == "$-10.50$ (2 pairs; seed 2 unpaired)"
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


ENGINES = ("pdflatex", "lualatex", "xelatex", "tectonic")


@pytest.mark.slow
def test_latex_table_compiles_with_booktabs(tex, tmp_path):
    engine = next((shutil.which(name) for name in ENGINES if shutil.which(name)), None)
    if engine is None:
        pytest.skip(f"no LaTeX engine installed ({', '.join(ENGINES)})")
    folder = tmp_path / "latex"
    folder.mkdir()
    (folder / "table.tex").write_text(tex)
    (folder / "paper.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n"
                                      "\\input{table.tex}\n\\end{document}\n")
    arguments = ([engine, "paper.tex"] if Path(engine).name == "tectonic" else
                 [engine, "-interaction=nonstopmode", "-halt-on-error", "paper.tex"])
    done = subprocess.run(arguments, cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert (folder / "paper.pdf").stat().st_size > 0
    log = folder / "paper.log"
    if log.is_file():  # a character the fonts lack is only a warning in the log, and a hole in the table
        assert "Missing character" not in log.read_text(errors="replace")
