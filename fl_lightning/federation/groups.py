"""How a rank computes its clients' updates: one after another, or grouped.

Grouped, a rank's clients advance in lockstep: the algorithm's own `client_update` runs once,
under `torch.func.vmap`, on a `ClientRound` whose tensors are the group's stacked ones (buffers,
state, batches); the global model and the server state stay shared. So a local-update method's
forward and backward passes batch over the clients' parameters, and CTP-FL's, whose clients query
the same points, become one pass over the concatenated batches. No algorithm has code of its own
for this: what vmap cannot run (`.item()`, branching on values) has no place in a client rule.

Where the algorithm allows it (`Algorithm.fuses_clients`: CTP-FL), a group is fused: the rule runs
once, without vmap around it, on a `ClientRound` whose every gradient is the weighted mean of the
group's (`Execution.client_weights`), one backward pass over the concatenated batches. Each client
of the group then contributes the group's mean upload, which the aggregation weighs with the
client's weight, so the sum over the group is the same. A client's own upload is computed, alone on
the same batches, only if a callback reads it (a diagnostic, on its rounds): training is the same
with or without diagnostics.

Clients in one group need batches of one shape at every step. Where the network normalises
per sample (no BatchNorm), a shorter batch is padded with samples of label `PADDING_LABEL`,
which the loss leaves out, and a client with fewer steps than the group's is masked on the rest
(its parameters and momentum stay). With BatchNorm, padding would change the batch statistics:
only clients with the same batch sizes share a group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.clients.run import PADDING_LABEL, ClientRound
from fl_lightning.federation.client_paths import ClientPath, Grouping

Uploads = Mapping[str, torch.Tensor]
Update = tuple[ClientRound, Uploads, Uploads]
Updates = Iterator[Update]
GroupRule = Callable[[Algorithm, list[ClientRound]], list[Update]]


def client_updates(algorithm: Algorithm, clients: Iterable[ClientRound], path: ClientPath,
                   weights: dict[int, float]) -> Updates:
    """Each of one rank's clients this round with what it contributes to the aggregation and its own
    uploads (the same, unless fused), computed as `path` says: in the order given, or group by
    group; fused groups from the clients' aggregation `weights` (by client id)."""
    if not path.grouped:
        for client in clients:
            yield _alone(algorithm, client)
        return
    fused = path.grouping is Grouping.FUSED
    update_group = partial(_fused_updates, weights=weights) if fused else _vectorised_updates
    for group in _groups(list(clients), path.group_size, equal_steps=fused):
        yield from _group_updates(algorithm, group, update_group)


def normalise_batches_in_float32(module: nn.Module) -> None:
    """Make every BatchNorm layer of `module` take float32 inputs: under vmap, batch norm cannot mix
    a bfloat16 or float16 input (mixed precision) with float32 statistics, as it does unbatched
    (where it computes in float32 all the same)."""
    for layer in module.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.register_forward_pre_hook(lambda _, inputs: tuple(x.float() for x in inputs))


def _has_batch_statistics(module: nn.Module) -> bool:
    return any(isinstance(layer, nn.modules.batchnorm._BatchNorm) for layer in module.modules())


def _groups(clients: list[ClientRound], group_size: Optional[int], equal_steps: bool = False
            ) -> list[list[ClientRound]]:
    """Clients that can share a group: the same state entries (an algorithm may branch on whether a
    client has trained before), with BatchNorm the same batch sizes, and fused (`equal_steps`, where
    no step can be masked) the same number of steps. Within that, a group holds at most `group_size`
    clients, and none with fewer than half the steps of its longest, so at most half of a group's
    steps are masked ones."""
    if not clients:
        return []
    pad = not _has_batch_statistics(clients[0].execution.trainer.module)
    kinds: dict[tuple, list[ClientRound]] = {}
    for client in sorted(clients, key=lambda c: -c.num_steps):
        sizes = None if pad else tuple(client.batch_sizes)
        steps = client.num_steps if equal_steps else None
        kinds.setdefault((tuple(sorted(client.state)), sizes, steps), []).append(client)
    size = group_size or len(clients)
    groups: list[list[ClientRound]] = []
    for kind in kinds.values():
        groups.append([kind[0]])
        for client in kind[1:]:
            group = groups[-1]
            if len(group) < size and 2 * client.num_steps >= group[0].num_steps:
                group.append(client)
            else:
                groups.append([client])
    return groups


def _group_updates(algorithm: Algorithm, group: list[ClientRound], update_group: GroupRule) -> Updates:
    if len(group) == 1:
        yield _alone(algorithm, group[0])
        return
    try:
        results = update_group(algorithm, group)
    except torch.cuda.OutOfMemoryError:
        # Nothing was written back yet: the halves start from the same state.
        torch.cuda.empty_cache()
        middle = len(group) // 2
        yield from _group_updates(algorithm, group[:middle], update_group)
        yield from _group_updates(algorithm, group[middle:], update_group)
        return
    except RuntimeError as err:
        if "vmap" not in str(err):
            raise
        raise RuntimeError(
            f"{type(algorithm).__name__}.client_update cannot run grouped under torch.func.vmap: {err}\n"
            "A client rule must be tensor arithmetic to run grouped (docs/extending.md); "
            "compute.client_path: loop runs it client by client.") from err
    yield from results


def _alone(algorithm: Algorithm, client: ClientRound) -> Update:
    uploads = algorithm.client_update(client)
    return client, uploads, uploads


def _vectorised_updates(algorithm: Algorithm, group: list[ClientRound]) -> list[Update]:
    """Every client of `group` updated together; writes each client's state, buffers and losses
    back as if it had run alone, and returns its uploads."""
    first = group[0]
    steps = [client.num_steps for client in group]
    inputs, labels = _stacked_batches(group, max(steps))
    num_steps = steps[0] if len(set(steps)) == 1 else torch.tensor(steps, device=inputs.device)
    active_steps = None
    if not isinstance(num_steps, int):
        active_steps = torch.arange(max(steps), device=inputs.device) < num_steps[:, None]
    state = {name: torch.stack([client.state[name] for client in group]) for name in first.state}
    buffers = torch.stack([client.buffers for client in group])

    def one_client(inputs, labels, buffers, state, num_steps, active_steps):
        execution = dataclasses.replace(first.execution, batches=list(zip(inputs, labels)), vectorised=True,
                                        active_steps=active_steps)
        client = dataclasses.replace(first, buffers=buffers, state=dict(state), num_steps=num_steps, losses=[],
                                     execution=execution)
        uploads = algorithm.client_update(client)
        return uploads, client.state, client.buffers, torch.stack(client.losses)

    per_client = (0, 0, 0, 0, None if isinstance(num_steps, int) else 0, None if active_steps is None else 0)
    uploads, new_state, new_buffers, losses = torch.func.vmap(
        one_client, in_dims=per_client, randomness="different")(inputs, labels, buffers, state, num_steps, active_steps)
    results = []
    for index, client in enumerate(group):
        client.state.update({name: value[index] for name, value in new_state.items()})
        client.buffers = new_buffers[index]
        client.losses = list(losses[index, :client.num_steps])
        own = {name: value[index] for name, value in uploads.items()}
        results.append((client, own, own))
    return results


def _fused_updates(algorithm: Algorithm, group: list[ClientRound], weights: dict[int, float]) -> list[Update]:
    """`group` as one fused client (equal steps, stateless): writes each client's buffers and losses
    back as if it had run alone; each contributes the group's `weights`-weighted mean uploads."""
    first = group[0]
    inputs, labels = _stacked_batches(group, first.num_steps)
    # As each client starts the round (its batches are made now): what its own uploads are computed from.
    starts = [dataclasses.replace(client, losses=[]) for client in group]
    group_weights = torch.tensor([weights[client.client_id] for client in group], device=inputs.device)
    execution = dataclasses.replace(first.execution, batches=list(zip(inputs.unbind(1), labels.unbind(1))),
                                    client_weights=group_weights / group_weights.sum())
    fused = dataclasses.replace(first, buffers=torch.stack([client.buffers for client in group]), losses=[],
                                execution=execution)
    uploads = algorithm.client_update(fused)
    losses = torch.stack(fused.losses, dim=1)
    for index, client in enumerate(group):
        client.buffers = fused.buffers[index]
        client.losses = list(losses[index])
    return [(client, uploads, OwnUploads(algorithm, start)) for client, start in zip(group, starts)]


class OwnUploads(Mapping):
    """A fused client's own uploads, computed on first access: its rule run alone from its start of
    the round on the same batches, leaving the global random stream as it was (dropout)."""

    def __init__(self, algorithm: Algorithm, start: ClientRound):
        self._algorithm, self._start = algorithm, start
        self._uploads: Optional[dict[str, torch.Tensor]] = None

    def _computed(self) -> dict[str, torch.Tensor]:
        if self._uploads is None:
            device = self._start.global_params.device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                self._uploads = self._algorithm.client_update(self._start)
        return self._uploads

    @property
    def computed(self) -> bool:
        """Whether the uploads were computed already (a diagnostic counts the passes that compute them)."""
        return self._uploads is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._computed()[name]

    def __iter__(self):
        return iter(self._computed())

    def __len__(self) -> int:
        return len(self._computed())


def _stacked_batches(group: list[ClientRound], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[clients, steps, batch, ...] images and labels; a client's shorter batches are padded with
    `PADDING_LABEL` samples, and its steps beyond its own repeat its first batch (masked)."""
    batch_size = max(size for client in group for size in client.batch_sizes)
    stacked_inputs, stacked_labels = [], []
    for client in group:
        batches = list(client.batches())
        batches += [batches[0]] * (steps - len(batches))
        for inputs, labels in batches:
            missing = batch_size - len(labels)
            stacked_inputs.append(torch.cat([inputs, inputs.new_zeros((missing, *inputs.shape[1:]))]))
            stacked_labels.append(torch.cat([labels, labels.new_full((missing,), PADDING_LABEL)]))
    shape = (len(group), steps, batch_size)
    return (torch.stack(stacked_inputs).view(*shape, *stacked_inputs[0].shape[1:]),
            torch.stack(stacked_labels).view(shape))
