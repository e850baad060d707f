"""What every rank keeps of the federation between rounds: the global model as flat vectors, and the
per-client state of stateful algorithms that a client's owner rank keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fl_lightning.flat import FlatLayout


class ClientStates:
    """Per-client vectors of stateful algorithms (SCAFFOLD's c_i, FedDyn's h_i, MOON's previous
    model), kept off the accelerator by the client's owner rank. A client has an entry only once
    it has trained, so memory is one float32 vector per name per client that took part."""

    def __init__(self, initial: Optional[dict] = None):
        self.by_client: dict[int, dict[str, torch.Tensor]] = {}
        self._pin = torch.cuda.is_available()
        for client_id, state in (initial or {}).items():
            self.put(client_id, state)

    def get(self, client_id: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {k: v.to(device, non_blocking=True) for k, v in self.by_client.get(client_id, {}).items()}

    def put(self, client_id: int, state: dict[str, torch.Tensor]) -> None:
        stored = {}
        for name, value in state.items():
            host = value.detach().to("cpu", copy=True)
            stored[name] = host.pin_memory() if self._pin else host
        self.by_client[client_id] = stored


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
