"""Passes through a model counted by hooks on one of its layers: an independent count of what the
run's counters (`cost_*`) and the diagnostics' (`diag_*`) say they ran."""

from torch import nn


class PassCounter:
    """Forward passes through the model's first layer, and backward passes through it (a gradient
    flowing into its output)."""

    def __init__(self, layer: nn.Module):
        self.forward = self.backward = 0
        layer.register_forward_pre_hook(self._forward)
        layer.register_forward_hook(self._watch_backward)

    def _forward(self, module, inputs):
        self.forward += 1

    def _watch_backward(self, module, inputs, output):
        if output.requires_grad:
            output.register_hook(self._backward)

    def _backward(self, gradient):
        self.backward += 1
