"""What every rank keeps between rounds (fl_lightning.federation.global_state): the global model bound to
two flat vectors that its module's own tensors are views of (`FlatGlobalModel`)."""

import torch
from torch import nn

from fl_lightning.federation.global_state import FlatGlobalModel

CPU = torch.device("cpu")


def small_network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


# FlatGlobalModel


def test_the_flat_parameters_are_the_modules_parameters_in_order():
    module = small_network()
    expected = [value for parameter in module.parameters() for value in parameter.detach().reshape(-1).tolist()]
    model = FlatGlobalModel.bind(module, CPU)
    assert model.params.tolist() == expected
    assert model.param_layout.names == ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")
    assert model.param_layout.numel == 3 * 4 + 4 + 4 + 4 + 4 * 2 + 2


def test_only_the_float_buffers_are_in_the_buffer_vector():
    module = small_network()
    model = FlatGlobalModel.bind(module, CPU)
    # BatchNorm's num_batches_tracked is an integer count, not a statistic to aggregate.
    assert model.buffer_layout.names == ("1.running_mean", "1.running_var")
    assert model.buffers.tolist() == [0.0] * 4 + [1.0] * 4
    assert module.get_buffer("1.num_batches_tracked").dtype == torch.long


def test_a_step_on_the_flat_vector_is_a_step_of_the_module():
    module = small_network()
    model = FlatGlobalModel.bind(module, CPU)
    inputs = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    module.eval()
    before = module(inputs)
    step = torch.linspace(-1.0, 1.0, model.params.numel())
    with torch.no_grad():
        model.params.add_(step)
    # The same network built from the stepped values, independently of the binding.
    reference = small_network()
    offset = 0
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(step[offset:offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
    reference.eval()
    after = module(inputs)
    torch.testing.assert_close(after, reference(inputs))
    assert not torch.allclose(after, before)


def test_the_modules_tensors_share_memory_with_the_flat_vectors():
    module = small_network()
    model = FlatGlobalModel.bind(module, CPU)
    with torch.no_grad():
        module.get_parameter("3.bias").fill_(7.0)
    assert model.params[-2:].tolist() == [7.0, 7.0]
    module.train()
    module(torch.randn(6, 3, generator=torch.Generator().manual_seed(2)))
    # A training forward pass updates the running statistics: in the buffer vector too.
    statistics = module.get_buffer("1.running_mean").tolist() + module.get_buffer("1.running_var").tolist()
    assert model.buffers.tolist() == statistics
    assert model.buffers[:4].abs().sum() > 0


def test_a_network_without_float_buffers_gets_an_empty_buffer_vector():
    module = nn.Linear(2, 2)
    model = FlatGlobalModel.bind(module, CPU)
    assert model.buffers.numel() == 0 and model.buffer_layout.names == ()
    assert model.params.numel() == 6
