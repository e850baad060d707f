import pickle
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fl_lightning.data import DATASET_NAMES, dataset_label, load_dataset, register_dataset, registered_datasets
from fl_lightning.data.generate import write_cifar, write_tiny_imagenet
from fl_lightning.errors import ConfigError


def read_raw_batches(paths):
    batches = []
    for path in paths:
        with open(path, "rb") as f:
            batches.append(pickle.load(f, encoding="bytes"))
    return batches


def pixel_from_row(row, channel, y, x):
    """The CIFAR format: 1024 red values, then green, then blue, each row-major over 32x32."""
    return row[channel * 1024 + y * 32 + x]


def test_cifar10_loads_generated_batches(tmp_path):
    folder = write_cifar(tmp_path, "cifar10", num_train=60, num_test=20, seed=3)
    train, test = load_dataset("cifar10", tmp_path)

    assert train.images.shape == (60, 3, 32, 32) and test.images.shape == (20, 3, 32, 32)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.images.is_contiguous() and train.images.device.type == "cpu"
    assert train.num_classes == 10 and len(train) == 60 and len(train.mean) == 3 == len(train.std)

    raw_train = read_raw_batches([folder / f"data_batch_{number}" for number in range(1, 6)])
    written_labels = np.concatenate([batch[b"labels"] for batch in raw_train])
    assert torch.equal(train.labels, torch.from_numpy(written_labels))
    (raw_test,) = read_raw_batches([folder / "test_batch"])
    assert test.labels.tolist() == raw_test[b"labels"]

    last_batch = raw_train[4][b"data"]
    first_of_last = 60 - len(last_batch)
    for channel, y, x in [(0, 0, 0), (2, 5, 17), (1, 31, 3), (2, 31, 31)]:
        assert train.images[0, channel, y, x] == pixel_from_row(raw_train[0][b"data"][0], channel, y, x)
        assert train.images[first_of_last + 1, channel, y, x] == pixel_from_row(last_batch[1], channel, y, x)
        assert test.images[7, channel, y, x] == pixel_from_row(raw_test[b"data"][7], channel, y, x)


@pytest.fixture
def cifar_copy(cifar_root, tmp_path):
    """A private copy of the session's CIFAR-10 folder, free to damage."""
    shutil.copytree(cifar_root / "cifar-10-batches-py", tmp_path / "cifar-10-batches-py")
    return tmp_path


@pytest.mark.parametrize("absent", [("data_batch_3",), ("data_batch_5",), ("data_batch_2", "test_batch")])
def test_cifar10_with_a_file_missing_names_root_and_the_file(cifar_copy, absent):
    # A copy without data_batch_3 would otherwise train on four fifths of the data without a word.
    for name in absent:
        (cifar_copy / "cifar-10-batches-py" / name).unlink()
    with pytest.raises(ConfigError) as caught:
        load_dataset("cifar10", cifar_copy)
    message = str(caught.value)
    assert caught.value.field_name == "data.root"
    assert str(cifar_copy) in message and all(name in message for name in absent)
    assert "data_batch_1..5 and test_batch" in message


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not a batch", "labels short"])
def test_cifar10_corrupt_batch_names_the_file(cifar_copy, damage):
    path = cifar_copy / "cifar-10-batches-py" / "data_batch_2"
    if damage == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "not a batch":
        path.write_bytes(pickle.dumps([1, 2, 3]))
    else:
        (batch,) = read_raw_batches([path])
        batch[b"labels"] = batch[b"labels"][:-1]
        path.write_bytes(pickle.dumps(batch))
    with pytest.raises(ConfigError) as caught:
        load_dataset("cifar10", cifar_copy)
    assert caught.value.field_name == "data.root"
    assert str(path) in str(caught.value)


def test_cifar100_with_a_file_missing_names_it(tmp_path):
    folder = write_cifar(tmp_path, "cifar100", num_train=100, num_test=100)
    (folder / "test").unlink()
    with pytest.raises(ConfigError, match="lacks test") as caught:
        load_dataset("cifar100", tmp_path)
    assert caught.value.field_name == "data.root"


@pytest.mark.parametrize(
    "name, url",
    [
        ("cifar10", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
        ("cifar100", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"),
        ("tiny_imagenet", "http://cs231n.stanford.edu/tiny-imagenet-200.zip"),
    ],
)
def test_download_without_network_names_data_download_and_the_url(tmp_path, monkeypatch, name, url):
    import urllib.error
    import urllib.request

    tried = []

    def offline(request, *args, **kwargs):
        tried.append(getattr(request, "full_url", request))
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(ConfigError) as caught:
        load_dataset(name, tmp_path / "data", download=True)
    assert caught.value.field_name == "data.download"
    assert url in str(caught.value) and "no network" in str(caught.value)
    assert tried and tried[0] == url


def test_cifar_pickles_with_str_keys_load_like_bytes_keys(tmp_path):
    folder = write_cifar(tmp_path, "cifar10", num_train=20, num_test=10)
    _, with_bytes_keys = load_dataset("cifar10", tmp_path)
    (batch,) = read_raw_batches([folder / "test_batch"])
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({key.decode(): value for key, value in batch.items()}, f)

    _, with_str_keys = load_dataset("cifar10", tmp_path)
    assert torch.equal(with_str_keys.images, with_bytes_keys.images)
    assert torch.equal(with_str_keys.labels, with_bytes_keys.labels)


def test_cifar100_loads_fine_labels(tmp_path):
    folder = write_cifar(tmp_path, "cifar100", num_train=300, num_test=200, seed=1)
    train, test = load_dataset("cifar100", tmp_path)

    assert train.images.shape == (300, 3, 32, 32) and test.images.shape == (200, 3, 32, 32)
    assert train.num_classes == 100
    (raw_train, raw_test) = read_raw_batches([folder / "train", folder / "test"])
    assert train.labels.tolist() == raw_train[b"fine_labels"]
    assert test.labels.tolist() == raw_test[b"fine_labels"]
    assert set(test.labels.tolist()) == set(range(100))
    assert train.images[11, 1, 20, 9] == pixel_from_row(raw_train[b"data"][11], 1, 20, 9)


def test_generated_classes_are_learnable(tmp_path):
    write_cifar(tmp_path, "cifar10", num_train=500, num_test=200)
    train, test = load_dataset("cifar10", tmp_path)

    def colours(dataset):
        return dataset.images.float().mean(dim=(2, 3))

    centroids = torch.stack([colours(train)[train.labels == label].mean(0) for label in range(10)])
    predictions = torch.cdist(colours(test), centroids).argmin(1)
    assert (predictions == test.labels).float().mean() > 0.5  # chance is 0.1


def decode(path):
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def test_tiny_imagenet_follows_wnids_order_and_val_annotations(tmp_path):
    folder = write_tiny_imagenet(tmp_path, num_classes=3, train_per_class=4, val_per_class=2)
    wnids = (folder / "wnids.txt").read_text().split()
    assert wnids != sorted(wnids)  # otherwise this test cannot tell wnids order from folder order

    train, test = load_dataset("tiny_imagenet", tmp_path)

    assert train.images.shape == (12, 3, 64, 64) and test.images.shape == (6, 3, 64, 64)
    assert train.images.dtype == torch.uint8 and train.num_classes == 3
    assert train.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert torch.equal(train.images[4], decode(folder / "train" / wnids[1] / "images" / f"{wnids[1]}_0.JPEG"))
    # the generator saves this one greyscale
    assert torch.equal(train.images[0, 0], train.images[0, 1]) and torch.equal(train.images[0, 1], train.images[0, 2])

    annotations = [line.split("\t") for line in (folder / "val" / "val_annotations.txt").read_text().splitlines()]
    assert test.labels.tolist() == [wnids.index(wnid) for _, wnid, *_ in annotations]
    assert sorted(test.labels.tolist()) == [0, 0, 1, 1, 2, 2]
    for position, (filename, *_) in enumerate(annotations):
        assert torch.equal(test.images[position], decode(folder / "val" / "images" / filename))


def test_tiny_imagenet_second_load_reads_the_cache(tmp_path):
    folder = write_tiny_imagenet(tmp_path)
    first_train, first_test = load_dataset("tiny_imagenet", tmp_path)
    assert (folder / "fl_lightning_cache.pt").is_file()
    assert not list(folder.glob("*.tmp"))

    shutil.rmtree(folder / "train")
    shutil.rmtree(folder / "val")
    second_train, second_test = load_dataset("tiny_imagenet", tmp_path)

    assert torch.equal(second_train.images, first_train.images)
    assert torch.equal(second_train.labels, first_train.labels)
    assert torch.equal(second_test.images, first_test.images)
    assert second_train.num_classes == 3


@pytest.mark.parametrize(
    "name, folder, layout_hint",
    [
        ("cifar10", "cifar-10-batches-py", "test_batch"),
        ("cifar100", "cifar-100-python", "train and test"),
        ("tiny_imagenet", "tiny-imagenet-200", "wnids.txt"),
    ],
)
def test_missing_dataset_names_root_and_layout(tmp_path, name, folder, layout_hint):
    with pytest.raises(ConfigError) as caught:
        load_dataset(name, tmp_path / "nowhere", download=False)
    message = str(caught.value)
    assert caught.value.field_name == "data.root"
    assert str(tmp_path / "nowhere" / folder) in message
    assert layout_hint in message and "data.download" in message


def test_unknown_dataset_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.name") as caught:
        load_dataset("mnist", tmp_path)
    assert all(name in str(caught.value) for name in DATASET_NAMES)


def test_digits_load_offline(tmp_path):
    train, test = load_dataset("digits", tmp_path / "ignored")

    assert train.images.shape == (1437, 1, 8, 8) and test.images.shape == (360, 1, 8, 8)
    assert train.images.dtype == torch.uint8 and test.labels.dtype == torch.int64
    assert int(train.images.max()) == 255 and int(train.images.min()) == 0
    assert train.num_classes == 10
    assert set(test.labels.tolist()) == set(range(10)) == set(train.labels.tolist())
    # Split 80/20 within each class.
    for label in range(10):
        in_train, in_test = int((train.labels == label).sum()), int((test.labels == label).sum())
        assert abs(in_train - 0.8 * (in_train + in_test)) <= 1
    pixels = train.images.double() / 255
    assert train.mean == pytest.approx((pixels.mean().item(),))
    assert train.std == pytest.approx((pixels.std(unbiased=False).item(),))
    again, _ = load_dataset("digits", tmp_path)
    assert torch.equal(again.labels, train.labels)


def test_a_built_in_dataset_is_labelled_as_papers_name_it():
    assert [dataset_label(name) for name in ("cifar10", "cifar100", "tiny_imagenet", "digits", "my_data.load")] == [
        "CIFAR-10", "CIFAR-100", "Tiny-ImageNet", "digits", "my_data.load"]


def test_the_registry_holds_the_built_in_datasets_once_each():
    assert registered_datasets() == list(DATASET_NAMES)
    with pytest.raises(ValueError, match="registered twice"):
        register_dataset("cifar10")(lambda root, download: None)
