"""The clients of a rank: what a client's update works with (`ClientRun`, `LocalSGD`, in
`fl_lightning.clients.run`), the trainer that builds them (`fl_lightning.clients.trainer`), how a
rank's clients run (`fl_lightning.clients.paths`) and their grouped execution
(`fl_lightning.clients.groups`). An algorithm imports what it needs from here."""

from fl_lightning.clients.run import PADDING_LABEL, Batch, ClientRun, LocalSGD, clip_to_norm

__all__ = ["PADDING_LABEL", "Batch", "ClientRun", "LocalSGD", "clip_to_norm"]
