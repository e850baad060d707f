"""The synthetic datasets, written in the real on-disk formats: CIFAR-10's and CIFAR-100's pickled batches
(their files, keys, batch sizes, file names and balanced labels), Tiny-ImageNet's folders of JPEGs and text
files, and the archives they are published as; the same seed writes the same bytes."""

import os
import pickle
import tarfile
import zipfile
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from fl_lightning.data import generate, load_dataset
from fl_lightning.data.generate import write_archive, write_cifar, write_tiny_imagenet

CIFAR10_FILES = ["batches.meta", "data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
                 "test_batch"]


def unpickle(path) -> dict:
    # As CIFAR's own instructions read the files (they were pickled by Python 2).
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def all_files(folder) -> dict:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def test_cifar10_is_five_training_batches_a_test_batch_and_the_meta_file(tmp_path):
    folder = write_cifar(tmp_path, "cifar10", num_train=50, num_test=20)
    assert folder == tmp_path / "cifar-10-batches-py"
    assert sorted(os.listdir(folder)) == CIFAR10_FILES
    for name in CIFAR10_FILES:
        # Protocol 2, as the published files were written, readable by any Python.
        assert (folder / name).read_bytes()[:2] == b"\x80\x02"


def test_cifar10_batches_hold_the_published_keys_and_rows_of_the_three_colour_planes(tmp_path):
    folder = write_cifar(tmp_path, "cifar10", num_train=50, num_test=20)
    batch = unpickle(folder / "data_batch_1")
    assert set(batch) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert batch[b"batch_label"] == b"training batch 1 of 5"
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (10, 3 * 32 * 32)
    assert all(type(label) is int for label in batch[b"labels"])
    test = unpickle(folder / "test_batch")
    assert test[b"batch_label"] == b"testing batch 1 of 1"
    assert test[b"data"].shape == (20, 3072) and len(test[b"labels"]) == 20
    meta = unpickle(folder / "batches.meta")
    assert meta == {b"label_names": [f"class_{i}".encode() for i in range(10)], b"num_cases_per_batch": 10,
                    b"num_vis": 3072}


def test_cifar10_training_images_are_spread_over_the_five_batches_in_order(tmp_path):
    # 7 images over 5 batches: the boundaries are int(7 * k / 5) = 0, 1, 2, 4, 5, 7.
    folder = write_cifar(tmp_path, "cifar10", num_train=7, num_test=3)
    batches = [unpickle(folder / f"data_batch_{number}") for number in range(1, 6)]
    assert [len(batch[b"data"]) for batch in batches] == [1, 1, 2, 1, 2]
    assert [len(batch[b"labels"]) for batch in batches] == [1, 1, 2, 1, 2]
    assert batches[2][b"filenames"] == [b"synthetic_000002.png", b"synthetic_000003.png"]
    assert batches[4][b"filenames"] == [b"synthetic_000005.png", b"synthetic_000006.png"]
    # The test images are numbered after the training ones.
    assert unpickle(folder / "test_batch")[b"filenames"] == [b"synthetic_000007.png", b"synthetic_000008.png",
                                                             b"synthetic_000009.png"]
    assert unpickle(folder / "batches.meta")[b"num_cases_per_batch"] == 1


def test_every_class_has_its_share_of_each_split(tmp_path):
    folder = write_cifar(tmp_path, "cifar10", num_train=50, num_test=20)
    train_labels = [label for n in range(1, 6) for label in unpickle(folder / f"data_batch_{n}")[b"labels"]]
    assert Counter(train_labels) == {label: 5 for label in range(10)}
    assert Counter(unpickle(folder / "test_batch")[b"labels"]) == {label: 2 for label in range(10)}
    # Shuffled, not sorted by class: a batch of the five would otherwise hold one or two classes.
    assert train_labels != sorted(train_labels)


def test_cifar100_is_train_test_and_meta_with_fine_and_coarse_labels(tmp_path):
    folder = write_cifar(tmp_path, "cifar100", num_train=200, num_test=100)
    assert folder == tmp_path / "cifar-100-python"
    assert sorted(os.listdir(folder)) == ["meta", "test", "train"]
    train = unpickle(folder / "train")
    assert set(train) == {b"batch_label", b"fine_labels", b"coarse_labels", b"data", b"filenames"}
    assert train[b"data"].shape == (200, 3072)
    assert Counter(train[b"fine_labels"]) == {label: 2 for label in range(100)}
    # Five fine classes to a superclass, as CIFAR-100 groups them.
    assert train[b"coarse_labels"] == [fine // 5 for fine in train[b"fine_labels"]]
    test = unpickle(folder / "test")
    assert Counter(test[b"fine_labels"]) == {label: 1 for label in range(100)}
    assert test[b"filenames"][0] == b"synthetic_000200.png"
    meta = unpickle(folder / "meta")
    assert meta[b"fine_label_names"] == [f"class_{i}".encode() for i in range(100)]
    assert meta[b"coarse_label_names"] == [f"superclass_{i}".encode() for i in range(20)]


def test_the_project_loader_reads_cifar100_as_the_rows_written(tmp_path):
    folder = write_cifar(tmp_path, "cifar100", num_train=100, num_test=100, seed=2)
    train, test = load_dataset("cifar100", tmp_path)
    for split, name in [(train, "train"), (test, "test")]:
        written = unpickle(folder / name)
        expected = torch.from_numpy(written[b"data"].reshape(-1, 3, 32, 32))
        assert torch.equal(split.images, expected)
        assert split.labels.tolist() == written[b"fine_labels"]


def test_every_image_has_the_colour_of_its_class_across_chunks(tmp_path, monkeypatch):
    # Chunks of 16 images: 120 images take 8 of them, the last one partial.
    monkeypatch.setattr(generate, "IMAGES_PER_CHUNK", 16)
    folder = write_cifar(tmp_path, "cifar10", num_train=100, num_test=20, seed=0)
    batches = [unpickle(folder / name) for name in CIFAR10_FILES[1:]]
    pixels = np.concatenate([batch[b"data"] for batch in batches]).reshape(-1, 3, 1024).astype(np.float64)
    labels = np.array([label for batch in batches for label in batch[b"labels"]])
    # The stripes are the same in the three channels, so the mean difference between two channels is the
    # class colour's, give or take the noise (std 25 * sqrt(2) / 32 per image) and clipping.
    means = pixels.mean(axis=2)
    differences = np.stack([means[:, 0] - means[:, 1], means[:, 2] - means[:, 1]], axis=1)
    centres = np.stack([np.median(differences[labels == label], axis=0) for label in range(10)])
    assert np.abs(differences - centres[labels]).max() < 6
    nearest = np.linalg.norm(differences[:, None] - centres[None], axis=2).argmin(axis=1)
    assert (nearest == labels).all()


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_images(tmp_path):
    first = all_files(write_cifar(tmp_path / "first", "cifar10", num_train=30, num_test=10, seed=5))
    again = all_files(write_cifar(tmp_path / "again", "cifar10", num_train=30, num_test=10, seed=5))
    other = all_files(write_cifar(tmp_path / "other", "cifar10", num_train=30, num_test=10, seed=6))
    assert first == again
    assert pickle.loads(first["test_batch"], encoding="bytes")[b"data"].tobytes() != \
        pickle.loads(other["test_batch"], encoding="bytes")[b"data"].tobytes()


def test_an_unknown_cifar_variant_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError) as caught:
        write_cifar(tmp_path, "cifar1000")
    assert str(caught.value) == "variant must be one of cifar10, cifar100, got 'cifar1000'"
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def tiny_imagenet(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_imagenet(root, num_classes=3, train_per_class=4, val_per_class=2, seed=1)


def test_tiny_imagenet_lists_its_classes_in_descending_order(tiny_imagenet):
    wnids = (tiny_imagenet / "wnids.txt").read_text().splitlines()
    assert len(wnids) == 3 and len(set(wnids)) == 3
    assert all(len(wnid) == 9 and wnid[0] == "n" and wnid[1:].isdigit() for wnid in wnids)
    # Descending: a loader that sorts the folder names instead of reading wnids.txt mislabels them.
    assert wnids == sorted(wnids, reverse=True)
    assert (tiny_imagenet / "words.txt").read_text().splitlines() == [
        f"{wnid}\tsynthetic class {label}" for label, wnid in enumerate(wnids)]


def test_tiny_imagenet_training_images_are_64_pixel_jpegs_in_their_class_folders(tiny_imagenet):
    wnids = (tiny_imagenet / "wnids.txt").read_text().splitlines()
    assert sorted(os.listdir(tiny_imagenet / "train")) == sorted(wnids)
    modes = []
    for wnid in wnids:
        images = tiny_imagenet / "train" / wnid / "images"
        names = [f"{wnid}_{i}.JPEG" for i in range(4)]
        assert sorted(os.listdir(images)) == names
        assert (tiny_imagenet / "train" / wnid / f"{wnid}_boxes.txt").read_text() == "".join(
            f"{name}\t0\t0\t63\t63\n" for name in names)
        for name in names:
            with Image.open(images / name) as image:
                assert image.format == "JPEG" and image.size == (64, 64)
                modes.append(image.mode)
    # The first image of the first class is greyscale, as a few of the real ones are.
    assert modes == ["L"] + ["RGB"] * 11


def test_tiny_imagenet_validation_images_are_listed_with_their_class(tiny_imagenet):
    wnids = (tiny_imagenet / "wnids.txt").read_text().splitlines()
    lines = (tiny_imagenet / "val" / "val_annotations.txt").read_text().splitlines()
    fields = [line.split("\t") for line in lines]
    assert [row[0] for row in fields] == [f"val_{i}.JPEG" for i in range(6)]
    assert all(row[2:] == ["0", "0", "63", "63"] for row in fields)
    assert Counter(row[1] for row in fields) == {wnid: 2 for wnid in wnids}
    assert sorted(os.listdir(tiny_imagenet / "val" / "images")) == sorted(row[0] for row in fields)
    with Image.open(tiny_imagenet / "val" / "images" / "val_5.JPEG") as image:
        assert (image.format, image.size, image.mode) == ("JPEG", (64, 64), "RGB")


@pytest.fixture
def cifar_folder(tmp_path):
    return write_cifar(tmp_path / "data", "cifar10", num_train=10, num_test=5)


def test_a_tar_gz_archive_unpacks_to_the_dataset_folder_under_its_own_name(cifar_folder, tmp_path):
    archive = write_archive(cifar_folder, tmp_path / "served" / "nested" / "cifar-10-python.tar.gz")
    assert archive == tmp_path / "served" / "nested" / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "r:gz") as packed:
        names = packed.getnames()
        packed.extractall(tmp_path / "unpacked", filter="data")
    assert all(name == "cifar-10-batches-py" or name.startswith("cifar-10-batches-py/") for name in names)
    assert all_files(tmp_path / "unpacked" / "cifar-10-batches-py") == all_files(cifar_folder)


def test_a_zip_archive_unpacks_to_the_dataset_folder_under_its_own_name(tiny_imagenet, tmp_path):
    archive = write_archive(tiny_imagenet, tmp_path / "tiny-imagenet-200.zip")
    with zipfile.ZipFile(archive) as packed:
        names = packed.namelist()
        packed.extractall(tmp_path / "unpacked")
    assert all(name.startswith("tiny-imagenet-200/") for name in names)
    assert all_files(tmp_path / "unpacked" / "tiny-imagenet-200") == all_files(tiny_imagenet)


@pytest.mark.parametrize("name", ["cifar.tgz", "cifar.tar", "tiny.ZIP", "cifar.gz"])
def test_an_archive_of_another_kind_is_refused(cifar_folder, tmp_path, name):
    with pytest.raises(ValueError) as caught:
        write_archive(cifar_folder, tmp_path / name)
    assert str(caught.value) == f"archive must end in .tar.gz or .zip, got {name!r}"
    assert not (tmp_path / name).exists()
