"""What an algorithm costs a client, declared once on its class beside its rule (`Algorithm.cost`), and
read by the round loop's counters, the sweep's estimate and the docs' table of methods.

The cost is what a deployment of the method spends, not what the simulation does: a client's local
steps, each of `Passes` through the model, and the vectors it sends each way. The simulation may
upload more than a deployment sends (FedAvg-M uploads x - y_i and (x - y_i) / (lr K_i), which the
server derives from the first); the declaration counts what is sent. CONST adds nothing: its
projection is no pass through the model, and its constraint comes from the model the client receives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Passes:
    """Passes through the model of one local step (one query point of CTP-FL)."""

    forward: int = 1
    backward: int = 1
    """Mini-batch gradient evaluations (backward passes through the model)."""


@dataclass(frozen=True)
class Cost:
    """A client's cost of one round, beside the model and its BatchNorm statistics, which every method
    sends down and (averaged by the server) up."""

    passes: Passes = Passes()
    """Per local step."""
    uploads: int = 1
    """Model-sized vectors a client sends up (its update; SCAFFOLD's control change beside it)."""
    sent_down: tuple[str, ...] = ()
    """The server's tensors (`ServerState.tensors`) sent down beside the model (SCAFFOLD's control)."""
    rebuilt_down: tuple[str, ...] = ()
    """The server's tensors that are its last step over a constant (CTP-FL's direction): a client that
    received the model before that step rebuilds them from it and the model it receives now, and one
    that did not receives them; before the first step they are the zeros every client starts from.
    Sent as `sent_down` where the algorithm says the rule does not make them that
    (`Algorithm.rebuilds_from_models`)."""

