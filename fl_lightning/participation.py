"""Who can take part in a round (`federation.participation`): the clients online in each round, from
which the round draws its `clients_per_round` (all of them when fewer are online).

A participation model is hyper-parameters only, chosen like an algorithm (a short name, a class name
or a class path, with `init_args`). Its draws come from generators the round loop gives it, seeded by
(the run's seed, a stream of its own[, round]) and never by rank: the same online clients on any
number of ranks and after a resume, and no random number taken from the data split, the client
sampling or the mini-batches.

- `uniform`: every client online every round (the default; the round's draw as it always was);
- `availability`: client i online in a round with probability p_i: one value for all, or values
  drawn once per run from a Beta(a, b);
- `cyclic`: the clients in G fixed groups (drawn once per run), group r mod G online in round r
  (cyclic client participation, Cho et al. 2023);
- `trace`: a text file of the clients online in each round, one line per round (client ids
  separated by spaces or commas; an empty line: nobody online), repeated from its start when the
  run has more rounds than it has lines.

How much of its work a client does is `federation.stragglers` (`Stragglers`): the local steps of
each client-round, from a speed class per client, a jitter per round and a deadline.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, ClassVar, Optional

import numpy as np

from fl_lightning.configurable import FrozenConfigurable
from fl_lightning.errors import ConfigError

FIELD = "federation.participation"
SHORT_NAMES: dict[str, type["Participation"]] = {}

Draws = Callable[..., np.random.Generator]
"""`draws(*keys)`: a generator of the run's participation stream for `keys` (a round, or none for the
run's draws made once), the same on every rank."""


class Participation(FrozenConfigurable):
    """Base class: `online` names the clients that can take part in a round."""

    short_name: ClassVar[str] = ""
    """The name `federation.participation` accepts for the class."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("short_name"):
            SHORT_NAMES[cls.short_name] = cls

    def check(self, num_clients: int) -> None:
        """Refuse settings that do not fit a federation of `num_clients` (ConfigError), before any round."""

    def online(self, round_index: int, num_clients: int, draws: Draws) -> Sequence[int]:
        """The clients online in round `round_index` (0-based), ascending."""
        raise NotImplementedError


class Uniform(Participation):
    """Every client online every round: the round draws its clients uniformly from all of them."""

    short_name = "uniform"

    def online(self, round_index: int, num_clients: int, draws: Draws) -> Sequence[int]:
        return range(num_clients)  # not a list: a million clients would cost tens of megabytes a round


class Availability(Participation):
    """Client i is online in a round with probability p_i, independently of the other clients and of
    its other rounds."""

    short_name = "availability"

    def __init__(self, probability: Optional[float] = None, beta: Optional[tuple[float, float]] = None):
        """
        Args:
            probability: p_i of every client, in (0, 1].
            beta: (a, b), both > 0: each client's p_i drawn once per run from Beta(a, b) (mean a / (a + b)).
                Set exactly one of probability and beta.
        """
        if (probability is None) == (beta is None):
            raise ConfigError(f"{FIELD}.init_args", "exactly one of probability and beta set",
                              {"probability": probability, "beta": beta})
        if probability is not None and not 0 < probability <= 1:
            raise ConfigError(f"{FIELD}.init_args.probability", "a probability in (0, 1]", probability)
        if beta is not None and not (len(beta) == 2 and all(np.isfinite(v) and v > 0 for v in beta)):
            raise ConfigError(f"{FIELD}.init_args.beta", "two finite numbers > 0, [a, b]", beta)
        self.probability = probability
        self.beta = None if beta is None else (float(beta[0]), float(beta[1]))

    def probabilities(self, num_clients: int, draws: Draws) -> np.ndarray:
        """Each client's p_i: the same in every round of a run."""
        if self.beta is None:
            return np.full(num_clients, self.probability)
        return draws().beta(*self.beta, size=num_clients)

    def online(self, round_index: int, num_clients: int, draws: Draws) -> list[int]:
        uniform = draws(round_index).random(num_clients)
        return np.flatnonzero(uniform < self.probabilities(num_clients, draws)).tolist()


class Cyclic(Participation):
    """The clients in `groups` fixed groups of near-equal size (a random split drawn once per run);
    in round r the group r mod G is online."""

    short_name = "cyclic"

    def __init__(self, groups: int = 2):
        """
        Args:
            groups: G, the number of groups, from 1 to federation.num_clients.
        """
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ConfigError(f"{FIELD}.init_args.groups", "a positive integer", groups)
        self.groups = groups

    def check(self, num_clients: int) -> None:
        if self.groups > num_clients:
            raise ConfigError(f"{FIELD}.init_args.groups",
                              f"at most federation.num_clients ({num_clients}), so that no group is empty", self.groups)

    def client_groups(self, num_clients: int, draws: Draws) -> list[list[int]]:
        """The G groups, each ascending; the same in every round of a run."""
        split = np.array_split(draws().permutation(num_clients), self.groups)
        return [sorted(group.tolist()) for group in split]

    def online(self, round_index: int, num_clients: int, draws: Draws) -> list[int]:
        return self.client_groups(num_clients, draws)[round_index % self.groups]


class Trace(Participation):
    """The clients online in each round read from a file (a measured trace), repeated from its first
    line once its lines are used up."""

    short_name = "trace"

    def __init__(self, path: str):
        """
        Args:
            path: a text file with one line per round: the ids of the clients online in that round,
                separated by spaces or commas (an empty line: nobody).
        """
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{FIELD}.init_args.path", "a readable text file of client ids per round",
                              f"{path} ({err})") from err
        rounds = []
        for number, line in enumerate(lines, 1):
            ids = [token for token in re.split(r"[\s,]+", line.strip()) if token]
            if not all(token.isdigit() for token in ids):
                raise ConfigError(f"{FIELD}.init_args.path", "lines of client ids (integers >= 0)",
                                  f"{path} line {number}: {line!r}")
            rounds.append(tuple(sorted({int(token) for token in ids})))
        if not rounds:
            raise ConfigError(f"{FIELD}.init_args.path", "a file of at least one line (one per round)",
                              f"{path} (empty)")
        self.path = path
        self.rounds = tuple(rounds)

    def check(self, num_clients: int) -> None:
        for number, clients in enumerate(self.rounds, 1):
            if clients and clients[-1] >= num_clients:
                raise ConfigError(f"{FIELD}.init_args.path",
                                  f"client ids below federation.num_clients ({num_clients})",
                                  f"{self.path} line {number} names client {clients[-1]}")

    def online(self, round_index: int, num_clients: int, draws: Draws) -> list[int]:
        return list(self.rounds[round_index % len(self.rounds)])


class Stragglers(FrozenConfigurable):
    """Unequal local work: client i does ceil(K_i * s_i * j) of its K_i planned steps in a round, at most
    `deadline`, with s_i its speed class (one of `speeds`, drawn once per run) and j a jitter drawn per
    client and round, uniform in [1 - jitter, 1]."""

    def __init__(self, speeds: tuple[float, ...] = (1.0,), jitter: float = 0.0, deadline: Optional[int] = None):
        """
        Args:
            speeds: the speed classes, each in (0, 1] (the share of its planned steps a client of the
                class does); each client's class is drawn uniformly once per run.
            jitter: in [0, 1): each client-round does a further share uniform in [1 - jitter, 1].
            deadline: the most local steps any client does in a round (an integer > 0), or null.
        """
        field = "federation.stragglers.init_args"
        if not speeds or not all(isinstance(v, (int, float)) and 0 < v <= 1 for v in speeds):
            raise ConfigError(f"{field}.speeds", "a list of shares in (0, 1]", speeds)
        if not 0 <= jitter < 1:
            raise ConfigError(f"{field}.jitter", "a share in [0, 1)", jitter)
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int) or deadline < 1):
            raise ConfigError(f"{field}.deadline", "an integer > 0 or null", deadline)
        self.speeds = tuple(float(v) for v in speeds)
        self.jitter = float(jitter)
        self.deadline = deadline

    def steps(self, planned: int, speed_draw: np.random.Generator, round_draw: np.random.Generator) -> int:
        """The steps a client planning `planned` does: its class from `speed_draw` (its draw of the run),
        its jitter from `round_draw` (its draw of the round); at least 1."""
        speed = self.speeds[speed_draw.integers(len(self.speeds))]
        share = speed * (1 - self.jitter * round_draw.random())
        done = max(1, math.ceil(planned * share - 1e-9))  # a share of exactly 1/2 of 4 steps is 2
        return done if self.deadline is None else min(done, self.deadline)
