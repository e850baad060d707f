"""Splitting a training set over clients (iid, label shards, Dirichlet label skew), holding out part of
each client's samples for validation, and every client's samples in two arrays (`ClientSamples`)."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import numbers
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import get_args

import numpy as np

from fl_lightning.atomic_files import write_atomically
from fl_lightning.choices import PartitionScheme
from fl_lightning.errors import ConfigError

PARTITION_SCHEMES = get_args(PartitionScheme)


class ClientSamples:
    """Every client's sample indices, immutable, in two arrays whatever the number of clients: `indices`,
    all clients' indices one client after the other, and `offsets`, where each client's run of them
    begins (client i's are indices[offsets[i]:offsets[i + 1]]); both int32 where they fit, as for any
    dataset held in memory (half the bytes of int64). Indexed and iterated as a sequence of numpy arrays
    (`samples[i]` is a read-only view of client i's indices), but not a `collections.abc.Sequence`:
    what walks collections item by item (Fabric's launcher, on the arguments of the ranks it spawns)
    takes it whole, rather than rebuilding it from a million arrays. A list of a numpy array a client
    costs about a hundred bytes a client beside the indices themselves: a hundred MiB at a million
    clients.
    """

    __slots__ = ("indices", "offsets", "_digest")

    def __init__(self, indices: np.ndarray, offsets: np.ndarray):
        """Copies of `indices` and `offsets` (offsets[0] = 0, never decreasing, offsets[-1] = len(indices))."""
        self.indices, self.offsets = _read_only(indices), _read_only(offsets)
        if (self.indices.ndim != 1 or self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[0] != 0
                or self.offsets[-1] != len(self.indices) or np.any(np.diff(self.offsets) < 0)):
            raise ValueError(f"offsets of {len(self.indices)} indices must run from 0 to {len(self.indices)} and "
                             f"never decrease, got {len(self.offsets)} offsets")
        self._digest = None

    @classmethod
    def of(cls, parts: Iterable) -> ClientSamples:
        """`parts` (each client's indices: arrays, tensors or lists) as ClientSamples; ClientSamples
        themselves unchanged."""
        if isinstance(parts, cls):
            return parts
        arrays = [np.asarray(part, dtype=np.int64).reshape(-1) for part in parts]
        sizes = np.array([len(array) for array in arrays], dtype=np.int64)
        return cls(np.concatenate([np.empty(0, dtype=np.int64), *arrays]), np.concatenate([[0], np.cumsum(sizes)]))

    @property
    def sizes(self) -> np.ndarray:
        """Each client's number of samples."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, client: int) -> np.ndarray:
        if not isinstance(client, numbers.Integral):
            raise TypeError(f"a client's index is an integer, got {type(client).__name__}")
        if not -len(self) <= client < len(self):
            raise IndexError(f"client {client} of {len(self)}")
        client = int(client) % len(self)
        return self.indices[self.offsets[client]:self.offsets[client + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.indices[start:end] for start, end in zip(self.offsets[:-1], self.offsets[1:]))

    def first(self, count: int) -> ClientSamples:
        """The first `count` clients' samples (every client's when there are fewer): copies of the arrays'
        prefixes, as cheap as those clients are few however many the federation has."""
        if count < 0:
            raise ValueError(f"a number of clients is >= 0, got {count}")
        count = min(count, len(self))
        return type(self)(self.indices[:self.offsets[count]], self.offsets[:count + 1])

    def __reduce__(self):
        # Through __init__: unpickled arrays would be writable again.
        return type(self), (self.indices, self.offsets)

    def digest(self) -> str:
        """SHA-256 of the clients' number, their offsets and their indices: equal digests, equal samples
        client by client. What a checkpoint records of them (computed once: every checkpoint asks)."""
        if self._digest is None:
            digest = hashlib.sha256(f"{len(self)} clients, {len(self.indices)} indices;".encode())
            for array in (self.offsets, self.indices):
                for start in range(0, len(array), _DIGEST_CHUNK):  # as int64 whatever the dtype held
                    digest.update(np.ascontiguousarray(array[start:start + _DIGEST_CHUNK], dtype="<i8"))
            self._digest = digest.hexdigest()
        return self._digest

    def json_pieces(self) -> Iterator[str]:
        """The text json.dumps writes of {"<client>": [its indices], ...}, a client a piece: a million
        clients' lists are never in memory at once."""
        yield "{"
        for client, part in enumerate(self):
            yield f'{", " if client else ""}"{client}": {json.dumps(part.tolist())}'
        yield "}"


_DIGEST_CHUNK = 2**20


def _read_only(values) -> np.ndarray:
    """A read-only copy of `values`, as int32 where they fit (half the bytes of int64)."""
    array = np.asarray(values)
    fits = array.size == 0 or (array.min() >= 0 and array.max() <= np.iinfo(np.int32).max)
    array = np.array(array, dtype=np.int32 if fits else np.int64)
    array.flags.writeable = False
    return array


def partition_indices(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    *,
    alpha: float = 0.5,
    min_samples: int = 10,
    shards_per_client: int = 2,
    seed: int = 0,
) -> list[np.ndarray]:
    """Sorted int64 sample indices per client; disjoint, together covering every sample.

    - "iid": a random split into near-equal parts.
    - "shards": samples sorted by label are cut into num_clients * shards_per_client shards of
      near-equal size; each client gets shards_per_client of them at random.
    - "dirichlet": see `_dirichlet_owners`.

    The same arguments give the same partition.
    """
    if scheme not in PARTITION_SCHEMES:
        raise ConfigError("data.partition", f"one of {', '.join(PARTITION_SCHEMES)}", scheme)
    labels = np.asarray(labels)
    num_samples = len(labels)
    if not 1 <= num_clients <= num_samples:
        raise ConfigError(
            "federation.num_clients", f"an integer from 1 to the number of training samples ({num_samples})",
            num_clients,
        )
    rng = np.random.default_rng(seed)

    if scheme == "iid":
        parts = np.array_split(rng.permutation(num_samples), num_clients)
    elif scheme == "shards":
        num_shards = num_clients * shards_per_client
        if not 1 <= num_shards <= num_samples:
            raise ConfigError(
                "data.shards_per_client",
                f"an integer from 1 to {num_samples // num_clients} (training samples / federation.num_clients)",
                shards_per_client,
            )
        shuffled = rng.permutation(num_samples)  # so each shard takes a random subset of its class
        by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
        shards = np.array_split(by_label, num_shards)
        shard_ids = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
        parts = [np.concatenate([shards[shard] for shard in client_shards]) for client_shards in shard_ids]
    else:
        parts = _parts_from_owners(_dirichlet_owners(labels, num_clients, alpha, min_samples, rng), num_clients)
    return [np.sort(part).astype(np.int64) for part in parts]


def _dirichlet_owners(
    labels: np.ndarray, num_clients: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> np.ndarray:
    """The client of every sample under Dirichlet label skew (NIID-bench, Li et al. 2022).

    For each class, proportions over clients are drawn from Dir(alpha * 1) and the class's shuffled
    samples are cut accordingly; as in NIID-bench, clients that already hold more than
    num_samples / num_clients samples get no share of later classes.

    NIID-bench redraws everything until every client has min_samples, which for many clients and a
    small alpha (1000 clients, CIFAR-100, alpha 0.05) practically never happens. Here the partition
    is drawn once, and clients short of min_samples are then topped up with random samples taken
    from the currently largest clients, lowering those no further than needed. This always
    finishes when num_clients * min_samples <= num_samples, and is otherwise an error.
    """
    if not (np.isfinite(alpha) and alpha > 0):
        raise ConfigError("data.alpha", "a finite value > 0", alpha)
    num_samples = len(labels)
    if num_clients * min_samples > num_samples:
        raise ConfigError(
            "data.min_samples",
            f"at most {num_samples // num_clients} (training samples / federation.num_clients)",
            min_samples,
        )

    owners = np.empty(num_samples, dtype=np.int64)
    counts = np.zeros(num_clients, dtype=np.int64)
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        below_average = counts < num_samples / num_clients  # never empty: the counts sum to < num_samples
        proportions = proportions * below_average
        total = proportions.sum()
        # With a tiny alpha every open client's share can underflow to exactly zero.
        proportions = proportions / total if total > 0 else below_average / below_average.sum()
        cuts = (np.cumsum(proportions) * len(members)).astype(np.int64)[:-1]
        class_owners = np.searchsorted(cuts, np.arange(len(members)), side="right")
        owners[members] = class_owners
        counts += np.bincount(class_owners, minlength=num_clients)

    _top_up(owners, counts, min_samples, rng)
    return owners


def _top_up(owners: np.ndarray, counts: np.ndarray, min_samples: int, rng: np.random.Generator) -> None:
    """Moves samples from the largest clients to those below min_samples, in place."""
    deficits = np.maximum(min_samples - counts, 0)
    needed = int(deficits.sum())
    if needed == 0:
        return

    # Water-filling: lower every client above `level` to it, where `level` is the highest integer
    # at which that frees enough samples. Since the counts sum to at least num_clients *
    # min_samples, level >= min_samples, so no donor falls short and no short client donates.
    def freed_at(level: int) -> int:
        return int(np.maximum(counts - level, 0).sum())

    low, high = 0, int(counts.max())  # freed_at(low) >= needed > freed_at(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if freed_at(middle) >= needed else (low, middle)
    takes = np.maximum(counts - low, 0)
    # Lowering to `low` frees a little too much; clients above `low` each keep one back until exact.
    surplus = int(takes.sum()) - needed
    above_level = np.flatnonzero(takes > 0)
    takes[rng.choice(above_level, size=surplus, replace=False)] -= 1

    # A random rank within each client picks which of its samples move.
    order = np.lexsort((rng.random(len(owners)), owners))
    sorted_owners = owners[order]
    first_of_client = np.concatenate([[0], np.cumsum(np.bincount(owners, minlength=len(counts)))[:-1]])
    rank = np.arange(len(owners)) - first_of_client[sorted_owners]
    moved = rng.permutation(order[rank < takes[sorted_owners]])
    owners[moved] = np.repeat(np.arange(len(counts)), deficits)
    counts -= takes
    counts += deficits


def _parts_from_owners(owners: np.ndarray, num_clients: int) -> list[np.ndarray]:
    order = np.argsort(owners, kind="stable")
    return np.split(order, np.cumsum(np.bincount(owners, minlength=num_clients))[:-1])


VALIDATION_STREAM = 1
"""Seeds the validation draw apart from the partition's (which seed alone seeds)."""


def hold_out_validation(parts: list[np.ndarray], fraction: float, seed: int
                        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(training, validation) sorted indices per client: round(fraction * n_i) of client i's n_i
    samples, at least one, drawn at random from its own samples and held out from its training.

    Each client's draw is seeded by (seed, client) alone, so it does not depend on the other clients.
    """
    if not 0 < fraction < 1:
        raise ConfigError("data.validation", "a fraction in (0, 1)", fraction)
    training, validation = [], []
    for client, part in enumerate(parts):
        held_out = max(1, round(fraction * len(part)))
        if held_out >= len(part):
            raise ConfigError("data.validation", f"a fraction that leaves every client a training sample (client "
                              f"{client} holds {len(part)} sample(s); data.min_samples sets the fewest a client gets)",
                              fraction)
        order = np.random.default_rng([seed, VALIDATION_STREAM, client]).permutation(len(part))
        validation.append(np.sort(part[order[:held_out]]).astype(np.int64))
        training.append(np.sort(part[order[held_out:]]).astype(np.int64))
    return training, validation


def class_histogram(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Counts [num_clients, num_classes]: how many samples of each class every client holds."""
    samples = ClientSamples.of(parts)
    clients = np.repeat(np.arange(len(samples)), samples.sizes)
    cells = clients * num_classes + np.asarray(labels)[samples.indices]
    return np.bincount(cells, minlength=len(samples) * num_classes).reshape(len(samples), num_classes)


def describe_split(scheme: str, alpha: float, shards_per_client: int) -> str:
    """The split's kind with its parameter, as a plot's title says it: `dirichlet, α = 0.5`, `shards, 2 per
    client`, `iid`."""
    if scheme == "dirichlet":
        return f"dirichlet, α = {alpha:g}"
    if scheme == "shards":
        return f"shards, {shards_per_client} per client"
    return scheme


PLOTTED_CLIENTS = 1000
"""The most clients a run's pictures show (partition.png, participation.png), the first ones: what drawing
them costs stays the same however many clients the federation has (a million clients' class counts alone
are 80 MB, and a million bars could not be told apart)."""


def describe_clients(shown: int, num_clients: int) -> str:
    """The clients a picture shows, as its title says them: `12 clients`, or where it leaves clients out,
    `clients 0-999 of 1,000,000`."""
    return f"{num_clients} clients" if shown == num_clients else f"clients 0-{shown - 1} of {num_clients:,}"


def plot_partition(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int, path: Path, split: str) -> None:
    """Saves a PNG with one horizontal bar per client (the first PLOTTED_CLIENTS), stacked by class, titled
    with `split` (`describe_split`), the classes' colours in a legend (a colour bar past LEGEND_CLASSES
    classes). Only the plotted clients' samples are counted."""
    samples = ClientSamples.of(parts)
    histogram = class_histogram(labels, samples.first(PLOTTED_CLIENTS), num_classes).astype(np.int64, copy=False)
    png = _partition_png(histogram.shape, histogram.tobytes(), split, len(samples))
    # Whole or not at all: a resumed run keeps the plot it finds (fl_lightning.fit).
    write_atomically(path, lambda file: file.write(png))


LEGEND_CLASSES = 20
"""The most classes a legend lists, one entry each; more get a colour bar of the class index."""
LEGEND_WIDTH = 1.3
"""Inches right of the axes, for the legend or the colour bar."""


# Runs of one process on one split (the methods of a comparison at one seed, from a script or a
# notebook) draw its figure once: drawing it takes longer than a small run's round.
@functools.lru_cache(maxsize=8)
def _partition_png(shape: tuple[int, int], counts: bytes, split: str, num_clients: int) -> bytes:
    figure = partition_figure(np.frombuffer(counts, dtype=np.int64).reshape(shape), split, num_clients)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    return png.getvalue()


def partition_figure(histogram: np.ndarray, split: str, num_clients: int | None = None):
    """The matplotlib Figure of `plot_partition`: `histogram` holds the class counts of the first of
    `num_clients` clients (default: of every client)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    shown, num_classes = histogram.shape
    num_clients = shown if num_clients is None else num_clients
    # One collection of rectangles instead of a bar per client and class: a thousand clients of a
    # hundred classes would otherwise be 100,000 artists.
    right = np.cumsum(histogram, axis=1)
    left = right - histogram
    client, label = np.nonzero(histogram)
    bottom, top = client - 0.4, client + 0.4
    x0, x1 = left[client, label], right[client, label]
    rectangles = np.stack(
        [np.stack([x0, bottom], 1), np.stack([x1, bottom], 1), np.stack([x1, top], 1), np.stack([x0, top], 1)], 1
    )

    width, height = 8 + LEGEND_WIDTH, min(2 + 0.25 * shown, 20)
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)  # attaches itself; renders without pyplot's global state
    axes = figure.add_subplot()
    colormap = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20" if num_classes <= 20 else "turbo"]

    def colour(classes):
        return colormap(classes % colormap.N if num_classes <= 20 else classes / max(num_classes - 1, 1))

    axes.add_collection(PolyCollection(rectangles, facecolors=colour(label), linewidths=0))
    axes.set_xlim(0, max(int(right[:, -1].max()), 1))
    axes.set_ylim(shown - 0.5, -0.5)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("training samples")
    axes.set_ylabel("client")
    # y given: the title sits just above the axes, where nothing else is drawn, instead of where
    # matplotlib would place it after measuring the tick labels under it.
    axes.set_title(f"{describe_clients(shown, num_clients)}, {num_classes} classes ({split})", y=1.0)
    # Fixed margins in inches (room for the labels, up to five-digit ticks and the legend): tight_layout
    # would draw the figure once more to measure them.
    figure.subplots_adjust(left=0.9 / width, right=1 - (0.2 + LEGEND_WIDTH) / width, bottom=0.6 / height,
                           top=1 - 0.4 / height)
    _class_key(figure, axes, colormap, colour, num_classes)
    return figure


def _class_key(figure, axes, colormap, colour, num_classes: int) -> None:
    """Which colour is which class: a legend of the classes, or past LEGEND_CLASSES a colour bar."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.patches import Patch

    if num_classes <= LEGEND_CLASSES:
        handles = [Patch(facecolor=colour(np.array(k)), label=f"class {k}") for k in range(num_classes)]
        axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                    fontsize="small", frameon=False)
    else:
        box, inch = axes.get_position(), 1 / figure.get_figwidth()
        bar = figure.add_axes((box.x1 + 0.15 * inch, box.y0, 0.2 * inch, box.height))
        figure.colorbar(ScalarMappable(norm=Normalize(0, num_classes - 1), cmap=colormap), cax=bar, label="class")
