"""A loss function's name that Keras allows but a TensorFlow root scope does not."""

import keras
import numpy as np
import pytest
from _linear_tasks import data, two_task_model


def _named_loss(name):
    def loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    loss.__name__ = name
    return loss


def _history(method, loss_name):
    x, y = data(12)
    model = two_task_model()
    model.compile(keras.optimizers.SGD(0.05), _named_loss(loss_name), loss_weighting=method)
    return model.fit(x, y, batch_size=6, epochs=1, verbose=0).history


@pytest.mark.parametrize("method", ["modo", "sdmgrad", "pcgrad"])
@pytest.mark.parametrize("loss_name", ["_x", "a b", "a/b", "-x"])
def test_trains_as_with_a_plain_name(method, loss_name):
    expected = _history(method, "plain")
    history = _history(method, loss_name)
    assert history.keys() == expected.keys()
    for key, values in expected.items():
        np.testing.assert_array_equal(history[key], values, err_msg=key)
