"""The curves of a table (fl_lightning.experiments.results.plot): the mean curve and its band over seeds, the
figure `plot_curves` draws (read off the figure before it is saved), and the PNG it writes, read
back with PIL for its size, resolution and which panels hold anything."""

import statistics

import numpy as np
import pytest
from PIL import Image

from fl_lightning.experiments.results import plot
from fl_lightning.experiments.results.plot import mean_curve, plot_curves, save_laid_out
from fl_lightning.experiments.results.table_cells import Cell, Table

DPI = 120
WIDTH, HEIGHT = 5 * DPI, 3.8 * DPI
"""One panel's size in pixels."""


def curves_table(settings: list[str], curves: dict, **options) -> Table:
    methods = sorted({method for method, _ in curves})
    arguments = dict(metric="test_accuracy", at="final", methods=methods, settings=settings,
                     labels={setting: f"label of {setting}" for setting in settings},
                     cells={(m, s): Cell() for m in methods for s in settings},
                     curves={(m, s): curves.get((m, s), []) for m in methods for s in settings},
                     percent=True, decimals=2, reference=False)
    arguments.update(options)
    return Table(**arguments)


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_curves draws, kept as they are saved."""
    figures = []

    def keep(figure, path):
        figures.append(figure)
        save_laid_out(figure, path)

    monkeypatch.setattr(plot, "save_laid_out", keep)
    return figures


# The mean curve


def test_one_run_is_its_own_mean_with_a_band_of_no_width():
    runs = [[(1, 0.5), (2, 0.6)]]
    assert mean_curve(runs, "std") == ([1, 2], [0.5, 0.6], [0.5, 0.6], [0.5, 0.6])
    assert mean_curve(runs, "minmax") == ([1, 2], [0.5, 0.6], [0.5, 0.6], [0.5, 0.6])


def test_rounds_come_out_in_order_whatever_order_the_runs_give_them():
    runs = [[(4, 10.0), (2, 20.0)], [(2, 30.0), (6, 1.0), (4, 14.0)]]
    rounds, means, lower, upper = mean_curve(runs, "minmax")
    assert rounds == [2, 4, 6]
    assert means == pytest.approx([25.0, 12.0, 1.0])
    assert (lower, upper) == ([20.0, 10.0, 1.0], [30.0, 14.0, 1.0])


def test_the_std_band_is_the_sample_std_of_the_runs_at_each_round():
    values = [61.0, 64.0, 70.0, 65.0]
    runs = [[(3, value)] for value in values]
    mean = sum(values) / 4
    std = (sum((value - mean) ** 2 for value in values) / 3) ** 0.5
    _, means, lower, upper = mean_curve(runs, "std")
    assert means == pytest.approx([mean])
    assert lower == pytest.approx([mean - std]) and upper == pytest.approx([mean + std])


def test_no_runs_give_an_empty_curve():
    assert mean_curve([], "minmax") == ([], [], [], [])


# The figure


def test_each_setting_gets_a_panel_with_a_line_per_method_that_has_runs(tmp_path, drawn):
    curves = {("FedAvg", "a"): [[(2, 60.0), (4, 70.0)], [(2, 64.0), (4, 74.0)]],
              ("SCAFFOLD", "a"): [[(2, 50.0), (4, 80.0)]],
              ("FedAvg", "b"): [[(2, 40.0), (4, 45.0)]]}  # SCAFFOLD has no run at b
    plot_curves(curves_table(["a", "b"], curves), tmp_path / "plot.png")
    (figure,) = drawn
    first, second = figure.axes
    assert [first.get_title(), second.get_title()] == ["label of a", "label of b"]
    assert first.get_xlabel() == "round" and first.get_ylabel() == "test_accuracy (%)"
    assert [line.get_label() for line in first.get_lines()] == ["FedAvg (2)", "SCAFFOLD (1)"]
    assert [line.get_label() for line in second.get_lines()] == ["FedAvg (1)"]
    fedavg = first.get_lines()[0]
    assert list(fedavg.get_xdata()) == [2, 4]
    assert list(fedavg.get_ydata()) == pytest.approx([statistics.fmean([60, 64]), statistics.fmean([70, 74])])
    assert [text.get_text() for text in first.get_legend().get_texts()] == ["FedAvg (2)", "SCAFFOLD (1)"]


def test_the_title_names_the_band_and_a_variants_overrides(tmp_path, drawn):
    curves = {("FedAvg", "a"): [[(1, 0.5)]]}
    plot_curves(curves_table(["a"], curves, metric="test_loss", percent=False), tmp_path / "minmax.png")
    plot_curves(curves_table(["a"], curves, plan="demo-rounds8", overrides={"federation.rounds": 8}),
                tmp_path / "std.png", band="std")
    plain, variant = drawn
    assert plain.get_suptitle() == "test_loss: mean, band min–max over seeds"
    assert plain.axes[0].get_ylabel() == "test_loss"
    assert variant.get_suptitle() == ("test_accuracy: mean, band ± sample std over seeds\n"
                                      "demo-rounds8: federation.rounds=8")


def test_a_panel_without_any_run_has_no_legend(tmp_path, drawn):
    plot_curves(curves_table(["a", "b"], {("FedAvg", "a"): [[(1, 0.5)]]}), tmp_path / "plot.png")
    first, second = drawn[0].axes
    assert first.get_legend() is not None
    assert second.get_legend() is None and second.get_lines() == []


# The PNG


def test_the_png_is_three_panels_wide_at_120_dpi(tmp_path):
    curves = {("FedAvg", setting): [[(1, 0.4), (2, 0.6)]] for setting in "abcd"}
    path = tmp_path / "plot.png"
    plot_curves(curves_table(list("abcd"), curves), path)
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG"
        # Four panels: two rows of three.
        assert image.size == (round(3 * WIDTH), round(2 * HEIGHT))
        assert image.info["dpi"] == pytest.approx((DPI, DPI), abs=0.1)
        pixels = np.asarray(image.convert("RGB"))
    # The two unused places of the grid are hidden: blank, where a drawn panel is not.
    height, width = pixels.shape[:2]
    hidden = pixels[int(0.6 * height):, int(0.70 * width):]
    drawn_panel = pixels[int(0.6 * height):, :int(0.30 * width)]
    assert (hidden == 255).all()
    assert (drawn_panel != 255).any()


@pytest.mark.parametrize("panels, columns, rows", [(1, 1, 1), (2, 2, 1), (7, 3, 3)])
def test_the_png_grows_with_the_panels(tmp_path, panels, columns, rows):
    settings = [f"s{index}" for index in range(panels)]
    path = tmp_path / "plot.png"
    plot_curves(curves_table(settings, {("FedAvg", settings[0]): [[(1, 0.5)]]}), path)
    with Image.open(path) as image:
        assert image.size == (round(columns * WIDTH), round(rows * HEIGHT))
