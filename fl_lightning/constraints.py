"""Constraints on local training, applied as a projection of each local update direction."""

from __future__ import annotations

from typing import Callable, Literal, get_args

import torch
from torch import nn

from fl_lightning.configurable import Configurable
from fl_lightning.errors import ConfigError
from fl_lightning.flat import FlatLayout

Granularity = Literal["channel", "layer", "model"]
GRANULARITIES = get_args(Granularity)


class Constraint(Configurable):
    """A linear constraint set on the local model, fixed by the global model of the round."""

    def prepare_model(self, network: nn.Module) -> None:
        """Check that the model suits the constraint and make the initial global model feasible."""

    def projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Callable[[torch.Tensor], torch.Tensor]:
        """The map of local directions onto the constraint's null space for this round."""
        raise NotImplementedError


class CONST(Constraint):
    """FedCONST (Kim et al.): every constrained weight row w_c stays centred and on the hyperplane
    through the global row G_c orthogonal to G_c,

        1^T w_c = 0   and   G_c^T (w_c - G_c) = 0.

    Local directions (gradient plus corrections plus weight decay) are projected onto the null space
    of {1, G_c} before the optimizer uses them, so plain, momentum and Nesterov SGD all keep both
    constraints. The rows are the fan-in rows of each conv and linear weight (any parameter with
    ndim >= 2), one per output channel; `layer` takes a whole tensor as one row, `model` all
    constrained tensors together as one. 1-D parameters are left free. Averaging keeps both
    constraints, so the initial model is centred once and the global model stays centred.
    """

    def __init__(
        self,
        granularity: Granularity = "channel",
        centralize: bool = True,
        orthogonal: bool = True,
        skip_first_layer: bool = False,
        skip_classifier: bool = False,
    ):
        """
        Args:
            granularity: what one constrained row is: an output channel's fan-in (the paper), a
                whole weight tensor, or all constrained weights of the model at once.
            centralize: keep 1^T w_c = 0.
            orthogonal: keep G_c^T (w_c - G_c) = 0.
            skip_first_layer: leave the first weight tensor unconstrained.
            skip_classifier: leave the classifier (the last weight tensor) unconstrained.
        """
        if granularity not in GRANULARITIES:
            raise ConfigError("constraint.init_args.granularity", "one of " + ", ".join(GRANULARITIES), granularity)
        self.granularity = granularity
        self.centralize = centralize
        self.orthogonal = orthogonal
        self.skip_first_layer = skip_first_layer
        self.skip_classifier = skip_classifier

    def prepare_model(self, network: nn.Module) -> None:
        for name, module in network.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise ConfigError("model.norm", "none (CONST needs a model without BatchNorm)",
                                  f"{type(module).__name__} at {name}")
            if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and module.bias is not None:
                raise ConfigError("model.bias", "false (CONST constrains bias-free conv and linear layers)",
                                  f"a bias in {name}")
        named = list(network.named_parameters())
        if self.skip_classifier:
            classifier_weight = network.classifier.weight
            last_weight = [p for _, p in named if p.ndim >= 2][-1]
            if last_weight is not classifier_weight:
                raise ConfigError("constraint.init_args.skip_classifier",
                                  "false for a model whose classifier is not its last weight tensor", True)
        if not self.centralize:
            return
        layout = FlatLayout.of(named)
        centred = self._centre(layout.flatten(dict(named)).double(), layout)  # float64: see `projection`
        with torch.no_grad():
            for (_, param), value in zip(named, layout.views(centred).values()):
                param.copy_(value)

    def projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Callable[[torch.Tensor], torch.Tensor]:
        # Computed in float64 and rounded once: in float32 the constraint error after a few hundred
        # momentum steps was about twice as large.
        rows = self._row_groups(layout, global_params.device)
        # One unit vector per row spanning what G_c adds to 1 (or G_c itself when not centralising);
        # a zero row marks a G_c with nothing to add, where the constraint says nothing.
        normals = []
        for selection, num_rows in rows:
            reference = global_params[selection].view(num_rows, -1).double()
            if self.centralize:
                reference = reference - reference.mean(dim=1, keepdim=True)
            norm = reference.norm(dim=1, keepdim=True)
            normals.append(torch.where(norm > 1e-12, reference / norm.clamp_min(1e-12), torch.zeros_like(reference)))

        def project(direction: torch.Tensor) -> torch.Tensor:
            projected = direction.clone()
            for (selection, num_rows), normal in zip(rows, normals):
                row = direction[selection].view(num_rows, -1).double()
                if self.centralize:
                    row = row - row.mean(dim=1, keepdim=True)
                if self.orthogonal:
                    row = row - normal * (normal * row).sum(dim=1, keepdim=True)
                projected[selection] = row.reshape(-1).to(direction.dtype)
            return projected

        return project

    def _centre(self, flat: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        centred = flat.clone()
        for selection, num_rows in self._row_groups(layout, flat.device):
            row = flat[selection].view(num_rows, -1)
            centred[selection] = (row - row.mean(dim=1, keepdim=True)).reshape(-1)
        return centred

    def _row_groups(self, layout: FlatLayout, device: torch.device) -> list[tuple[object, int]]:
        """(selection of the flat vector, number of rows) for each block projected as a matrix."""
        spans, offset = [], 0
        for shape, numel in zip(layout.shapes, layout.numels):
            if len(shape) >= 2:
                spans.append((offset, offset + numel, shape[0]))
            offset += numel
        if self.skip_first_layer:
            spans = spans[1:]
        if self.skip_classifier:
            spans = spans[:-1]
        if self.granularity == "model":
            if not spans:
                return []
            index = torch.cat([torch.arange(start, end, device=device) for start, end, _ in spans])
            return [(index, 1)]
        return [(slice(start, end), channels if self.granularity == "channel" else 1)
                for start, end, channels in spans]
