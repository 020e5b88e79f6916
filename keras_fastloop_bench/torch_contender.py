"""The default bench's CNN in PyTorch (eager): what a user might pick instead of Keras.

A contender only where PyTorch is installed (it is not a dependency: `pip install torch`). It
trains the same network as `default.build_cnn` from the same initial weights (converted from
the Keras model's, `keras_weights_to_torch`), on the batches `fit` trains, in the same order
(`default.Data.train_epochs`, read as NumPy), with the same loss (mean sparse cross-entropy),
validation after every epoch, and Adam made to take Keras' steps (`keras_adam`). It runs on
PyTorch's GPU where it has one, else on the CPU. With `bf16=True` the forward and backward run
under `torch.autocast(device, dtype=torch.bfloat16)`, PyTorch's mixed precision.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

__all__ = [
    "keras_adam",
    "keras_weights_to_torch",
    "torch_available",
    "torch_cnn",
    "torch_contender",
]


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


def keras_adam(parameters, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """`torch.optim.Adam` that takes `keras.optimizers.Adam`'s steps (its defaults here).

    Keras folds both bias corrections into the step size and adds `epsilon` to the
    *uncorrected* `sqrt(v)`; PyTorch adds it to the corrected `sqrt(v / (1 - beta_2**t))`. The
    two agree when PyTorch's epsilon at step `t` is `epsilon / sqrt(1 - beta_2**t)`, which
    `step` sets before each update (Kingma & Ba, "Adam", ICLR 2015, section 2 gives this
    rearrangement of the update).

    Returns:
        A `torch.optim.Adam` whose `step` updates the epsilon of every parameter group first.
    """
    import torch

    class KerasAdam(torch.optim.Adam):
        def step(self, closure=None):
            self.keras_steps = getattr(self, "keras_steps", 0) + 1
            for group in self.param_groups:
                group["eps"] = epsilon / (1.0 - beta_2**self.keras_steps) ** 0.5
            return super().step(closure)

    return KerasAdam(parameters, lr=learning_rate, betas=(beta_1, beta_2), eps=epsilon)


def torch_contender(data, learning_rate=1e-3, bf16=False):
    """A contender `train(run)` for `bench.harness`: the CNN in eager PyTorch.

    Sets `run.extra["device"]` to the device it trained on (`"cuda"` or `"cpu"`).
    """

    def train(run):
        import torch
        import torch.nn.functional as F

        device = "cuda" if torch.cuda.is_available() else "cpu"
        run.extra["device"] = device
        model = torch_cnn().to(device)
        with torch.no_grad():
            for parameter, value in zip(
                model.parameters(), keras_weights_to_torch(run.initial_weights)
            ):
                parameter.copy_(torch.from_numpy(value))
        optimizer = keras_adam(model.parameters(), learning_rate)
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)

        def batches(dataset):
            for x, y in dataset.as_numpy_iterator():
                # tf.data hands out read-only arrays; PyTorch wants writable ones.
                x = torch.from_numpy(x.copy()).permute(0, 3, 1, 2).to(device)
                yield x, torch.from_numpy(y.copy()).long().to(device)

        def validate():
            model.eval()
            correct = total = 0
            with torch.no_grad(), autocast:
                for x, y in batches(data.val()):
                    correct += int((model(x).argmax(1) == y).sum())
                    total += len(y)
            model.train()
            return correct / total

        for epoch_data in data.train_epochs(run.epochs):
            loss_sum = samples = 0.0
            t0 = time.perf_counter()
            for x, y in batches(epoch_data):
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
