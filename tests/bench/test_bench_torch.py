"""The PyTorch contender of the default bench trains the same network from the same weights.

PyTorch is not a dependency: `.ci/run` installs it (the CPU build), a plain install skips this.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop_bench import default, harness, torch_contender

pytestmark = pytest.mark.slow  # integration: the slow job

torch = pytest.importorskip("torch")


def _keras_and_torch():
    import keras

    keras.utils.set_random_seed(3)
    model = default.build_cnn()
    net = torch_cnn_from(model.get_weights())
    return model, net


def torch_cnn_from(weights):
    net = torch_contender.torch_cnn()
    with torch.no_grad():
        for parameter, value in zip(
            net.parameters(), torch_contender.keras_weights_to_torch(weights)
        ):
            assert tuple(parameter.shape) == value.shape
            parameter.copy_(torch.from_numpy(value))
    return net


def test_converted_network_gives_keras_outputs_loss_and_gradients():
    model, net = _keras_and_torch()
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(8, 16, 16, 1)).astype("float32")
    y = rng.integers(0, 10, 8)
    with tf.GradientTape() as tape:
        probabilities = model(x)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, probabilities))
    keras_grads = tape.gradient(loss, model.trainable_weights)
    logits = net(torch.from_numpy(x).permute(0, 3, 1, 2))
    torch_loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y).long())
    torch_loss.backward()
    np.testing.assert_allclose(
        torch.softmax(logits, 1).detach().numpy(), probabilities.numpy(), atol=1e-6
    )
    np.testing.assert_allclose(float(torch_loss.detach()), float(loss), rtol=1e-5)
    # Gradients, mapped back by the same conversion (applied to Keras' gradients).
    expected = torch_contender.keras_weights_to_torch([g.numpy() for g in keras_grads])
    for parameter, want in zip(net.parameters(), expected):
        np.testing.assert_allclose(parameter.grad.numpy(), want, rtol=1e-4, atol=1e-6)


def test_conversion_refuses_other_networks():
    with pytest.raises(ValueError, match="Received: 2 arrays"):
        torch_contender.keras_weights_to_torch([np.zeros((3, 3, 1, 16)), np.zeros(16)])


def test_contender_trains_the_bench_data_and_reports_like_the_others():
    import keras

    data = default.Data(quick=True)
    keras.utils.set_random_seed(default.SEED)
    initial = default.build_cnn().get_weights()
    run = harness.Run("torch", epochs=2, initial_weights=initial)
    torch_contender.torch_contender(data)(run)
    assert run.samples == [len(data.x)] * 2
    assert run.curve[1][1] < run.curve[0][1]  # the loss falls
    assert 0.0 <= run.val_accuracy <= 1.0 and run.throughput() > 0
    suite = default.contenders(data, "float32")
    assert default.TORCH in suite and default.TORCH_BF16 not in suite
    assert default.TORCH_BF16 in default.contenders(data, "mixed_bfloat16")


def test_keras_adam_takes_keras_adam_steps():
    import keras

    rng = np.random.default_rng(0)
    start = rng.normal(size=(5,)).astype("float32")
    grads = rng.normal(size=(4, 5)).astype("float32") * np.array([1, 1e-3, 1e-5, 0, 10], "float32")
    variable = keras.Variable(start)
    reference = keras.optimizers.Adam(1e-3)
    parameter = torch.nn.Parameter(torch.from_numpy(start.copy()))
    ours = torch_contender.keras_adam([parameter], 1e-3)
    for g in grads:
        reference.apply_gradients([(tf.constant(g), variable)])
        parameter.grad = torch.from_numpy(g.copy())
        ours.step()
    np.testing.assert_allclose(parameter.detach().numpy(), variable.numpy(), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("epochs", [3])
def test_hand_written_loops_train_what_fit_trains(epochs):
    """Same initial weights, same batches in `fit`'s order, Keras' Adam steps: the epoch losses
    of PyTorch's and the seed's `tf.function` loop follow `fit`'s (float rounding aside)."""
    import keras

    data = default.Data(quick=True)
    keras.utils.set_random_seed(default.SEED)
    initial = default.build_cnn().get_weights()
    suite = default.contenders(data, "float32")
    losses = {}
    for name in (default.BASELINE, default.TORCH, "seed's GradientTape loop (tf.function)"):
        run = harness.Run(name, epochs=epochs, initial_weights=[w.copy() for w in initial])
        suite[name](run)
        losses[name] = [loss for _, loss in run.curve]
    for name, curve in losses.items():
        np.testing.assert_allclose(curve, losses[default.BASELINE], rtol=2e-4, err_msg=name)
