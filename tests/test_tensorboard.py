"""The README's TensorBoard scalars (grad_norm, loss scale, task weights) reach real event files.

`keras.callbacks.TensorBoard` needs the `tensorboard` package, which TensorFlow 2.21 no longer
installs; the `bench` extra (and so `test`) brings it. These tests use the real callback, with
no shim: they fail where the documented install cannot write TensorBoard scalars.
"""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf


def _scalars(run_dir):
    """{tag: [(step, value), ...]} read back from every event file under `run_dir`."""
    paths = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert paths, f"no event file under {run_dir}"
    tags = {}
    for path in paths:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    array = tf.make_ndarray(value.tensor)
                    if array.dtype.kind not in "fiu":  # the Graphs tab's model summary (JSON)
                        tags.setdefault(value.tag, []).append((int(event.step), None))
                        continue
                    number = float(array)
                else:
                    number = float(value.simple_value)
                tags.setdefault(value.tag, []).append((int(event.step), number))
    return tags


class _EpochLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def _fit_with_tensorboard(model, y_of, tmp_path, seed):
    """Two epochs of 4 batches with the real TensorBoard callback: (epoch logs, train scalars)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 4)).astype("float32")
    logdir = str(tmp_path / "tb")
    seen = _EpochLogs()
    model.fit(
        x,
        y_of(rng),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[seen, keras.callbacks.TensorBoard(logdir, write_graph=False)],
    )
    return seen.epochs, _scalars(os.path.join(logdir, "train"))


def test_tensorboard_package_is_installed_with_the_documented_extras():
    import tensorboard  # noqa: F401  (the `bench` extra must bring it)

    keras.callbacks.TensorBoard(log_dir="unused")._summary_module  # noqa: B018


def test_grad_norm_and_loss_scale_reach_tensorboard(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(hidden)
        model = kf.OptimizedModel(inputs, outputs)
        model.compile(keras.optimizers.SGD(0.01), "mse", gradient_clipping=1.0)
        epochs, train = _fit_with_tensorboard(
            model, lambda rng: rng.normal(size=(32, 1)).astype("float32"), tmp_path, seed=0
        )
    finally:
        keras.config.set_dtype_policy("float32")
    for key in ("epoch_loss", "epoch_grad_norm", "epoch_loss_scale"):
        assert [step for step, _ in train[key]] == [0, 1], key
    # The values written are the epoch logs fit returned (float32 in the event file).
    for epoch, logs in enumerate(epochs):
        np.testing.assert_allclose(train["epoch_grad_norm"][epoch][1], logs["grad_norm"], 1e-6)
        np.testing.assert_allclose(train["epoch_loss_scale"][epoch][1], logs["loss_scale"], 1e-6)
    assert train["epoch_loss_scale"][0][1] > 1.0  # a real dynamic scale, not a placeholder
    assert all(value > 0.0 for _, value in train["epoch_grad_norm"])


def test_task_weights_reach_tensorboard(tmp_path):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = kf.OptimizedModel(
        inputs,
        {
            "a": keras.layers.Dense(1, name="a")(hidden),
            "b": keras.layers.Dense(1, name="b")(hidden),
        },
    )
    model.compile(keras.optimizers.SGD(0.05), {"a": "mse", "b": "mse"}, loss_weighting="uw")
    epochs, train = _fit_with_tensorboard(
        model,
        lambda rng: {"a": rng.normal(size=(32, 1)), "b": 3.0 * rng.normal(size=(32, 1))},
        tmp_path,
        seed=1,
    )
    for task in ("a", "b"):
        key = f"epoch_{task}_weight"
        assert [step for step, _ in train[key]] == [0, 1], key
        for epoch, logs in enumerate(epochs):
            np.testing.assert_allclose(train[key][epoch][1], logs[f"{task}_weight"], 1e-6)
    # uw learns different weights for tasks of different noise: the scalars are not constants.
    assert train["epoch_a_weight"][-1][1] != train["epoch_b_weight"][-1][1]


def test_auto_keeps_tensorboard_batch_summaries_at_their_steps(tmp_path):
    """Found by a review: TensorBoard(update_freq=N) numbers batch summaries by its calls, so
    under grouped steps they landed at the wrong steps with the wrong values. "auto" runs one
    step per execution while it is there, and says so."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def trained(spe, run_dir):
        keras.utils.set_random_seed(0)
        model = kf.OptimizedSequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=spe)
        board = keras.callbacks.TensorBoard(str(run_dir), update_freq=2)
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[board])
        return model, _scalars(str(run_dir / "train"))["batch_loss"]

    _, reference = trained(1, tmp_path / "one")
    with pytest.warns(kf.FastloopWarning, match=r"TensorBoard\(update_freq=2\)"):
        model, auto = trained("auto", tmp_path / "auto")
    assert {k for _, k in model.fastloop_step.auto_steps.executions} == {1}
    assert [s for s, _ in auto] == [s for s, _ in reference] == list(range(2, 33, 2))
    np.testing.assert_allclose([v for _, v in auto], [v for _, v in reference], rtol=1e-6)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_the_graphs_tab_gets_the_model_summary_as_for_stock_models(tmp_path, kind):
    """Keras' TensorBoard writes the `keras` model summary only for the class names
    `Functional`/`Sequential`; ours get it too, subclassed models (as in Keras) do not."""
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    tags = {}
    for name, base in (("stock", None), ("ours", kf)):
        if kind == "sequential":
            cls = keras.Sequential if base is None else kf.OptimizedSequential
            model = cls([keras.Input((4,)), keras.layers.Dense(1)])
        else:
            inputs = keras.Input((4,))
            cls = keras.Model if base is None else kf.OptimizedModel
            model = cls(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse")
        run_dir = str(tmp_path / name)
        model.fit(x, y, verbose=0, callbacks=[keras.callbacks.TensorBoard(run_dir)])
        tags[name] = set(_scalars(os.path.join(run_dir, "train")))
    assert "keras" in tags["stock"] and tags["ours"] == tags["stock"]
