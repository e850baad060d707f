"""Constraints on local training: FedCONST's CONST, as its paper writes it and as its authors' code runs it."""

from __future__ import annotations

from typing import Callable, Literal, Optional, get_args

import torch
from torch import nn

from fl_lightning.configurable import FrozenConfigurable
from fl_lightning.errors import ConfigError
from fl_lightning.flat import FlatLayout

Granularity = Literal["channel", "layer", "model"]
GRANULARITIES = get_args(Granularity)
Constrained = Literal["weights", "displacement"]
When = Literal["before_step", "after_step"]
Order = Literal["exact", "centre_then_orthogonalise", "strict_scale"]
Tensors = Literal["matrices", "all"]
Map = Callable[[torch.Tensor], torch.Tensor]

FIELD = "constraint.init_args."


class Constraint(FrozenConfigurable):
    """A linear constraint set on the local model, fixed by the global model of the round; hyper-parameters
    only (frozen once built), as an algorithm is."""

    def prepare_model(self, network: nn.Module) -> None:
        """Check that the model suits the constraint and make the initial global model feasible."""

    def projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Optional[Map]:
        """The map of this round's local directions (before the optimizer's momentum), or None."""
        raise NotImplementedError

    def step_projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Optional[Map]:
        """The map of the local parameters after each optimizer step this round, or None."""
        return None


class CONST(Constraint):
    """FedCONST (Kim et al.): per row w_c of the model, with G_c the same row of the round's global
    model, the local model keeps

        1^T w_c = 0   and   G_c^T (w_c - G_c) = 0               (the paper, section 3.2, eq. 8)

    The defaults are the paper's text: `constrained: weights`, `when: before_step`, `order: exact`,
    `tensors: matrices`, `granularity: channel`. Each local direction (gradient plus an algorithm's
    corrections plus weight decay) is projected onto the null space of {1, G_c} before the
    optimizer uses it, so momentum accumulates projected directions only and plain, momentum and
    Nesterov SGD all keep both constraints. The initial model is centred once, and averaging keeps
    both constraints, so the global model stays centred. The model has no biases and no BatchNorm.

    The authors' public code (FedTorch, `methods/FedConst.py` with `train/functions.py`) runs
    another rule. After every optimizer step, on the whole flattened model (biases and norm affine
    included), D = w - G, Dc = D - mean(D) 1, and w <- G + Dc - (<Dc, G> / |G|^2) G. Its options:

    - `granularity`: a row is an output channel's fan-in (`channel`, the paper; also the code's
      `Constrainting_strict`), a whole tensor (`layer`, the code's `Constrainting_layer_per_layer`),
      or all constrained tensors at once (`model`, `Constrainting` in FedConst.py).
    - `constrained`: `weights` keeps 1^T w_c = 0 (the initial model is centred once);
      `displacement` keeps 1^T (w_c - G_c) = 0 from an initial model left as it is. Orthogonality
      is to the displacement either way. Biases and BatchNorm are allowed only with `displacement`.
    - `when`: `before_step` projects each direction; `after_step` maps the displacement of the
      parameters after each step, w <- G + P(w - G), as the code does: then the gradients, and so
      the momentum buffer, are not projected (momentum keeps pushing along 1 and G, and each step
      takes it out of the parameters again). Weight decay acts on the unprojected parameters too.
    - `order`: `exact` is the orthogonal projection onto the null space of {1, G_c} (centre, then
      remove the component along G_c - mean(G_c)). `centre_then_orthogonalise` centres, then
      removes the component along the uncentred G_c (FedConst.py): exactly orthogonal to G_c, and
      zero-sum only where 1^T G_c = 0 (with a centred G the two orders agree). `strict_scale` is
      `Constrainting_strict` as written: it removes cos(Dc, G_c) |D| / |G_c| times G_c, with |D|
      the norm of the *uncentred* displacement, i.e. |D| / |Dc| >= 1 times the exact component:
      not a projection, and not orthogonal to G_c; it is `centre_then_orthogonalise` only where D
      already has zero mean. Like the code, it maps rows of 2-D and 4-D weights (any ndim >= 2 here).
    - `tensors`: `matrices` constrains the conv and linear weights (every parameter with ndim >= 2)
      and leaves 1-D parameters free (the paper; `Constrainting_strict`); `all` constrains every
      parameter, biases and norm affine included (FedConst.py; needs `granularity` layer or model
      and `constrained: displacement`). BatchNorm's running statistics are buffers, not
      parameters: no variant constrains them; local training updates them and the round averages
      them as always (the code's flattened state_dict would take them in; its default CNN has none).

    The code's later variants also rescale the global rows to norm sqrt(2) (`Normalize`); that is
    not reproduced. Each map is computed in float64 and rounded once; a row whose G_c has nothing
    to add to 1 (or is zero) is only centred.
    """

    def __init__(
        self,
        granularity: Granularity = "channel",
        centralize: bool = True,
        orthogonal: bool = True,
        skip_first_layer: bool = False,
        skip_classifier: bool = False,
        constrained: Constrained = "weights",
        when: When = "before_step",
        order: Order = "exact",
        tensors: Tensors = "matrices",
    ):
        """
        Args:
            granularity: what one constrained row is: an output channel's fan-in (the paper), a
                whole tensor, or all constrained tensors of the model at once.
            centralize: keep 1^T w_c = 0 (1^T (w_c - G_c) = 0 for `displacement`).
            orthogonal: keep G_c^T (w_c - G_c) = 0.
            skip_first_layer: leave the first weight tensor unconstrained.
            skip_classifier: leave the classifier (the last weight tensor) unconstrained.
            constrained: the weights themselves (the paper) or their displacement from the round's
                global model (the authors' code).
            when: project each direction before the step (the paper) or the displacement after
                each step (the authors' code).
            order: the exact projection, or centre-then-orthogonalise as FedConst.py, or as
                `Constrainting_strict` with its scale (not a projection).
            tensors: the weight matrices only (the paper) or every parameter (FedConst.py).
        """
        for name, value, kind in (("granularity", granularity, Granularity), ("constrained", constrained, Constrained),
                                  ("when", when, When), ("order", order, Order), ("tensors", tensors, Tensors)):
            if value not in get_args(kind):
                raise ConfigError(FIELD + name, "one of " + ", ".join(get_args(kind)), value)
        self.granularity = granularity
        self.centralize = centralize
        self.orthogonal = orthogonal
        self.skip_first_layer = skip_first_layer
        self.skip_classifier = skip_classifier
        self.constrained = constrained
        self.when = when
        self.order = order
        self.tensors = tensors
        self._refuse_meaningless_combinations()

    def _refuse_meaningless_combinations(self) -> None:
        if self.order != "exact" and not (self.centralize and self.orthogonal):
            raise ConfigError(FIELD + "order", "exact unless centralize and orthogonal are both true "
                              "(with one of them the orders are the same map)", self.order)
        if self.order == "strict_scale" and self.when != "after_step":
            raise ConfigError(FIELD + "order", "strict_scale only with when: after_step (the code's scale "
                              "is that of the displacement after a step)", self.order)
        if self.tensors == "all":
            if self.granularity == "channel":
                raise ConfigError(FIELD + "tensors", "matrices with granularity: channel (a 1-D tensor "
                                  "has one entry per channel: a row of one)", self.tensors)
            if self.constrained == "weights":
                raise ConfigError(FIELD + "tensors", "matrices with constrained: weights (centring the "
                                  "initial biases and norm scales would zero them)", self.tensors)
            if self.skip_first_layer or self.skip_classifier:
                raise ConfigError(FIELD + "tensors", "matrices with skip_first_layer or skip_classifier "
                                  "(they name weight tensors)", self.tensors)

    def prepare_model(self, network: nn.Module) -> None:
        if self.constrained == "weights":
            _refuse_biases_and_batch_norm(network)
        named = list(network.named_parameters())
        if self.skip_classifier:
            classifier_weight = network.classifier.weight
            last_weight = [p for _, p in named if p.ndim >= 2][-1]
            if last_weight is not classifier_weight:
                raise ConfigError(FIELD + "skip_classifier",
                                  "false for a model whose classifier is not its last weight tensor", True)
        if not (self.centralize and self.constrained == "weights"):
            return
        layout = FlatLayout.of(named)
        centred = self._centre(layout.flatten(dict(named)).double(), layout)  # float64: see `_row_map`
        with torch.no_grad():
            for (_, param), value in zip(named, layout.views(centred).values()):
                param.copy_(value)

    def projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Optional[Map]:
        return self._row_map(global_params, layout) if self.when == "before_step" else None

    def step_projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Optional[Map]:
        if self.when != "after_step":
            return None
        project = self._row_map(global_params, layout)
        global_double = global_params.double()

        def project_displacement(params: torch.Tensor) -> torch.Tensor:
            return (global_double + project(params.double() - global_double)).to(params.dtype)

        return project_displacement

    def _row_map(self, global_params: torch.Tensor, layout: FlatLayout) -> Map:
        """The map of a vector's rows that `order` says, for this round's global model."""
        # Computed in float64 and rounded once: in float32 the constraint error after a few hundred
        # momentum steps was about twice as large.
        rows = self._row_groups(layout, global_params.device)
        # One unit vector per row: what G_c adds to 1 (`exact`), or G_c itself; a zero row marks a
        # G_c with nothing to add, where the constraint says nothing.
        normals = []
        for selection, num_rows in rows:
            reference = global_params[selection].view(num_rows, -1).double()
            if self.centralize and self.order == "exact":
                reference = reference - reference.mean(dim=1, keepdim=True)
            norm = reference.norm(dim=1, keepdim=True)
            normals.append(torch.where(norm > 1e-12, reference / norm.clamp_min(1e-12), torch.zeros_like(reference)))

        def project(vector: torch.Tensor) -> torch.Tensor:
            projected = vector.clone()
            for (selection, num_rows), normal in zip(rows, normals):
                row = vector[selection].view(num_rows, -1).double()
                uncentred_norm = row.norm(dim=1, keepdim=True) if self.order == "strict_scale" else None
                if self.centralize:
                    row = row - row.mean(dim=1, keepdim=True)
                if self.orthogonal:
                    along = (normal * row).sum(dim=1, keepdim=True)
                    if uncentred_norm is not None:
                        along = along * _ratio(uncentred_norm, row.norm(dim=1, keepdim=True))
                    row = row - normal * along
                projected[selection] = row.reshape(-1).to(vector.dtype)
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
            if len(shape) >= 2 or self.tensors == "all":
                spans.append((offset, offset + numel, shape[0] if len(shape) else 1))
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


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, and 0 where the denominator is 0 (tensor arithmetic: runs under vmap)."""
    nonzero = denominator > 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, torch.ones_like(denominator)),
                       torch.zeros_like(denominator))


def _refuse_biases_and_batch_norm(network: nn.Module) -> None:
    for name, module in network.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError("model.norm", "none (CONST on the weights needs a model without BatchNorm; "
                              "constrained: displacement allows it)", f"{type(module).__name__} at {name}")
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and module.bias is not None:
            raise ConfigError("model.bias", "false (CONST on the weights constrains bias-free conv and linear "
                              "layers; constrained: displacement allows biases)", f"a bias in {name}")
