"""What an algorithm's client rule works with: a client's share of a round (`ClientRound`), an
explicit local SGD (`LocalSGD`), its batches (in `fl_lightning.clients.run`). An algorithm imports
what it needs from here; the trainer that builds a rank's `ClientRound`s and how the rank computes
them (one by one, or grouped) are the federation's (`fl_lightning.federation`)."""

from fl_lightning.clients.run import PADDING_LABEL, Batch, ClientRound, LocalSGD, clip_to_norm

__all__ = ["PADDING_LABEL", "Batch", "ClientRound", "LocalSGD", "clip_to_norm"]
