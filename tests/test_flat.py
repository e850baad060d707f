"""FlatLayout: the order and shapes it records, the flat vector it builds from named tensors, and the
named views it gives back, which share memory and autograd history with the flat vector."""

import pytest
import torch

from fl_lightning.flat import FlatLayout


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    return [("conv.weight", torch.arange(24, dtype=torch.float32).view(2, 3, 2, 2)),
            ("conv.bias", torch.tensor([100.0, 101.0])),
            ("scale", torch.tensor(7.0))]


def test_the_layout_keeps_the_names_and_shapes_in_the_given_order():
    layout = FlatLayout.of(named_tensors())
    assert layout.names == ("conv.weight", "conv.bias", "scale")
    assert layout.shapes == (torch.Size([2, 3, 2, 2]), torch.Size([2]), torch.Size([]))
    # A 0-dimensional tensor still takes one element of the vector.
    assert layout.numels == (24, 2, 1)
    assert layout.numel == 27


def test_layouts_of_the_same_names_and_shapes_are_equal_whatever_the_values():
    other_values = [(name, torch.randn(tensor.shape)) for name, tensor in named_tensors()]
    assert FlatLayout.of(named_tensors()) == FlatLayout.of(other_values)
    assert FlatLayout.of(named_tensors()) != FlatLayout.of(reversed(named_tensors()))


def test_flatten_follows_the_layout_order_not_the_mappings():
    layout = FlatLayout.of(named_tensors())
    # The mapping lists the tensors in another order, and holds one the layout does not name.
    tensors = dict(reversed(named_tensors()))
    tensors["unrelated"] = torch.full((5,), -1.0)
    flat = layout.flatten(tensors)
    assert flat.tolist() == [float(v) for v in range(24)] + [100.0, 101.0, 7.0]


def test_flatten_gives_a_float32_vector_detached_from_the_tensors_graph():
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    steps = torch.tensor([5, 6], dtype=torch.int64)
    layout = FlatLayout.of([("weight", weight), ("steps", steps)])
    flat = layout.flatten({"weight": weight * 2, "steps": steps})
    assert flat.dtype == torch.float32
    assert not flat.requires_grad
    assert flat.tolist() == [2.0, 4.0, 6.0, 8.0, 5.0, 6.0]


def test_flatten_of_a_tensor_the_layout_names_but_the_mapping_lacks_raises_key_error():
    layout = FlatLayout.of(named_tensors())
    tensors = dict(named_tensors())
    del tensors["conv.bias"]
    with pytest.raises(KeyError, match="conv.bias"):
        layout.flatten(tensors)


def test_an_empty_layout_flattens_to_an_empty_vector_and_gives_no_views():
    layout = FlatLayout.of([])
    assert layout.numel == 0
    flat = layout.flatten({"ignored": torch.ones(3)})
    assert flat.shape == (0,)
    assert layout.views(flat) == {}


def test_views_give_back_each_tensor_in_its_shape():
    layout = FlatLayout.of(named_tensors())
    views = layout.views(layout.flatten(dict(named_tensors())))
    assert list(views) == list(layout.names)
    for name, tensor in named_tensors():
        assert views[name].shape == tensor.shape
        assert torch.equal(views[name], tensor)


def test_views_share_memory_with_the_flat_vector_both_ways():
    layout = FlatLayout.of(named_tensors())
    flat = torch.zeros(layout.numel)
    views = layout.views(flat)
    views["conv.bias"][1] = 9.0
    # conv.bias follows the 24 elements of conv.weight: its second element is element 25.
    assert flat[25].item() == 9.0
    flat[26] = 3.0
    assert views["scale"].item() == 3.0
    flat[:24] = torch.arange(24.0)
    assert views["conv.weight"][1, 2, 1, 0].item() == 1 * 12 + 2 * 4 + 1 * 2 + 0


def test_gradients_through_the_views_reach_the_flat_vector():
    layout = FlatLayout.of([("weight", torch.zeros(2, 2)), ("bias", torch.zeros(2))])
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5, -0.5], requires_grad=True)
    views = layout.views(flat)
    inputs = torch.tensor([1.0, 10.0])
    # d/dflat of sum(W @ x + b): x for each row of W, 1 for each bias element.
    (views["weight"] @ inputs + views["bias"]).sum().backward()
    assert flat.grad.tolist() == [1.0, 10.0, 1.0, 10.0, 1.0, 1.0]
