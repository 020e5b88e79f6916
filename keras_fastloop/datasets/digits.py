"""scikit-learn's handwritten digits (1,797 real 8x8 images, bundled, no download)."""

from __future__ import annotations

import numpy as np

from keras_fastloop import _validation


def load_digits_data(
    image_size: int = 16, validation_fraction: float = 0.2, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The digits data set as float32 images in [0, 1], split into train and validation.

    Args:
        image_size: int, side of the square images returned (8 = original; 16 or more are
            upsampled by pixel repetition, so a small CNN has something to convolve). Must be a
            positive multiple of 8. Default 16.
        validation_fraction: float in (0, 1), share of images held out (stratified by class).
            Default 0.2.
        seed: int, seed of the split. Default 0.

    Returns:
        `((x_train, y_train), (x_val, y_val))`: images of shape `(n, image_size,
        image_size, 1)` float32 and integer labels 0-9 of shape `(n,)` int32.

    Raises:
        ValueError: if `image_size` is not a positive multiple of 8 or
            `validation_fraction` is outside (0, 1).
        ImportError: if scikit-learn is not installed (`pip install "keras-fastloop[datasets]"`).
    """
    _validation.check(
        _validation.is_int(image_size) and image_size >= 8 and image_size % 8 == 0,
        "image_size",
        "a positive multiple of 8",
        image_size,
    )
    image_size = int(image_size)
    if not (_validation.is_real(validation_fraction) and 0 < validation_fraction < 1):
        raise ValueError(
            "`validation_fraction` must be in (0, 1). "
            f"Received: validation_fraction={validation_fraction!r}"
        )
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "`load_digits_data` reads scikit-learn's bundled digits, and scikit-learn is not "
            'installed. Install it with `pip install "keras-fastloop[datasets]"` '
            "(or `pip install scikit-learn`)."
        ) from error

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")
    factor = image_size // 8
    images = np.repeat(np.repeat(images, factor, axis=1), factor, axis=2)[..., None]
    labels = digits.target.astype("int32")
    rng = np.random.default_rng(seed)
    val_idx = []
    for c in range(10):
        members = np.flatnonzero(labels == c)
        val_idx.extend(
            rng.choice(members, int(round(len(members) * validation_fraction)), replace=False)
        )
    val_mask = np.zeros(len(labels), bool)
    val_mask[val_idx] = True
    train_order = rng.permutation(np.flatnonzero(~val_mask))
    val_order = np.sort(np.flatnonzero(val_mask))
    return (images[train_order], labels[train_order]), (images[val_order], labels[val_order])
