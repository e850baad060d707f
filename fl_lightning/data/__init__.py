"""Datasets as uint8 tensors, their split over clients, and batched on-device augmentation."""

from fl_lightning.data.augment import DeviceTransform
from fl_lightning.data.datasets import (
    DATASET_NAMES,
    ImageDataset,
    check_dataset,
    dataset_label,
    load_dataset,
    register_dataset,
    registered_datasets,
)
from fl_lightning.data.partition import (
    ClientSamples,
    class_histogram,
    hold_out_validation,
    partition_indices,
    plot_partition,
)

__all__ = [
    "ClientSamples",
    "DATASET_NAMES",
    "DeviceTransform",
    "ImageDataset",
    "check_dataset",
    "dataset_label",
    "class_histogram",
    "hold_out_validation",
    "load_dataset",
    "partition_indices",
    "plot_partition",
    "register_dataset",
    "registered_datasets",
]
