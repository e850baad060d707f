"""The names a setting chooses among, one Literal type each: config.py's fields take these types, and
the data and model code below the settings check the same names (`typing.get_args`). Here, below
both, so that neither keeps a copy of the list."""

from typing import Literal

DatasetName = Literal["cifar10", "cifar100", "tiny_imagenet", "digits"]
"""The built-in datasets (data.name also takes a loader's dotted path)."""
PartitionScheme = Literal["dirichlet", "iid", "shards"]
"""How training samples are split over clients (data.partition)."""
Norm = Literal["bn", "gn", "none"]
"""Normalisation layers of the models that let them be chosen (model.norm)."""
Weighting = Literal["num_samples", "uniform"]
"""Aggregation weights p_i: proportional to a client's samples, or equal (federation.weighting and
each algorithm's default)."""
