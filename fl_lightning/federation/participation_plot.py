"""The run's participation pattern as a picture (participation.png in the run folder): for each round and
client, whether it was offline, online but not drawn, drawn and reported, or drawn and its upload lost.
Drawn from the seeded draws alone (`round_clients`), before any round is trained."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fl_lightning.atomic_files import write_atomically
from fl_lightning.config import FederationArgs
from fl_lightning.federation.aggregation import round_clients

PARTICIPATION_PLOT = "participation.png"
PLOTTED_ROUNDS = 100
"""The most rounds the picture shows (its first ones): enough to see a pattern, small enough to read."""
OFFLINE, ONLINE, REPORTED, DROPPED = range(4)
STATE_NAMES = ("offline", "online, not drawn", "reported", "upload lost")
STATE_COLOURS = ("#ffffff", "#d9d9d9", "#3b6fb6", "#d1495b")


def participation_states(seed: int, federation: FederationArgs, rounds: int) -> np.ndarray:
    """(clients, rounds) array of each client's state in each of the first `rounds` rounds."""
    states = np.full((federation.num_clients, rounds), OFFLINE, dtype=np.int8)
    for round_index in range(rounds):
        taking_part = round_clients(seed, round_index, federation)
        states[taking_part.online, round_index] = ONLINE
        states[taking_part.reported, round_index] = REPORTED
        states[taking_part.dropped, round_index] = DROPPED
    return states


def plot_participation(seed: int, federation: FederationArgs, path: Path) -> None:
    """Saves the PNG of the run's first rounds (at most PLOTTED_ROUNDS), titled with its settings."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rounds = min(federation.rounds, PLOTTED_ROUNDS)
    states = participation_states(seed, federation, rounds)
    figure = Figure(figsize=(min(4 + rounds / 10, 14), min(2 + federation.num_clients / 10, 10)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colours = matplotlib.colors.ListedColormap(STATE_COLOURS)
    axes.imshow(states, aspect="auto", interpolation="nearest", cmap=colours, vmin=0, vmax=len(STATE_COLOURS) - 1,
                extent=(0.5, rounds + 0.5, federation.num_clients - 0.5, -0.5))
    axes.set_xlabel("round")
    axes.set_ylabel("client")
    name = type(federation.online_clients).__name__.lower()
    axes.set_title(f"participation: {name}, {federation.clients_per_round} drawn a round, "
                   f"dropout {federation.dropout:g}")
    axes.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=n) for c, n in zip(STATE_COLOURS, STATE_NAMES)],
                loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    figure.tight_layout()
    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
