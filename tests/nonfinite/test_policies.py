"""Fault injection for `compile(nonfinite="skip"|"raise"|"terminate")` (keras_fastloop._step.guards).

The model has two outputs fed by disjoint input columns, with one loss each. A NaN written into
input column 3 of one sample makes the total loss NaN but, since the gradient of a sum is 1 for
each term, only the variables of output `b` get non-finite gradients: the first such variable
is `b`'s kernel, not the model's first variable. References are runs on the same data with the
faulty batch removed (`skip`) or cut at the fault (`terminate`).
"""

import re

import keras
import numpy as np
import pytest
from _helpers import EXPECT_SKIP_WARNINGS, fresh_user_data, fresh_user_mlp

import keras_fastloop as kf
from keras_fastloop._warnings import FastloopWarning

pytestmark = EXPECT_SKIP_WARNINGS  # these tests skip steps on purpose

BATCH = 2


def make_model(model_class=kf.OptimizedModel):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    a = keras.layers.Dense(1, name="a")(keras.layers.Lambda(lambda t: t[:, :2])(inputs))
    b = keras.layers.Dense(1, name="b")(keras.layers.Lambda(lambda t: t[:, 2:])(inputs))
    return model_class(inputs, {"a": a, "b": b})


def make_data(num_batches, bad_batches=()):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_batches * BATCH, 4)).astype("float32")
    y = {"a": x[:, :1] - x[:, 1:2], "b": x[:, 2:3] * 2.0}
    for i in bad_batches:
        x[i * BATCH, 3] = np.nan
    return x, y


def keep_batches(x, y, batches):
    rows = np.concatenate([np.arange(i * BATCH, (i + 1) * BATCH) for i in batches])
    return x[rows], {k: v[rows] for k, v in y.items()}


def train(x, y, nonfinite="skip", steps_per_execution=1, callbacks=None):
    model = make_model()
    model.compile(
        keras.optimizers.Adam(0.05),
        {"a": "mse", "b": "mse"},
        nonfinite=nonfinite,
        steps_per_execution=steps_per_execution,
        log_metrics=["skipped_steps"],
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    return model, history


def assert_finite(model):
    for variable in model.weights + model.optimizer.variables:
        value = np.asarray(variable.numpy())
        if value.dtype.kind == "f":
            assert np.all(np.isfinite(value)), variable.path


def assert_same_weights(model, reference):
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_skip_drops_exactly_the_faulty_updates(steps_per_execution):
    x, y = make_data(8, bad_batches=(2, 5))
    model, history = train(x, y, "skip", steps_per_execution)
    assert int(model.skipped_steps.numpy()) == 2
    assert int(model.optimizer.iterations.numpy()) == 6
    assert history.history["skipped_steps"][-1] == 2
    assert_finite(model)
    reference, _ = train(*keep_batches(x, y, [0, 1, 3, 4, 6, 7]), "skip", steps_per_execution)
    assert int(reference.skipped_steps.numpy()) == 0
    assert_same_weights(model, reference)


def assert_raise_message(message, model, step):
    # The message comes first (a Python exception raised after the batch, not a graph assert at
    # the bottom of a traceback): it starts with what happened, names the step and the culprit.
    assert message.startswith(f"Non-finite loss or gradient at optimizer step {step} "), message
    assert re.search(rf"optimizer step\D{{0,20}}\b{step}\b", message), message
    b_kernel = next(v.path for v in model.trainable_variables if v.path.startswith("b/"))
    assert f"the first variable with a non-finite gradient is '{b_kernel}'" in message
    assert not any(v.path in message for v in model.trainable_variables if v.path.startswith("a/"))
    assert "not applied" in message
    assert "Traceback" not in message and "node" not in message.lower()


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_raise_names_step_and_first_nonfinite_variable(steps_per_execution):
    # With steps_per_execution=4 the fault (batch 3) ends the first block; a second fault in
    # batch 5 (second block) is never reached.
    x, y = make_data(8, bad_batches=(3, 5))
    model = make_model()
    model.compile(
        keras.optimizers.Adam(0.05),
        {"a": "mse", "b": "mse"},
        nonfinite="raise",
        steps_per_execution=steps_per_execution,
    )
    with pytest.raises(kf.NonFiniteError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert isinstance(info.value, FloatingPointError)
    assert_raise_message(str(info.value), model, 3)
    # No update from the faulty step: the weights are those after the 3 good batches.
    assert int(model.optimizer.iterations.numpy()) == 3
    assert_finite(model)
    reference, _ = train(*keep_batches(x, y, [0, 1, 2]))
    assert_same_weights(model, reference)
    # The record is cleared: training on good data goes on, from those weights.
    model.fit(*keep_batches(x, y, [6, 7]), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 5
    reference, _ = train(*keep_batches(x, y, [0, 1, 2, 6, 7]))
    assert_same_weights(model, reference)


def test_raise_is_caught_where_keras_terminate_on_nan_raise_error_is():
    # Keras' TerminateOnNaN(raise_error=True) raises RuntimeError: code written for it
    # (`except RuntimeError`) must catch ours too, under nonfinite="raise".
    x, y = make_data(4, bad_batches=(1,))
    reference = make_model(keras.Model)
    reference.compile(keras.optimizers.Adam(0.05), {"a": "mse", "b": "mse"})
    callbacks = [keras.callbacks.TerminateOnNaN(raise_error=True)]
    with pytest.raises(RuntimeError) as keras_error:
        reference.fit(
            x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
        )
    assert type(keras_error.value) is RuntimeError  # the reference: Keras' own class
    model = make_model()
    model.compile(keras.optimizers.Adam(0.05), {"a": "mse", "b": "mse"}, nonfinite="raise")
    with pytest.raises(RuntimeError) as ours:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert isinstance(ours.value, kf.NonFiniteError)
    assert isinstance(ours.value, FloatingPointError)


def test_raise_blocks_the_rest_of_a_block_of_steps():
    # Fault in batch 1, inside the block 0..3: batches 2 and 3 must not be applied either.
    x, y = make_data(4, bad_batches=(1,))
    model = make_model()
    model.compile(
        keras.optimizers.Adam(0.05),
        {"a": "mse", "b": "mse"},
        nonfinite="raise",
        steps_per_execution=4,
    )
    with pytest.raises(kf.NonFiniteError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_raise_message(str(info.value), model, 1)
    assert int(model.optimizer.iterations.numpy()) == 1
    reference, _ = train(*keep_batches(x, y, [0]))
    assert_same_weights(model, reference)


def test_raise_from_train_on_batch():
    x, y = make_data(2, bad_batches=(1,))
    model = make_model()
    model.compile(keras.optimizers.Adam(0.05), {"a": "mse", "b": "mse"}, nonfinite="raise")
    good, bad = keep_batches(x, y, [0]), keep_batches(x, y, [1])
    model.train_on_batch(*good)
    before = model.get_weights()
    with pytest.raises(kf.NonFiniteError) as info:
        model.train_on_batch(*bad)
    assert_raise_message(str(info.value), model, 1)
    assert int(model.optimizer.iterations.numpy()) == 1
    for got, expected in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, expected)
    model.train_on_batch(*good)  # not blocked any more
    assert int(model.optimizer.iterations.numpy()) == 2


def test_raise_on_two_replicas_decides_on_the_global_batch():
    from _helpers import two_replica_strategy

    strategy = two_replica_strategy()
    x, y = make_data(4, bad_batches=(2,))  # the NaN sits in the first replica's half
    with strategy.scope():
        model = make_model()
        model.compile(keras.optimizers.SGD(0.1), {"a": "mse", "b": "mse"}, nonfinite="raise")
    with pytest.raises(kf.NonFiniteError) as info:
        model.fit(x, y, batch_size=2 * BATCH, epochs=1, shuffle=False, verbose=0)
    assert_raise_message(str(info.value), model, 1)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_finite(model)


def test_raise_under_loss_scaling_names_the_nonfinite_loss_step():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data(4, bad_batches=(2,))
    model = make_model()
    # A small scale: the good batches never overflow float16 (iterations count every batch).
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    model.compile(optimizer, {"a": "mse", "b": "mse"}, nonfinite="raise")
    with pytest.raises(kf.NonFiniteError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_raise_message(str(info.value), model, 2)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert float(model.optimizer.dynamic_scale.numpy()) == 64.0
    assert_finite(model)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_terminate_stops_and_keeps_last_good_weights(steps_per_execution):
    # Fault in batch 5: with steps_per_execution=4 in the middle of the block 4..7, whose
    # later batches (6, 7) must not be applied either.
    x, y = make_data(12, bad_batches=(5,))
    seen = []
    recorder = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    model, history = train(x, y, "terminate", steps_per_execution, callbacks=[recorder])
    assert model.stop_training
    assert max(seen) < 11  # stopped before the end of the epoch
    assert int(model.optimizer.iterations.numpy()) == 5
    assert_finite(model)
    reference, _ = train(*keep_batches(x, y, range(5)))
    assert_same_weights(model, reference)
    assert history.history  # the epoch ended cleanly (logs recorded)


def test_no_nan_in_weights_after_any_fault():
    x, y = make_data(6, bad_batches=(0, 2, 5))
    y["a"][3] = np.inf  # a second kind of fault, in the other task
    for policy in ("skip", "terminate"):
        model, _ = train(x, y, policy)
        assert_finite(model)
    model = make_model()
    model.compile("adam", {"a": "mse", "b": "mse"}, nonfinite="raise")
    with pytest.raises(kf.NonFiniteError):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_finite(model)


def test_any_skip_warns_at_the_epoch_end():
    """The skip report replaced the skip-rate warning: one skipped batch of 100 is said."""
    x, y = make_data(100, bad_batches=(7,))
    with pytest.warns(FastloopWarning, match="1 training step skipped .* optimizer step 7"):
        model, _ = train(x, y, "skip")
    assert int(model.skipped_steps.numpy()) == 1


# ------------------------------------------- a skipped batch leaves no trace

METRIC_BATCH = 4


def metrics_model(mixed=False):
    if mixed:
        keras.config.set_dtype_policy("mixed_float16")  # conftest resets it after the test
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    out = keras.layers.Dense(1, name="out")(hidden)
    out = keras.layers.Activation("linear", dtype="float32", name="out32")(out)
    return kf.OptimizedModel(inputs, out)


def metrics_data(num_batches, bad_batch=None, where="inputs"):
    rng = np.random.default_rng(2)
    n = num_batches * METRIC_BATCH
    x = rng.normal(size=(n, 3)).astype("float32") * 0.5
    y = (x @ np.array([[0.5], [-0.3], [0.2]], "float32")).astype("float32")
    sw = rng.uniform(0.5, 1.5, size=(n,)).astype("float32")
    if bad_batch is not None:
        row = bad_batch * METRIC_BATCH + 1
        value = np.inf if where == "labels_inf" else np.nan
        {
            "inputs": x[row],
            "labels": y[row],
            "labels_inf": y[row],
            "sample_weights": sw[row : row + 1],
        }[where][...] = value
    return x, y, sw


def without_batch(arrays, batch):
    keep = np.r_[0 : batch * METRIC_BATCH, (batch + 1) * METRIC_BATCH : len(arrays[0])]
    return tuple(a[keep] for a in arrays)


def fit_metrics(data, mixed=False, micro=None, spe=1, epochs=1, callbacks=None):
    x, y, sw = data
    model = metrics_model(mixed)
    model.compile(
        keras.optimizers.SGD(0.1),
        "mse",
        metrics=["mae"],
        weighted_metrics=["mse"],
        micro_batch_size=micro,
        steps_per_execution=spe,
        log_metrics=["skipped_steps"],
    )
    history = model.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=METRIC_BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return model, history


@pytest.mark.parametrize("where", ["inputs", "labels", "labels_inf", "sample_weights"])
@pytest.mark.parametrize(
    "mixed, micro, spe",
    [
        (False, None, 1),
        (False, None, 4),
        (False, 2, 1),
        (False, 2, 4),
        (True, None, 1),
        (True, 2, 4),
    ],
)
def test_skipped_batch_leaves_loss_and_metrics_as_if_unseen(where, mixed, micro, spe):
    faulty, faulty_history = fit_metrics(metrics_data(8, 3, where), mixed, micro, spe)
    clean, clean_history = fit_metrics(without_batch(metrics_data(8), 3), mixed, micro, spe)
    assert int(faulty.skipped_steps.numpy()) == 1
    assert faulty_history.history["skipped_steps"] == [1]
    logs, reference = faulty_history.history, clean_history.history
    assert set(logs) == set(reference)
    for key in ("loss", "mae", "mse"):
        assert np.isfinite(logs[key][0]), key
        np.testing.assert_allclose(logs[key], reference[key], rtol=1e-6, err_msg=key)
    for got, expected in zip(faulty.get_weights(), clean.get_weights()):
        np.testing.assert_array_equal(got, expected)
    if mixed:
        assert float(faulty.optimizer.dynamic_scale.numpy()) == float(
            clean.optimizer.dynamic_scale.numpy()
        )


@pytest.mark.parametrize("mixed", [False, True])
def test_early_stopping_on_loss_does_not_stop_a_healthy_run_with_a_nan_batch(mixed):
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0)
    model, history = fit_metrics(metrics_data(8, 5, "labels"), mixed, epochs=4, callbacks=[stopper])
    losses = history.history["loss"]
    assert len(losses) == 4, losses  # never stopped
    assert all(np.isfinite(losses)) and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert stopper.stopped_epoch == 0
    assert int(model.skipped_steps.numpy()) == 4


# ------------------------------------------------ NaN data and the loss scale


def fit_scaled(data, growth_steps=2000, callbacks=None, initial_scale=2.0**15):
    x, y, sw = data
    model = metrics_model(mixed=True)
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=initial_scale, dynamic_growth_steps=growth_steps
    )
    model.compile(optimizer, "mse", metrics=["mae"])
    history = model.fit(
        x, y, batch_size=METRIC_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    return model, history


def test_forty_nan_batches_keep_the_loss_scale_and_training_recovers():
    x, y, sw = metrics_data(55)
    clean = tuple(a.copy() for a in (x, y, sw))
    bad = range(5, 45)
    for i in bad:  # NaN inputs, inf labels: a non-finite loss, i.e. bad data, not an overflow
        if i % 2:
            x[i * METRIC_BATCH + 2, 0] = np.nan
        else:
            y[i * METRIC_BATCH + 2] = np.inf
    with pytest.warns(FastloopWarning, match="40 training steps skipped .* in epoch 1"):
        model, history = fit_scaled((x, y, sw))
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15
    assert int(model.skipped_steps.numpy()) == 40
    assert history.history["skipped_steps"] == [40]
    assert history.history["loss_scale"] == [2.0**15]
    keep = [i for i in range(55) if i not in bad]
    rows = np.concatenate([np.arange(i * METRIC_BATCH, (i + 1) * METRIC_BATCH) for i in keep])
    reference, reference_history = fit_scaled(tuple(a[rows] for a in clean))
    assert int(model.optimizer.iterations.numpy()) == 15
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(
        history.history["loss"], reference_history.history["loss"], rtol=1e-6
    )
    np.testing.assert_allclose(history.history["mae"], reference_history.history["mae"], rtol=1e-6)


def test_overflow_burst_of_a_finite_loss_halves_the_scale_and_it_regrows():
    # Targets of 1e4: the float32 loss (~1e8) is finite, its scaled gradient (~1e8 at the
    # float16 layers) overflows float16 -> Keras halves the scale on each of the 3 batches.
    x, y, sw = metrics_data(9)
    y[: 3 * METRIC_BATCH] = 1e4
    scales = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: scales.append(logs["loss_scale"])
    )
    model, history = fit_scaled((x, y, sw), growth_steps=2, callbacks=[record])
    assert all(np.isfinite(history.history["loss"]))
    # 3 halvings, then a doubling after every 2 finite steps.
    assert scales == [
        2.0**14,
        2.0**13,
        2.0**12,
        2.0**12,
        2.0**13,
        2.0**13,
        2.0**14,
        2.0**14,
        2.0**15,
    ]
    assert int(model.skipped_steps.numpy()) == 3
    assert int(model.optimizer.iterations.numpy()) == 6
    assert_finite(model)


@pytest.mark.parametrize("mixed", [False, True])
def test_two_replicas_skip_a_batch_bad_on_one_replica_only(mixed):
    """Same decision on every replica: the global step is skipped, metrics and scale untouched."""
    from _helpers import two_replica_strategy

    strategy = two_replica_strategy()
    runs = []
    for data in (metrics_data(6, 2, "labels"), without_batch(metrics_data(6), 2)):
        x, y, sw = data
        with strategy.scope():
            model = metrics_model(mixed)
            model.compile(
                keras.optimizers.SGD(0.1), "mse", metrics=["mae"], log_metrics=["skipped_steps"]
            )
        # Global batch 4: the NaN label (row 1 of the batch) is in the first replica's half.
        history = model.fit(x, y, batch_size=METRIC_BATCH, epochs=1, shuffle=False, verbose=0)
        runs.append((model, history))
    (faulty, faulty_history), (clean, clean_history) = runs
    assert int(faulty.skipped_steps.numpy()) == 1
    for key in ("loss", "mae"):
        np.testing.assert_allclose(
            faulty_history.history[key], clean_history.history[key], rtol=1e-6, err_msg=key
        )
    for got, expected in zip(faulty.get_weights(), clean.get_weights()):
        np.testing.assert_array_equal(got, expected)
    if mixed:
        assert float(faulty.optimizer.dynamic_scale.numpy()) == float(
            clean.optimizer.dynamic_scale.numpy()
        )


# ----------------------------------- faults found by a fresh user (were tests/test_regressions.py)


def test_terminate_stops_one_fit_only_and_says_so(capsys):
    x, y = fresh_user_data()
    bad = x.copy()
    bad[20, 3] = np.nan
    model = fresh_user_mlp()
    model.compile("sgd", "sparse_categorical_crossentropy", nonfinite="terminate")
    model.fit(bad, y, batch_size=16, shuffle=False, verbose=0)
    assert "terminating training" in capsys.readouterr().out
    assert int(model.optimizer.iterations.numpy()) == 1
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # clean data trains again
    assert int(model.optimizer.iterations.numpy()) == 1 + 8


def test_skip_warning_on_small_epochs():
    x, y = fresh_user_data()
    model = fresh_user_mlp()
    model.compile("sgd", lambda yt, yp: keras.ops.mean(yp, axis=-1) * np.nan)
    with pytest.warns(UserWarning, match="8 training steps skipped for a non-finite loss"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.parametrize("policy", ["raise", "terminate"])
@pytest.mark.parametrize("loss_scaling", [False, True])
def test_skipped_steps_do_not_count_the_steps_a_halt_blocks(policy, loss_scaling):
    """One NaN batch in a block of 4: `skipped_steps` is 1 whatever `steps_per_execution`
    (it counted the blocked finite steps after the halt: 3 with spe=4; review)."""
    x, y = make_data(8, bad_batches=(1,))
    counts = []
    for steps_per_execution in (1, 4):
        model = make_model()
        optimizer = keras.optimizers.Adam(0.05)
        if loss_scaling:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=8.0)
        model.compile(
            optimizer,
            {"a": "mse", "b": "mse"},
            nonfinite=policy,
            steps_per_execution=steps_per_execution,
            log_metrics=["skipped_steps"],
        )
        try:
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        except kf.NonFiniteError:
            pass
        counts.append((int(model.skipped_steps.numpy()), int(model.optimizer.iterations)))
    assert counts == [(1, 1), (1, 1)]


# --------------------------------------------- an epoch in which no update was applied


def _diverging_run(base, epochs, callbacks=()):
    """Keras' BackupAndRestore docstring data: SGD on arange(100) diverges to NaN."""
    keras.utils.set_random_seed(0)
    model = base([keras.Input((20,)), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(), loss="mse", metrics=["mae"])
    x, y = np.arange(100, dtype="float32").reshape(5, 20), np.zeros(5, "float32")
    return model, model.fit(
        x, y, epochs=epochs, batch_size=1, verbose=0, shuffle=False, callbacks=list(callbacks)
    )


def test_an_epoch_without_an_applied_step_logs_nan_not_zero():
    model, ours = _diverging_run(kf.OptimizedSequential, epochs=4)
    skipped = int(model.skipped_steps.numpy())
    assert 0 < skipped < 20
    # Every epoch after the divergence applied no step: NaN for loss and metrics (never the
    # perfect 0.0 of a Mean over no batch); the epochs before it are means over applied steps.
    last_applied = next(i for i, v in enumerate(ours.history["loss"]) if np.isnan(v))
    assert last_applied >= 1
    for key in ("loss", "mae"):
        assert np.isnan(ours.history[key][-1])
        assert all(np.isfinite(ours.history[key][:last_applied])), key


def test_early_stopping_never_takes_an_all_skipped_epoch_as_best():
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    _, ours = _diverging_run(kf.OptimizedSequential, epochs=6, callbacks=[stopper])
    assert len(ours.history["loss"]) < 6  # stopped: the NaN epochs are no improvement
    assert np.isfinite(stopper.best) and stopper.best == min(
        v for v in ours.history["loss"] if np.isfinite(v)
    )


class OverridesComputeLoss(kf.OptimizedModel):
    """The override Keras' guides show: adds nothing, calls the compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training)


def test_skipped_batch_leaves_the_task_losses_of_an_overridden_compute_loss_unseen():
    """Its `super()` call records the `{name}_loss` trackers during the forward pass: a
    skipped step takes them back, as the default step never records them."""

    def fit(model_class, x, y):
        model = make_model(model_class)
        model.compile("sgd", loss={"a": "mse", "b": "mse"})
        return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history

    x, y = make_data(4, bad_batches=[1])
    keep = np.r_[0:BATCH, 2 * BATCH : 4 * BATCH]
    clean = fit(kf.OptimizedModel, x[keep], {k: v[keep] for k, v in y.items()})
    faulty = fit(OverridesComputeLoss, x, y)
    for key in ("a_loss", "b_loss", "loss"):
        assert np.isfinite(faulty[key][0]), key
        np.testing.assert_allclose(faulty[key], clean[key], rtol=1e-6, err_msg=key)
