import hashlib
import json
import pickle
import tracemalloc

import numpy as np
import pytest

from fl_lightning.data import ClientSamples, class_histogram, partition, partition_indices, plot_partition
from fl_lightning.data.partition import PLOTTED_CLIENTS, describe_clients, describe_split
from fl_lightning.errors import ConfigError


@pytest.fixture
def labels():
    """2,000 samples of 10 equally frequent classes, in random order."""
    return np.random.default_rng(7).permutation(np.repeat(np.arange(10), 200))


def assert_is_partition(parts, num_samples):
    assert all(part.dtype == np.int64 and np.all(np.diff(part) > 0) for part in parts)
    together = np.concatenate(parts)
    assert len(together) == num_samples
    assert np.array_equal(np.sort(together), np.arange(num_samples))


def mean_largest_class_share(labels, parts):
    histogram = class_histogram(labels, parts, 10)
    return float((histogram.max(1) / histogram.sum(1)).mean())


def test_dirichlet_partitions_every_sample_once(labels):
    parts = partition_indices(labels, 30, "dirichlet", alpha=0.5, seed=1)
    assert len(parts) == 30
    assert_is_partition(parts, len(labels))


def test_dirichlet_tops_up_clients_below_min_samples(labels):
    without_minimum = partition_indices(labels, 100, "dirichlet", alpha=0.05, min_samples=0, seed=2)
    assert min(len(part) for part in without_minimum) < 15  # so the top-up below has work to do

    parts = partition_indices(labels, 100, "dirichlet", alpha=0.05, min_samples=15, seed=2)
    assert min(len(part) for part in parts) >= 15
    assert_is_partition(parts, len(labels))


def test_dirichlet_min_samples_can_be_exactly_feasible(labels):
    parts = partition_indices(labels, 100, "dirichlet", alpha=0.05, min_samples=20, seed=0)
    assert [len(part) for part in parts] == [20] * 100
    assert_is_partition(parts, len(labels))


def test_dirichlet_same_seed_same_partition_other_seed_differs(labels):
    first = partition_indices(labels, 20, "dirichlet", alpha=0.3, seed=5)
    again = partition_indices(labels, 20, "dirichlet", alpha=0.3, seed=5)
    other = partition_indices(labels, 20, "dirichlet", alpha=0.3, seed=6)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_small_alpha_skews_labels(labels):
    skewed = partition_indices(labels, 10, "dirichlet", alpha=0.05, min_samples=0)
    near_iid = partition_indices(labels, 10, "dirichlet", alpha=1000.0, min_samples=0)
    iid = partition_indices(labels, 10, "iid")
    assert mean_largest_class_share(labels, skewed) > 0.6
    assert mean_largest_class_share(labels, near_iid) < 0.2
    assert mean_largest_class_share(labels, iid) < 0.2


def test_dirichlet_thousand_clients_on_cifar100_sized_labels():
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(100), 500))
    parts = partition_indices(labels, 1000, "dirichlet", alpha=0.05, min_samples=10, seed=0)
    assert len(parts) == 1000
    assert min(len(part) for part in parts) >= 10
    assert_is_partition(parts, len(labels))


@pytest.mark.parametrize(
    "num_clients, scheme, options, field_name",
    [
        (10, "dirichlet", {"alpha": 0.0}, "data.alpha"),
        (10, "dirichlet", {"alpha": -1.0}, "data.alpha"),
        (10, "dirichlet", {"alpha": float("nan")}, "data.alpha"),
        (100, "dirichlet", {"min_samples": 21}, "data.min_samples"),
        (2001, "iid", {}, "federation.num_clients"),
        (0, "iid", {}, "federation.num_clients"),
        (100, "shards", {"shards_per_client": 21}, "data.shards_per_client"),
        (10, "pathological", {}, "data.partition"),
    ],
)
def test_infeasible_requests_name_their_setting(labels, num_clients, scheme, options, field_name):
    with pytest.raises(ConfigError) as caught:
        partition_indices(labels, num_clients, scheme, **options)
    assert caught.value.field_name == field_name
    assert str(caught.value).startswith(field_name)


def test_iid_splits_evenly(labels):
    parts = partition_indices(labels, 7, "iid", seed=3)
    assert_is_partition(parts, len(labels))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1


def test_shards_give_each_client_its_shards_labels(labels):
    # 10 classes x 200 samples in 40 shards of 50: no shard straddles two classes.
    parts = partition_indices(labels, 20, "shards", shards_per_client=2, seed=4)
    assert_is_partition(parts, len(labels))
    histogram = class_histogram(labels, parts, 10)
    assert ((histogram > 0).sum(1) <= 2).all()
    assert histogram.sum(1).tolist() == [100] * 20


def test_shards_with_uneven_classes_still_partition():
    labels = np.random.default_rng(0).integers(0, 10, 1003)
    parts = partition_indices(labels, 17, "shards", shards_per_client=3, seed=1)
    assert_is_partition(parts, len(labels))
    histogram = class_histogram(labels, parts, 10)
    assert ((histogram > 0).sum(1) <= 2 * 3).all()


def test_class_histogram_counts_per_client():
    labels = np.array([0, 1, 1, 2, 2, 2])
    parts = [np.array([0, 3]), np.array([1, 2, 4, 5]), np.array([], dtype=np.int64)]
    assert class_histogram(labels, parts, 4).tolist() == [[1, 0, 1, 0], [0, 2, 2, 0], [0, 0, 0, 0]]


def split_of(histogram):
    """Labels, and clients' samples, whose class histogram is `histogram`."""
    num_clients, num_classes = histogram.shape
    labels = np.repeat(np.tile(np.arange(num_classes), num_clients), histogram.ravel())
    return labels, ClientSamples(np.arange(len(labels)), np.concatenate([[0], np.cumsum(histogram.sum(1))]))


def test_plot_partition_writes_a_png(labels, tmp_path):
    parts = partition_indices(labels, 12, "dirichlet", alpha=0.5)
    path = tmp_path / "partition.png"
    plot_partition(labels, parts, 10, path, "dirichlet, α = 0.5")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_a_split_plotted_again_gets_the_figure_a_fresh_draw_gives(labels, tmp_path, monkeypatch):
    """The figure of a split is drawn once per process: again it is the same PNG, and another
    split, even one of the same counts in another shape or the same plotted clients of a larger
    federation, gets its own."""
    monkeypatch.setattr(partition, "PLOTTED_CLIENTS", 12)
    histogram = class_histogram(labels, partition_indices(labels, 12, "dirichlet", alpha=0.5), 10)
    figures = {}
    for name, counts in [("first", histogram), ("again", histogram.copy()), ("other shape", histogram.reshape(10, 12)),
                         ("other split", histogram[::-1]), ("one client more", np.vstack([histogram, histogram[:1]]))]:
        plot_partition(*split_of(counts), counts.shape[1], tmp_path / f"{name}.png", "dirichlet, α = 0.5")
        figures[name] = (tmp_path / f"{name}.png").read_bytes()
    partition._partition_png.cache_clear()
    plot_partition(*split_of(histogram), 10, tmp_path / "drawn.png", "dirichlet, α = 0.5")
    assert figures["first"] == figures["again"] == (tmp_path / "drawn.png").read_bytes()
    assert len({figures[name] for name in ("first", "other shape", "other split", "one client more")}) == 4


def test_a_partition_plot_of_100000_clients_counts_and_draws_the_first_thousand_only(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 4, 100_000))])
    samples, labels = ClientSamples(rng.permutation(offsets[-1]), offsets), rng.integers(0, 10, offsets[-1])
    drawn = []
    monkeypatch.setattr(partition, "_partition_png", lambda *figure: drawn.append(figure) or b"png")
    tracemalloc.start()
    try:
        plot_partition(labels, samples, 10, tmp_path / "partition.png", "iid")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20  # the class counts of every client alone are 8 MB

    (shape, counts, split, num_clients), = drawn
    expected = np.zeros((PLOTTED_CLIENTS, 10), dtype=np.int64)
    for client in range(PLOTTED_CLIENTS):
        for sample in range(offsets[client], offsets[client + 1]):
            expected[client, labels[samples.indices[sample]]] += 1
    assert np.array_equal(np.frombuffer(counts, dtype=np.int64).reshape(shape), expected)
    (axes,) = partition.partition_figure(expected, split, num_clients).axes
    assert axes.get_title() == "clients 0-999 of 100,000, 10 classes (iid)"
    assert axes.get_ylim() == (PLOTTED_CLIENTS - 0.5, -0.5)


def test_a_title_names_every_client_or_the_first_ones_of_how_many():
    assert describe_clients(12, 12) == "12 clients"
    assert describe_clients(1000, 1000) == "1000 clients"
    assert describe_clients(1000, 1_000_000) == "clients 0-999 of 1,000,000"


@pytest.mark.parametrize("scheme, split", [("dirichlet", "dirichlet, α = 0.3"), ("shards", "shards, 2 per client"),
                                           ("iid", "iid")])
def test_the_plot_names_the_split_and_has_a_legend_of_the_classes(labels, scheme, split):
    histogram = class_histogram(labels, partition_indices(labels, 12, scheme, alpha=0.3), 10)
    assert describe_split(scheme, alpha=0.3, shards_per_client=2) == split
    (axes,) = partition.partition_figure(histogram, split).axes
    assert axes.get_title() == f"12 clients, 10 classes ({split})"
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [f"class {k}" for k in range(10)]
    colours = [tuple(patch.get_facecolor()) for patch in axes.get_legend().get_patches()]
    assert len(set(colours)) == 10


def test_past_twenty_classes_a_colour_bar_stands_for_the_legend():
    histogram = np.ones((4, 100), dtype=np.int64)
    axes, bar = partition.partition_figure(histogram, "iid").axes
    assert axes.get_legend() is None
    assert bar.get_ylabel() == "class" and bar.get_ylim() == (0, 99)


# --- every client's samples in two arrays ---------------------------------------------------------------

PARTS = [np.array([4, 9, 2]), np.array([], dtype=np.int64), np.array([7]), np.array([0, 5])]


def test_client_samples_are_each_clients_indices_as_read_only_views_of_one_array():
    samples = ClientSamples.of(PARTS)
    assert len(samples) == 4 and samples.sizes.tolist() == [3, 0, 1, 2]
    assert [part.tolist() for part in samples] == [part.tolist() for part in PARTS]
    assert [samples[client].tolist() for client in range(-4, 4)] == [part.tolist() for part in PARTS * 2]
    assert all(part.dtype == np.int32 and not part.flags.writeable for part in samples)  # int32: they fit
    assert all(np.shares_memory(part, samples.indices) for part in samples if len(part))
    with pytest.raises(ValueError, match="read-only"):
        samples[0][0] = 1
    with pytest.raises(IndexError):
        samples[4]
    assert ClientSamples.of(samples) is samples
    copied = pickle.loads(pickle.dumps(samples))  # as spawned ranks receive them
    assert [part.tolist() for part in copied] == [part.tolist() for part in PARTS] and not copied[0].flags.writeable


def test_the_first_clients_samples_are_copies_of_the_prefixes_of_both_arrays():
    samples = ClientSamples.of(PARTS)
    for count in range(6):
        first = samples.first(count)
        assert [part.tolist() for part in first] == [part.tolist() for part in PARTS[:count]]
        assert not np.shares_memory(first.indices, samples.indices) and not first.indices.flags.writeable
    with pytest.raises(ValueError, match="got -1"):
        samples.first(-1)


def test_client_samples_copy_what_they_are_given_and_refuse_offsets_that_do_not_cover_it():
    indices, offsets = np.array([4, 9, 2, 7, 0, 5]), np.array([0, 3, 3, 4, 6])
    samples = ClientSamples(indices, offsets)
    indices[0] = 8
    assert samples[0].tolist() == [4, 9, 2] and ClientSamples.of([]).sizes.tolist() == []
    for wrong in ([1, 3, 6], [0, 3, 5], [0, 4, 3, 6], []):
        with pytest.raises(ValueError, match="offsets of 6 indices"):
            ClientSamples(indices, wrong)


def test_the_digest_is_of_the_offsets_and_indices_as_int64_whatever_the_dtype_held():
    wide = [np.array([2**31, 3]), np.array([1])]  # past int32: held as int64
    for parts in (PARTS, wide):
        samples = ClientSamples.of(parts)
        assert samples.indices.dtype == (np.int32 if parts is PARTS else np.int64)
        offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts])])
        indices = np.concatenate(parts)
        expected = hashlib.sha256(f"{len(parts)} clients, {len(indices)} indices;".encode())
        expected.update(offsets.astype("<i8").tobytes())
        expected.update(indices.astype("<i8").tobytes())
        assert samples.digest() == expected.hexdigest()


def test_equal_samples_have_one_digest_and_any_change_another():
    samples = ClientSamples.of(PARTS)
    assert samples.digest() == ClientSamples(np.concatenate(PARTS), [0, 3, 3, 4, 6]).digest()
    assert samples.digest() == ClientSamples.of([part.tolist() for part in PARTS]).digest()  # lists, as JSON has them
    changed = {
        "a sample moved to the next client (the same indices one after the other)": [[4, 9], [2], [7], [0, 5]],
        "an index changed": [[4, 9, 3], [], [7], [0, 5]],
        "a client's order": [[2, 4, 9], [], [7], [0, 5]],
        "an empty client more": [[4, 9, 2], [], [7], [0, 5], []],
        "clients swapped": [[4, 9, 2], [7], [], [0, 5]],
    }
    digests = {samples.digest(), *(ClientSamples.of(parts).digest() for parts in changed.values())}
    assert len(digests) == 1 + len(changed)


def test_the_json_pieces_are_the_text_json_dumps_writes_of_every_clients_list(labels):
    for parts in (PARTS, partition_indices(labels, 30, "dirichlet", alpha=0.5, seed=1), []):
        pieces = list(ClientSamples.of(parts).json_pieces())
        assert "".join(pieces) == json.dumps({str(i): part.tolist() for i, part in enumerate(parts)})
        assert len(pieces) == len(parts) + 2  # a client a piece, never every client's list at once


def test_the_class_histogram_of_client_samples_counts_each_clients_samples_by_class(labels):
    parts = partition_indices(labels, 12, "shards", seed=2)
    expected = np.zeros((12, 10), dtype=np.int64)
    for client, part in enumerate(parts):
        for sample in part:
            expected[client, labels[sample]] += 1
    assert np.array_equal(class_histogram(labels, ClientSamples.of(parts), 10), expected)
    assert np.array_equal(class_histogram(labels, parts, 10), expected)
