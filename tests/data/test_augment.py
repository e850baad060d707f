import pytest
import torch

from fl_lightning.data import DeviceTransform

MEAN = (0.5, 0.4, 0.3)
STD = (0.25, 0.2, 0.3)


def crops(transform, images, seed):
    return transform.draw_crops(len(images), torch.Generator().manual_seed(seed))


def random_images(batch=16, height=6, width=10, seed=0):
    """Non-square, so a mix-up of rows and columns shows."""
    return torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def normalise(images):
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (images.float() / 255 - mean) / std


def same_images(first, second):
    """Per image: whether all its values agree up to float rounding."""
    return torch.isclose(first, second, atol=1e-5).flatten(1).all(1)


def test_without_crops_only_normalises():
    images = random_images()
    output = DeviceTransform(MEAN, STD, augment=True)(images)
    assert output.dtype == torch.float32 and output.shape == images.shape
    torch.testing.assert_close(output, normalise(images))


def test_augment_off_ignores_the_crops():
    images = random_images()
    transform = DeviceTransform(MEAN, STD, augment=False)
    output = transform(images, crops(transform, images, 0))
    torch.testing.assert_close(output, normalise(images))


def test_same_seed_same_augmentation_other_seed_differs():
    images = random_images(batch=32)
    transform = DeviceTransform(MEAN, STD, augment=True)
    first = transform(images, crops(transform, images, 3))
    again = transform(images, crops(transform, images, 3))
    other = transform(images, crops(transform, images, 4))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_augmentation_changes_most_images():
    images = random_images(batch=64)
    transform = DeviceTransform(MEAN, STD, augment=True)
    output = transform(images, crops(transform, images, 0))
    unchanged = same_images(output, normalise(images))
    # unchanged only for the centre crop without flip: 1 in 2 * 9 * 9
    assert unchanged.sum() < 8


def reference_candidates(image, padding):
    """Every (row offset, column offset, flip) and its result, by a plain loop over one image."""
    channels, height, width = image.shape
    padded = torch.zeros(channels, height + 2 * padding, width + 2 * padding, dtype=image.dtype)
    padded[:, padding:padding + height, padding:padding + width] = image
    for row in range(2 * padding + 1):
        for column in range(2 * padding + 1):
            crop = padded[:, row:row + height, column:column + width]
            yield (row, column, False), crop
            yield (row, column, True), crop.flip(-1)


def test_crops_and_flips_match_a_per_image_reference():
    padding = 2
    images = random_images(batch=96, seed=1)
    # mean 0 and std 1/255 leave pixel values as they are
    transform = DeviceTransform((0.0,) * 3, (1 / 255,) * 3, augment=True, crop_padding=padding)
    output = transform(images, crops(transform, images, 11)).round().to(torch.uint8)

    chosen = []
    for image, augmented in zip(images, output):
        matches = [params for params, candidate in reference_candidates(image, padding)
                   if torch.equal(candidate, augmented)]
        assert len(matches) == 1
        chosen.append(matches[0])
    rows, columns, flips = zip(*chosen)
    assert set(rows) == set(columns) == set(range(2 * padding + 1))
    assert set(flips) == {False, True}
    assert any(row != column for row, column in zip(rows, columns))  # drawn independently


def test_zero_padding_only_flips():
    images = random_images(batch=32)
    transform = DeviceTransform(MEAN, STD, augment=True, crop_padding=0)
    output = transform(images, crops(transform, images, 0))
    plain, mirrored = normalise(images), normalise(images.flip(-1))
    is_plain = same_images(output, plain)
    is_mirrored = same_images(output, mirrored)
    assert (is_plain | is_mirrored).all()
    assert is_plain.any() and is_mirrored.any()


def test_rejects_float_images():
    with pytest.raises(ValueError, match="uint8"):
        DeviceTransform(MEAN, STD, augment=False)(torch.zeros(2, 3, 4, 4))
