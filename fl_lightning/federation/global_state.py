"""What every rank keeps of the federation between rounds: the global model as flat vectors (the
per-client state of stateful algorithms is `fl_lightning.federation.client_store`'s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_lightning.flat import FlatLayout


@dataclass
class FlatGlobalModel:
    """The global model as two flat vectors that the module's own tensors are views of, so the
    server's in-place steps are the model (for evaluation and checkpoints alike)."""

    param_layout: FlatLayout
    buffer_layout: FlatLayout
    params: torch.Tensor
    buffers: torch.Tensor
    """The float buffers (BatchNorm running statistics)."""

    @classmethod
    def bind(cls, module: torch.nn.Module, device: torch.device) -> "FlatGlobalModel":
        param_layout = FlatLayout.of(module.named_parameters())
        buffer_layout = FlatLayout.of((n, b) for n, b in module.named_buffers() if b.is_floating_point())
        params = param_layout.flatten(dict(module.named_parameters())).to(device)
        buffers = buffer_layout.flatten(dict(module.named_buffers())).to(device)
        for name, view in param_layout.views(params).items():
            module.get_parameter(name).data = view
        for name, view in buffer_layout.views(buffers).items():
            module.get_buffer(name).data = view
        return cls(param_layout, buffer_layout, params, buffers)
