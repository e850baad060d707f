"""The client's local optimizer against torch.optim.SGD, step by step."""

import pytest
import torch

from fl_lightning.clients import LocalSGD, clip_to_norm
from fl_lightning.config import ClientOptimizerArgs


def test_clip_to_norm_scales_only_longer_vectors():
    long = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(clip_to_norm(long, 1.0), torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(clip_to_norm(long, 10.0), long)
    assert clip_to_norm(long, None) is long


@pytest.mark.parametrize("momentum, nesterov, clip", [(0.0, False, None), (0.9, False, 0.5), (0.9, True, 0.5)])
def test_local_sgd_matches_torch_sgd_with_gradient_clipping(momentum, nesterov, clip):
    args = ClientOptimizerArgs(lr=0.1, momentum=momentum, weight_decay=0.01, nesterov=nesterov, grad_clip_norm=clip)
    generator = torch.Generator().manual_seed(0)
    params = torch.randn(6, generator=generator)
    reference = params.clone().requires_grad_(True)
    torch_sgd = torch.optim.SGD([reference], lr=0.1, momentum=momentum, weight_decay=0.01, nesterov=nesterov)
    local_sgd = LocalSGD(args)
    for _ in range(5):
        gradient = torch.randn(6, generator=generator)
        params = local_sgd.step(params, gradient)
        reference.grad = gradient.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([reference], clip)
        torch_sgd.step()
    torch.testing.assert_close(params, reference.detach())
