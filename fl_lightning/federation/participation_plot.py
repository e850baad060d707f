"""The run's participation pattern as a picture (participation.png in the run folder): for each round and
client, whether it was offline, online but not drawn, drawn and reported, or drawn and its upload lost.
Drawn from the seeded draws alone (`round_clients`), before any round is trained."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fl_lightning.atomic_files import write_atomically
from fl_lightning.config import FederationArgs
from fl_lightning.data.partition import PLOTTED_CLIENTS, describe_clients
from fl_lightning.federation.aggregation import round_clients

PARTICIPATION_PLOT = "participation.png"
PLOTTED_ROUNDS = 100
"""The most rounds the picture shows (its first ones): enough to see a pattern, small enough to read."""
OFFLINE, ONLINE, REPORTED, DROPPED = range(4)
STATE_NAMES = ("offline", "online, not drawn", "reported", "upload lost")
STATE_COLOURS = ("#ffffff", "#d9d9d9", "#3b6fb6", "#d1495b")


def participation_states(seed: int, federation: FederationArgs, rounds: int) -> np.ndarray:
    """(clients, rounds) array of the state of each of the first PLOTTED_CLIENTS clients in each of the
    first `rounds` rounds."""
    shown = min(federation.num_clients, PLOTTED_CLIENTS)
    states = np.full((shown, rounds), OFFLINE, dtype=np.int8)
    for round_index in range(rounds):
        taking_part = round_clients(seed, round_index, federation)
        states[_below(taking_part.online, shown), round_index] = ONLINE
        states[_below(taking_part.reported, shown), round_index] = REPORTED
        states[_below(taking_part.dropped, shown), round_index] = DROPPED
    return states


def _below(clients: Sequence[int], bound: int) -> Sequence[int]:
    """The clients below `bound`; of a range (uniform participation's every client online), the range's
    prefix, without going through a million clients one by one."""
    if isinstance(clients, range) and clients.step > 0:
        return clients[:len(range(clients.start, bound, clients.step))]
    return [client for client in clients if client < bound]


def plot_participation(seed: int, federation: FederationArgs, path: Path) -> None:
    """Saves the PNG of `participation_figure`."""
    figure = participation_figure(seed, federation)
    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))


def participation_figure(seed: int, federation: FederationArgs):
    """The matplotlib Figure of the run's first rounds (at most PLOTTED_ROUNDS) and first clients (at most
    PLOTTED_CLIENTS), titled with its settings and, where clients are left out, the ones it shows."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rounds = min(federation.rounds, PLOTTED_ROUNDS)
    states = participation_states(seed, federation, rounds)
    shown = len(states)
    figure = Figure(figsize=(min(4 + rounds / 10, 14), min(2 + shown / 10, 10)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colours = matplotlib.colors.ListedColormap(STATE_COLOURS)
    axes.imshow(states, aspect="auto", interpolation="nearest", cmap=colours, vmin=0, vmax=len(STATE_COLOURS) - 1,
                extent=(0.5, rounds + 0.5, shown - 0.5, -0.5))
    axes.set_xlabel("round")
    axes.set_ylabel("client")
    name = type(federation.online_clients).__name__.lower()
    title = f"participation: {name}, {federation.clients_per_round} drawn a round, dropout {federation.dropout:g}"
    if shown < federation.num_clients:
        title += f"\n{describe_clients(shown, federation.num_clients)}"
    axes.set_title(title)
    axes.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=n) for c, n in zip(STATE_COLOURS, STATE_NAMES)],
                loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    figure.tight_layout()
    return figure
