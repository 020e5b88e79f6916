"""`keras-fastloop bench --suite resnet`: a compute-bound ResNet-20 on 32x32 images.

ResNet-20 (He et al., 2016, "Deep Residual Learning for Image Recognition", the CIFAR
variant: 3 stages of 3 basic blocks, 16/32/64 filters, global average pooling) trained on
scikit-learn's digits upsampled to 32x32 (real data, no download; a stratified 20 % held out).
BatchNormalization uses `momentum=0.9`, so its moving statistics follow the weights within an
epoch of 23 steps and the validation accuracy means something after a few epochs (Keras'
default 0.99 lags ~100 steps behind). Contenders: plain `fit` in float32 (the baseline), `fit`
at the recommended policy with `steps_per_execution` 1, 8 and 32 (Keras at its best: the
fastest of them), Keras on JAX in its own process where jax imports, and `OptimizedModel` with
the recommended setup.
"""

from __future__ import annotations

from pathlib import Path

import keras
import tensorflow as tf

from keras_fastloop.datasets.digits import load_digits_data
from keras_fastloop_bench import stock, workloads

BATCH_SIZE = 64
LEARNING_RATE = 1e-3
IMAGE_SIZE = 32


def build_resnet20(model_cls=keras.Model, image_size=IMAGE_SIZE, num_classes=10, momentum=0.9):
    """ResNet-20 for `(image_size, image_size, 1)` inputs; float32 softmax head.

    Args:
        model_cls: `keras.Model` or a subclass (e.g. `OptimizedModel`).
        image_size: int, input height and width. Defaults to 32.
        num_classes: int. Defaults to 10.
        momentum: float, BatchNormalization's momentum. Defaults to 0.9.
    """

    def conv_bn(h, filters, kernel, strides=1, relu=True):
        h = keras.layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization(momentum=momentum)(h)
        return keras.layers.ReLU()(h) if relu else h

    inputs = keras.Input((image_size, image_size, 1))
    h = conv_bn(inputs, 16, 3)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage and not block else 1
            y = conv_bn(h, filters, 3, strides)
            y = conv_bn(y, filters, 3, relu=False)
            shortcut = h if strides == 1 else conv_bn(h, filters, 1, strides, relu=False)
            h = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(h)
    return model_cls(inputs, outputs)


def workload(quick=False):
    """The `Workload` and its NumPy arrays (`x`, `y`, `x_val`, `y_val`)."""
    (x, y), (x_val, y_val) = load_digits_data(image_size=IMAGE_SIZE)
    if quick:
        x, y, x_val, y_val = x[:128], y[:128], x_val[:64], y_val[:64]
    size = 16 if quick else IMAGE_SIZE

    if quick:  # tiny images for tests
        x = tf.image.resize(x, (size, size)).numpy()
        x_val = tf.image.resize(x_val, (size, size)).numpy()

    def train():
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shuffle(len(x), seed=0, reshuffle_each_iteration=True)
        return ds.batch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE)

    def val():
        return (
            tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(256).prefetch(tf.data.AUTOTUNE)
        )

    w = workloads.Workload(
        build=lambda model_cls=keras.Model: build_resnet20(model_cls, image_size=size),
        train=train,
        val=val,
        samples=len(x),
        learning_rate=LEARNING_RATE,
    )
    return w, {"x": x, "y": y, "x_val": x_val, "y_val": y_val}


def run(
    out_dir: Path,
    quick: bool = False,
    rounds: int | None = None,
    epochs: int | None = None,
    jax: bool = True,
    progress=print,
) -> dict:
    """Run the ResNet-20 suite; write `resnet.md`, `resnet.json`, `resnet.png` under `out_dir`.

    Args:
        out_dir: folder for the report (created if missing).
        quick: 128 images at 16x16, 2 epochs, 1 round (tests).
        rounds: alternating rounds. Default 2 (1 when `quick`).
        epochs: epochs per run. Default 4 (2 when `quick`).
        jax: bool, add Keras on JAX where jax imports in a child. Default True.
        progress: callable receiving progress lines. Default `print`.

    Returns:
        JSON-able dict with `rows` and `markdown`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = rounds or (1 if quick else 2)
    epochs = epochs or (2 if quick else 4)
    w, arrays = workload(quick)
    policy = workloads.default_policy()
    keras.utils.set_random_seed(0)
    initial = w.build().get_weights()
    contenders = workloads.base_contenders(w, policy)
    notes = []
    if jax:
        contenders.update(
            stock.jax_contenders(w.build, arrays, policy, BATCH_SIZE, LEARNING_RATE, notes)
        )
    progress(f"[resnet] {w.samples} images, policy {policy}, {epochs} epochs x {rounds} rounds")
    header = (
        f"ResNet-20 (BatchNorm momentum 0.9) on scikit-learn digits upsampled to "
        f"{arrays['x'].shape[1]}x{arrays['x'].shape[2]} ({w.samples} train / "
        f"{len(arrays['x_val'])} validation images), batch {BATCH_SIZE}, Adam {LEARNING_RATE}, "
        f"recommended policy `{policy}` (hardware rule),"
    )
    return workloads.run_suite(
        "resnet",
        w,
        contenders,
        [workloads.RECOMMENDED],
        initial,
        epochs,
        rounds,
        out_dir,
        header,
        notes,
        progress,
    )
