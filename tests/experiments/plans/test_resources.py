"""A plan's `resources:` read and checked: every problem names its key."""

import pytest
import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.resources import PlanResources, read_resources


@pytest.mark.parametrize("resources, field, expected", [
    ({"gpus": 4}, "plan.resources", "only the keys gpus_per_run, precision, time_per_run, cpus_per_run"),
    ({"cpus_per_run": 0}, "plan.resources.cpus_per_run", "an integer >= 1"),
    ({"gpus_per_run": -1}, "plan.resources.gpus_per_run", "an integer >= 0"),
    ({"gpus_per_run": True}, "plan.resources.gpus_per_run", "an integer >= 0"),
    ({"precision": "bf16"}, "plan.resources.precision", "one of 32-true, bf16-mixed"),
    ({"time_per_run": 86400}, "plan.resources.time_per_run", "quoted string"),  # YAML's reading of 24:00:00
    ({"time_per_run": "a day"}, "plan.resources.time_per_run", "SLURM time limit"),
    ([4], "plan.resources", "a mapping"),
])
def test_bad_resources_are_refused_naming_the_key(resources, field, expected):
    with pytest.raises(ConfigError, match=expected) as refused:
        read_resources(resources)
    assert refused.value.field_name == field


def test_unquoted_time_in_yaml_is_refused():
    with pytest.raises(ConfigError, match="plan.resources.time_per_run: expected a SLURM time limit as a quoted"):
        read_resources(yaml.safe_load("{time_per_run: 24:00:00}"))


def test_resources_are_read_as_given_and_default_to_none():
    assert read_resources(None) == PlanResources()
    given = {"gpus_per_run": 2, "precision": "bf16-mixed", "time_per_run": "1-12:00:00", "cpus_per_run": 8}
    assert read_resources(given) == PlanResources(**given)
