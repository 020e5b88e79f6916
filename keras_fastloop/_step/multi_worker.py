"""The step's outputs under `MultiWorkerMirroredStrategy` (keras-team/keras#20585; traced).

Keras reduces each step output with `strategy.reduce("MEAN", v, axis=0)` under
`MultiWorkerMirroredStrategy`, which fails for scalars. `make_function` packs the outputs into
one `(1, K)` float64 tensor inside the compiled step and unpacks them after it. The eager half
of the correction (the build from the first local batch) is `keras_fastloop._fit_callbacks`.
"""

from __future__ import annotations

import tensorflow as tf

from keras_fastloop import _keras_internals as internals


def is_multi_worker(strategy) -> bool:
    """Whether `strategy` is a `MultiWorkerMirroredStrategy` (whose step outputs Keras mis-reduces).

    Args:
        strategy: a `tf.distribute.Strategy`.

    Returns:
        A bool.

    Example:
        >>> is_multi_worker(tf.distribute.get_strategy())
        False
    """
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


class _OutputPacker:
    """Packs a step's outputs into one `(1, K)` float64 tensor and back (trace-time spec)."""

    def __init__(self):
        self.structure = None
        self.specs = None

    def pack(self, outputs):
        flat = tf.nest.flatten(outputs)
        specs = []
        for t in flat:
            t = tf.convert_to_tensor(t)
            if not t.shape.is_fully_defined():
                raise ValueError(
                    "Under MultiWorkerMirroredStrategy every output of the step must have a "
                    f"static shape. Received: an output of shape {t.shape}"
                )
            specs.append((t.shape, t.dtype))
        self.structure = outputs
        self.specs = specs
        parts = [tf.reshape(tf.cast(t, tf.float64), [-1]) for t in flat]
        packed = tf.concat(parts, axis=0) if parts else tf.zeros([0], tf.float64)
        return packed[None, :]

    def unpack(self, packed):
        packed = tf.reshape(packed, [-1])
        values, start = [], 0
        for shape, dtype in self.specs:
            size = shape.num_elements()
            values.append(tf.cast(tf.reshape(packed[start : start + size], shape), dtype))
            start += size
        return tf.nest.pack_sequence_as(self.structure, values)


def make_function(model, keras_make_function, step_function):
    """`TensorFlowTrainer._make_function` whose outputs survive `MultiWorkerMirroredStrategy`.

    Keras reduces every step output with `strategy.reduce("MEAN", v, axis=0)` under
    `MultiWorkerMirroredStrategy`: scalar outputs fail (no axis 0), other outputs would be
    averaged over their own first axis, and every output costs a collective. Here the step
    returns all its outputs packed into one `(1, K)` tensor, which Keras' reduction averages
    over replicas in one collective, and the function Keras builds is wrapped to unpack them.
    Other strategies keep Keras' function unchanged.

    Args:
        model: the Keras model.
        keras_make_function: Keras' bound `super()._make_function`.
        step_function: `model.train_step` or `model.test_step`.

    Returns:
        The callable `function(iterator) -> logs` that Keras stores as `train_function` /
        `test_function`.

    Example:
        >>> # in OptimizedModel: multi_worker.make_function(self, super()._make_function, step)
    """
    # Keras' rematerialization replayed exactly while the step is traced (keras#21207).
    step_function = internals.with_exact_remat(model, step_function)
    if not is_multi_worker(model.distribute_strategy):
        return keras_make_function(step_function)
    packer = _OutputPacker()

    def packed_step(data):
        return packer.pack(step_function(data))

    function = keras_make_function(packed_step)

    def unpacked(iterator):
        return packer.unpack(function(iterator))

    return unpacked
