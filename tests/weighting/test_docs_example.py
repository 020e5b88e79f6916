"""docs/weighting.md's worked example (a new method) runs and trains as a hand-written step."""

import pathlib
import re

import keras
import numpy as np
import tensorflow as tf
from _linear_tasks import data, two_task_model

_DOC = pathlib.Path(__file__).parents[2] / "docs" / "weighting.md"


def _example_namespace():
    blocks = re.findall(r"```python\n(.*?)```", _DOC.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "class InverseLoss" in b]
    namespace = {}
    exec(compile(block, str(_DOC), "exec"), namespace)
    return namespace


def test_worked_example_matches_a_hand_written_step():
    method = _example_namespace()["InverseLoss"]()
    x, y = data(6)
    model = two_task_model()
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    model.compile(keras.optimizers.SGD(0.1), "mse", loss_weighting=method)
    logs = model.train_on_batch(x, y, return_dict=True)

    mse = keras.losses.MeanSquaredError()
    with tf.GradientTape() as tape:
        pred = reference(x)
        losses = [mse(y["a"], pred["a"]), mse(y["b"], pred["b"])]
        inverse = [1.0 / (loss.numpy() + 1e-8) for loss in losses]
        weights = [2 * v / sum(inverse) for v in inverse]
        objective = weights[0] * losses[0] + weights[1] * losses[1]
    grads = tape.gradient(objective, reference.trainable_variables)
    for v, g in zip(reference.trainable_variables, grads):
        v.assign(v - 0.1 * g)

    np.testing.assert_allclose(logs["a_weight"], weights[0], rtol=1e-5)
    np.testing.assert_allclose(logs["b_weight"], weights[1], rtol=1e-5)
    for got, want in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert method.name == "inverse_loss"
    assert type(method).from_config(method.get_config()).epsilon == method.epsilon
