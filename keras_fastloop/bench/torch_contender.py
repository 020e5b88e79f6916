"""The default bench's CNN in PyTorch (eager): what a user might pick instead of Keras.

A contender only where PyTorch is installed (it is not a dependency: `pip install torch`). It
trains the same network as `default.build_cnn` from the same initial weights (converted from
the Keras model's, `keras_weights_to_torch`), on the same batches in the same order (the
same tf.data pipeline, read as NumPy), with the same optimizer (Adam, learning rate 1e-3,
epsilon 1e-7 as Keras'), the same loss (mean sparse cross-entropy) and validation after every
epoch. With `bf16=True` the forward and backward run under
`torch.autocast("cpu", dtype=torch.bfloat16)`, PyTorch's CPU mixed precision.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

__all__ = ["keras_weights_to_torch", "torch_available", "torch_contender", "torch_cnn"]


def torch_available() -> bool:
    """True when PyTorch can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def torch_cnn(image_size=16, num_classes=10):
    """`default.build_cnn`'s network as a `torch.nn.Sequential`, channels first (NCHW).

    Its output is logits (`torch.nn.functional.cross_entropy` applies the softmax).
    """
    from torch import nn

    pooled = image_size // 4
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * pooled * pooled, num_classes),
    )


def keras_weights_to_torch(weights, image_size=16):
    """`default.build_cnn(...).get_weights()` as the parameters of `torch_cnn`, in its order.

    Args:
        weights: list of 8 NumPy arrays: three (kernel `(3, 3, in, out)`, bias) pairs of the
            convolutions, then the dense kernel `(H * W * 64, classes)` and bias.
        image_size: int, the input's side (the dense layer sees `image_size // 4` per side).

    Returns:
        A list of 8 float32 arrays: convolution kernels as `(out, in, 3, 3)`, and the dense
        kernel as `(classes, 64 * H * W)` with its rows reordered from Keras' channels-last
        flattening `(h, w, c)` to PyTorch's channels-first `(c, h, w)`.

    Raises:
        ValueError: if `weights` does not have the 8 arrays of that network.
    """
    if len(weights) != 8:
        raise ValueError(
            "`weights` must be the 8 arrays of `default.build_cnn`. "
            f"Received: {len(weights)} arrays"
        )
    pooled = image_size // 4
    out = []
    for kernel, bias in zip(weights[0:6:2], weights[1:6:2]):
        out += [np.transpose(kernel, (3, 2, 0, 1)), bias]
    dense, bias = weights[6], weights[7]
    channels = dense.shape[0] // (pooled * pooled)
    dense = dense.reshape(pooled, pooled, channels, -1).transpose(2, 0, 1, 3)
    out += [dense.reshape(channels * pooled * pooled, -1).T, bias]
    return [np.ascontiguousarray(w, dtype="float32") for w in out]


def torch_contender(data, learning_rate=1e-3, bf16=False):
    """A contender `train(run)` for `bench.harness`: the CNN in eager PyTorch."""

    def train(run):
        import torch
        import torch.nn.functional as F

        model = torch_cnn()
        with torch.no_grad():
            for parameter, value in zip(
                model.parameters(), keras_weights_to_torch(run.initial_weights)
            ):
                parameter.copy_(torch.from_numpy(value))
        optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, eps=1e-7)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

        def batches(dataset):
            for x, y in dataset.as_numpy_iterator():
                # tf.data hands out read-only arrays; PyTorch wants writable ones.
                yield (
                    torch.from_numpy(x.copy()).permute(0, 3, 1, 2),
                    torch.from_numpy(y.copy()).long(),
                )

        def validate():
            model.eval()
            correct = total = 0
            with torch.no_grad(), autocast:
                for x, y in batches(data.val()):
                    correct += int((model(x).argmax(1) == y).sum())
                    total += len(y)
            model.train()
            return correct / total

        for _ in range(run.epochs):
            loss_sum = samples = 0.0
            t0 = time.perf_counter()
            for x, y in batches(data.train()):
                optimizer.zero_grad(set_to_none=True)
                with autocast:
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                optimizer.step()
                loss_sum += loss.item() * len(y)
                samples += len(y)
            seconds = time.perf_counter() - t0
            validate()
            run.epoch_done(loss_sum / samples, seconds, int(samples))
        run.finish(validate())

    return train
