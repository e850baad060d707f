"""Registry: entries registered by a decorator under a name, listed in registration order, looked up by
name, and a name registered twice refused."""

import pytest

from fl_lightning.registry import Registry


def test_the_decorator_registers_the_entry_and_returns_it_unchanged():
    models = Registry("model")

    def small(num_classes):
        return ("small", num_classes)

    decorated = models.register("small")(small)
    assert decorated is small
    assert models.get("small") is small
    assert models.get("small")(10) == ("small", 10)


def test_names_are_listed_in_registration_order():
    datasets = Registry("dataset")
    for name in ["zeta", "alpha", "mid"]:
        datasets.register(name)(lambda: None)
    assert datasets.names() == ["zeta", "alpha", "mid"]


def test_an_unknown_name_gets_none():
    models = Registry("model")
    models.register("mlp")(dict)
    assert models.get("resnet") is None
    assert models.get("MLP") is None


def test_a_name_registered_twice_is_refused_and_the_first_entry_kept():
    models = Registry("model")

    @models.register("mlp")
    def first():
        return 1

    with pytest.raises(ValueError) as caught:
        @models.register("mlp")
        def second():
            return 2

    assert str(caught.value) == "model 'mlp' is registered twice"
    assert models.get("mlp") is first
    assert models.names() == ["mlp"]


def test_the_refusal_names_the_registrys_kind():
    datasets = Registry("dataset")
    datasets.register("digits")(list)
    with pytest.raises(ValueError, match="^dataset 'digits' is registered twice$"):
        datasets.register("digits")(tuple)


def test_registries_are_independent():
    models, datasets = Registry("model"), Registry("dataset")
    models.register("shared")(list)
    datasets.register("shared")(tuple)
    assert models.get("shared") is list and datasets.get("shared") is tuple
    assert models.kind == "model" and datasets.kind == "dataset"


def test_changing_the_listed_names_leaves_the_registry_as_it_was():
    models = Registry("model")
    models.register("mlp")(list)
    models.names().append("intruder")
    assert models.names() == ["mlp"]
    assert models.get("intruder") is None


def test_a_label_is_given_at_registration_and_found_however_a_plan_spells_the_name():
    datasets = Registry("dataset")
    datasets.register("tiny_imagenet", label="Tiny-ImageNet")(list)
    datasets.register("digits")(tuple)
    assert [datasets.label(name) for name in ("tiny_imagenet", "tiny-imagenet", "TinyImageNet")] == [
        "Tiny-ImageNet"] * 3
    assert datasets.label("digits") == "digits"  # no label given: the name
    assert datasets.label("svhn") is None
