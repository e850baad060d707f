"""Batched augmentation and normalisation of uint8 images where they already lie (CPU or GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class DeviceTransform:
    """uint8 images on the device -> normalised float batch; optional pad-crop and horizontal flip, batched.

    With `augment` and crops from `draw_crops`, each image is zero-padded by `crop_padding` on
    every side, a window of the original size is cut at a random offset in [0, 2 * crop_padding]
    per axis, and the window is mirrored left-right with probability 1/2. The random numbers are
    drawn on the CPU from a generator, so a seed gives the same augmentations on any device.
    Without crops (evaluation) images are only normalised.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], augment: bool, crop_padding: int = 4):
        if len(mean) != len(std):
            raise ValueError(f"mean and std need one value per channel, got {len(mean)} and {len(std)}")
        self.mean = tuple(float(value) for value in mean)
        self.std = tuple(float(value) for value in std)
        self.augment = augment
        self.crop_padding = crop_padding
        self._scale_and_shift: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor, crops: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """Normalised `images`, augmented with `crops` (from `draw_crops`) when augmenting."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != len(self.mean):
            raise ValueError(
                f"expected uint8 images [B, {len(self.mean)}, H, W], got {images.dtype} {tuple(images.shape)}"
            )
        if self.augment and crops is not None:
            images = self._crop_and_flip(images, crops)
        scale, shift = self._constants(images.device)
        # (x / 255 - mean) / std as one multiply-add.
        return torch.addcmul(shift, images.float(), scale)

    def draw_crops(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The random numbers of one batch's augmentation, on the CPU: row offsets, column offsets
        and flips. Drawn in this order; the stream is part of a run's reproducibility."""
        span = 2 * self.crop_padding + 1
        row_offsets = torch.randint(0, span, (batch,), generator=generator)
        column_offsets = torch.randint(0, span, (batch,), generator=generator)
        flips = torch.rand(batch, generator=generator) < 0.5
        return row_offsets, column_offsets, flips

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._scale_and_shift:
            mean = torch.tensor(self.mean, dtype=torch.float64)
            std = torch.tensor(self.std, dtype=torch.float64)
            scale = (1 / (255 * std)).float().view(1, -1, 1, 1).to(device)
            shift = (-mean / std).float().view(1, -1, 1, 1).to(device)
            self._scale_and_shift[device] = (scale, shift)
        return self._scale_and_shift[device]

    def _crop_and_flip(self, images: torch.Tensor, crops: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                       ) -> torch.Tensor:
        batch, channels, height, width = images.shape
        padding = self.crop_padding
        row_offsets, column_offsets, flips = (draw.to(images.device, non_blocking=True) for draw in crops)
        device = images.device
        rows = row_offsets[:, None] + torch.arange(height, device=device)
        columns = column_offsets[:, None] + torch.arange(width, device=device)
        columns = torch.where(flips[:, None], columns.flip(1), columns)

        padded = F.pad(images, (padding, padding, padding, padding))
        cropped_rows = padded.gather(2, rows[:, None, :, None].expand(batch, channels, height, width + 2 * padding))
        return cropped_rows.gather(3, columns[:, None, None, :].expand(batch, channels, height, width))
