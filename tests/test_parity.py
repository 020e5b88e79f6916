"""Drop-in parity: what works with keras.Model / keras.Sequential works the same here.

Every test builds the same model twice from one seed, once with Keras' class and once with ours,
trains both the same way and compares History (keys and values) and weights.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

import keras_fastloop as kf
from keras_fastloop._keras_internals import Functional
from keras_fastloop._warnings import FastloopWarning

pytestmark = EXPECT_SKIP_WARNINGS


def rng_data(n=32, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def fit_pair(build, compile_kwargs, fit_args, fit_kwargs=None, classes=None):
    """`build(cls)` twice (same seed), compile and fit both; returns the two (history, model)."""
    classes = classes or (keras.Model, kf.OptimizedModel)
    results = []
    for cls in classes:
        keras.utils.set_random_seed(7)
        model = build(cls)
        kwargs = dict(compile_kwargs)
        if callable(kwargs.get("optimizer")):  # one optimizer instance per model
            kwargs["optimizer"] = kwargs["optimizer"]()
        model.compile(**kwargs)
        history = model.fit(*fit_args, verbose=0, shuffle=False, **(fit_kwargs or {}))
        results.append((history.history, model))
    return results


def assert_same(pair, atol=1e-6):
    (h_ref, m_ref), (h, m) = pair
    assert set(h) == set(h_ref)
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], atol=atol, err_msg=key)
    for a, b in zip(m_ref.get_weights(), m.get_weights()):
        np.testing.assert_allclose(b, a, atol=atol)


# ------------------------------------------------------------------ 1. compile without a loss


class AddLossDense(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        out = self.dense(x)
        self.add_loss(keras.ops.mean(out**2))
        return out


def test_add_loss_only_model_trains_like_keras():
    x, _ = rng_data()

    def build(cls):
        i = keras.Input((4,))
        return cls(i, AddLossDense()(i))

    pair = fit_pair(build, {"optimizer": "sgd"}, (x,), {"batch_size": 8, "epochs": 2})
    assert_same(pair)
    assert pair[1][0]["loss"][0] > 0


def test_compile_without_loss_for_inference_and_saving(tmp_path):
    x, _ = rng_data()
    i = keras.Input((4,))
    model = kf.OptimizedModel(i, keras.layers.Dense(2)(i))
    model.compile(optimizer="adam")
    assert model.predict(x, verbose=0).shape == (32, 2)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded).__name__ == "OptimizedModel"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    with pytest.raises(ValueError, match="No loss to compute"):
        model.fit(x, x[:, :2], verbose=0)


# ------------------------------------------------------------- 2. an overridden compute_loss


def _plus_100(base):
    class Plus100(base):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training)
            return loss + 100.0

    return Plus100


def test_overridden_compute_loss_is_used():
    x, y = rng_data()

    def build(cls):
        i = keras.Input((4,))
        return _plus_100(cls)(i, keras.layers.Dense(1)(i))

    pair = fit_pair(
        build, {"optimizer": "sgd", "loss": "mse"}, (x, y), {"batch_size": 8, "epochs": 2}
    )
    assert_same(pair)
    assert pair[1][0]["loss"][0] > 100.0


def test_overridden_compute_loss_may_restructure_the_outputs():
    """One output, split in two by `compute_loss`, with a two-entry `loss` list: the loss'
    structure is the override's business, so `compile` does not check it against the outputs."""
    x, y = rng_data()

    def build(cls):
        class TwoViews(cls):
            def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
                return super().compute_loss(x, y, [y_pred, 2.0 * y_pred], sample_weight, **kwargs)

        i = keras.Input((4,))
        return TwoViews(i, keras.layers.Dense(1, name="a")(i))

    pair = fit_pair(
        build,
        {"optimizer": "sgd", "loss": ["mse", "mae"]},
        (x, (y, y)),
        {"batch_size": 8, "epochs": 2},
    )
    assert_same(pair)
    assert {"mse_loss", "mae_loss"} <= set(pair[1][0])


def test_overridden_compute_loss_refuses_per_task_features():
    i = keras.Input((4,))
    model = _plus_100(kf.OptimizedModel)(
        i, {"a": keras.layers.Dense(1)(i), "b": keras.layers.Dense(1)(i)}
    )
    with pytest.raises(ValueError, match="compute_loss.*Received: loss_weighting='uw'"):
        model.compile("sgd", {"a": "mse", "b": "mse"}, loss_weighting="uw")
    with pytest.raises(ValueError, match="compute_loss.*Received: micro_batch_size=4"):
        model.compile("sgd", {"a": "mse", "b": "mse"}, micro_batch_size=4)


# ------------------------------------------------- 3. a functional subclass keeps the bases intact


def test_functional_subclass_does_not_rewrite_the_class_hierarchy():
    bases = kf.OptimizedModel.__bases__

    class FunctionalInInit(kf.OptimizedModel):
        def __init__(self):
            i = keras.Input((4,))
            super().__init__(inputs=i, outputs=keras.layers.Dense(1)(i))

    model = FunctionalInInit()
    assert isinstance(model, FunctionalInInit) and isinstance(model, kf.OptimizedModel)
    model.compile("sgd", "mse")
    x, y = rng_data()
    model.fit(x, y, verbose=0)
    assert kf.OptimizedModel.__bases__ == bases

    class Subclassed(kf.OptimizedModel):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    later = Subclassed()  # failed with "Functional.__init__() missing 2 arguments"
    later.compile("sgd", "mse")
    later.fit(x, y, verbose=0)


# ------------------------------------------------------------------------ 4. structured losses


def _two_heads(cls, keys=("b", "c"), shared=False):
    i = keras.Input((4,))
    h = keras.layers.Dense(3, activation="relu")(i)
    first = keras.layers.Dense(1, activation="sigmoid")(h)
    second = first if shared else keras.layers.Dense(1, activation="sigmoid")(h)
    return cls(i, {keys[0]: first, keys[1]: second})


def _binary_targets(n=32, keys=("b", "c")):
    rng = np.random.default_rng(1)
    return {k: rng.integers(0, 2, (n, 1)).astype("float32") for k in keys}


@pytest.mark.parametrize(
    "loss, loss_weights",
    [
        ({"b": ["binary_crossentropy"], "c": "mse"}, None),  # a list inside a dict
        ({"b": "binary_crossentropy", "c": "mse"}, {"b": 0.3, "c": 2.0}),  # keys != layer names
        ({"b": "binary_crossentropy"}, None),  # one output without a loss
    ],
)
def test_dict_losses_whose_keys_are_not_layer_names(loss, loss_weights):
    x, _ = rng_data()
    with warnings.catch_warnings():  # one output without a loss: its head gets no gradient
        warnings.filterwarnings("ignore", "2 trainable variable", FastloopWarning)
        pair = fit_pair(
            _two_heads,
            {"optimizer": "adam", "loss": loss, "loss_weights": loss_weights},
            (x, _binary_targets()),
            {"batch_size": 8, "epochs": 2},
        )
    assert_same(pair)


def test_two_dict_outputs_that_share_one_tensor():
    x, _ = rng_data()
    pair = fit_pair(
        lambda cls: _two_heads(cls, shared=True),
        {"optimizer": "adam", "loss": {"b": "binary_crossentropy", "c": "mse"}},
        (x, _binary_targets()),
        {"batch_size": 8, "epochs": 2},
    )
    assert_same(pair)


def _nested(cls):
    i = keras.Input((4,))
    h = keras.layers.Dense(3)(i)
    return cls(
        i,
        {
            "pair": [keras.layers.Dense(1, name="p1")(h), keras.layers.Dense(2, name="p2")(h)],
            "single": keras.layers.Dense(1, name="single")(h),
        },
    )


def test_nested_outputs_with_losses_and_weights_on_sub_structures():
    x, y = rng_data()
    targets = {"pair": [y, np.concatenate([y, -y], 1)], "single": 2 * y}
    pair = fit_pair(
        _nested,
        {
            "optimizer": "sgd",
            "loss": {"pair": ["mse", "mae"], "single": "mse"},
            "loss_weights": {"pair": [0.5, 2.0], "single": 1.5},
        },
        (x, targets),
        {"batch_size": 8, "epochs": 2},
    )
    assert_same(pair)


# --------------------------------------------------- 5. state created before the first trace


class TwoHeadNet(kf.OptimizedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.a = keras.layers.Dense(1)
        self.b = keras.layers.Dense(1)

    def call(self, x):
        h = self.hidden(x)
        return {"a": self.a(h), "b": self.b(h)}


@pytest.mark.parametrize("loss_weighting", [None, "uw", "dwa"])
def test_subclassed_model_fits_saves_and_loads(tmp_path, loss_weighting):
    x, y = rng_data()
    targets = {"a": y, "b": -y}
    model = TwoHeadNet()
    model.compile("adam", {"a": "mse", "b": "mse"}, loss_weighting=loss_weighting)
    model.fit(x, targets, batch_size=8, epochs=2, verbose=0)
    path = os.path.join(tmp_path, "net.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"TwoHeadNet": TwoHeadNet})
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    state = {v.path: v.numpy() for v in model.fastloop_step.state.weights}
    for v in loaded.fastloop_step.state.weights:
        np.testing.assert_array_equal(v.numpy(), state[v.path])
    # training continues identically after the load
    h1 = model.fit(x, targets, batch_size=8, epochs=1, verbose=0).history
    h2 = loaded.fit(x, targets, batch_size=8, epochs=1, verbose=0).history
    for key in h1:
        np.testing.assert_allclose(h2[key], h1[key], rtol=1e-6, err_msg=key)


# --------------------------------------------------------------------------- 6. legacy .h5


def test_legacy_h5_save_and_load(tmp_path):
    x, y = rng_data()
    i = keras.Input((4,))
    model = kf.OptimizedModel(i, keras.layers.Dense(1)(i))
    # a loss object: Keras 3.15 cannot reload a string loss from .h5, with keras.Model too
    model.compile("sgd", keras.losses.MeanSquaredError())
    model.fit(x, y, verbose=0)
    path = os.path.join(tmp_path, "m.h5")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kf.OptimizedModel)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    seq = kf.OptimizedSequential([keras.Input((4,)), keras.layers.Dense(1)])
    seq.compile("sgd", keras.losses.MeanSquaredError())
    seq.save(path)
    assert isinstance(keras.saving.load_model(path), kf.OptimizedSequential)


# ---------------------------------------------------- 7. variables without a gradient stay put


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01),
    ],
)
def test_variables_without_gradient_are_not_updated(optimizer):
    x, y = rng_data()

    def build(cls):
        i = keras.Input((4,))
        h = keras.layers.Dense(3)(i)
        return cls(
            i,
            {
                "used": keras.layers.Dense(1, name="used")(h),
                "unused": keras.layers.Dense(1, name="unused")(h),
            },
        )

    with pytest.warns(FastloopWarning, match=r"2 trainable variable\(s\) get no gradient"):
        pair = fit_pair(
            build,
            {"optimizer": optimizer, "loss": {"used": "mse"}},
            (x, {"used": y, "unused": y}),
            {"batch_size": 8, "epochs": 2},
        )
    assert_same(pair)
    model = pair[1][1]
    keras.utils.set_random_seed(7)
    initial = build(keras.Model)
    untouched = initial.get_layer("unused").get_weights()
    for a, b in zip(model.get_layer("unused").get_weights(), untouched):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------- 8. logs: keras.Model's keys exactly


def test_features_off_logs_are_keras_logs_with_validation():
    x, y = rng_data(40)
    pair = fit_pair(
        _single,
        {"optimizer": "adam", "loss": "mse", "metrics": ["mae"]},
        (x, y),
        {"batch_size": 16, "epochs": 2, "validation_split": 0.25},
    )
    assert_same(pair)
    assert set(pair[1][0]) == {"loss", "mae", "val_loss", "val_mae"}


def _single(cls):
    i = keras.Input((4,))
    return cls(i, keras.layers.Dense(1)(keras.layers.Dense(3, activation="tanh")(i)))


def test_requested_step_metrics_are_logged_and_kept_out_of_evaluate():
    x, y = rng_data()
    model = _single(kf.OptimizedModel)
    model.compile("sgd", "mse", log_metrics=["grad_norm", "skipped_steps"])
    history = model.fit(x, y, batch_size=8, epochs=2, validation_split=0.25, verbose=0).history
    assert set(history) == {"loss", "grad_norm", "skipped_steps", "val_loss"}
    assert history["skipped_steps"] == [0, 0]
    assert set(model.evaluate(x, y, verbose=0, return_dict=True)) == {"loss"}
    with pytest.raises(ValueError, match="log_metrics"):
        model.compile("sgd", "mse", log_metrics=["grad_nrom"])


def test_mirrored_uneven_last_batch_reports_the_one_replica_epoch_loss():
    strategy = two_replica_strategy()
    x, y = rng_data(19)  # batches of 8, 8 and 3 (split 2/1 over the replicas)
    one = _single(kf.OptimizedModel)
    with strategy.scope():
        two = _single(kf.OptimizedModel)
        two.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae"])
    two.set_weights(one.get_weights())
    one.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae"])
    h1 = one.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
    h2 = two.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
    assert set(h1) == set(h2)
    for key in h1:
        np.testing.assert_allclose(h2[key], h1[key], rtol=1e-5, err_msg=key)


# ------------------------------------------------------------------------------ 9. Sequential


def test_sequential_equals_keras_sequential_and_saves_as_itself(tmp_path):
    x, y = rng_data()

    def build(cls):
        return cls(
            [keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)]
        )

    pair = fit_pair(
        build,
        {"optimizer": "adam", "loss": "mse", "metrics": ["mae"]},
        (x, y),
        {"batch_size": 8, "epochs": 2},
        classes=(keras.Sequential, kf.OptimizedSequential),
    )
    assert_same(pair)
    model = pair[1][1]
    path = os.path.join(tmp_path, "seq.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is kf.OptimizedSequential
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_sequential_takes_every_feature():
    x, y = rng_data()
    model = kf.OptimizedSequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", gradient_clipping=1.0, micro_batch_size=4)
    history = model.fit(x, y, batch_size=8, verbose=0).history
    assert set(history) == {"loss", "grad_norm"}
    assert np.isfinite(history["loss"][0])


def test_wrapping_an_existing_model_shares_its_layers():
    base = _single(keras.Model)
    wrapped = kf.OptimizedModel(base.inputs, base.outputs)
    assert wrapped.layers[1] is base.layers[1]
    x, y = rng_data()
    np.testing.assert_array_equal(wrapped.predict(x, verbose=0), base.predict(x, verbose=0))
    tf.debugging.assert_equal(wrapped.trainable_variables[0], base.trainable_variables[0])


# ----------------------------------------- `loss` means the same for every method


@pytest.mark.parametrize("method", ["uw", "famo", "dwa", "pcgrad"])
def test_logged_loss_is_the_task_sum_for_every_method(method):
    x, y = rng_data()
    targets = {"a": y, "b": 3 * y}
    results = {}
    for weighting in (None, method):
        keras.utils.set_random_seed(7)
        model = _two_tasks()
        model.compile(keras.optimizers.SGD(0.0), {"a": "mse", "b": "mse"}, loss_weighting=weighting)
        history = model.fit(
            x, targets, batch_size=8, epochs=1, validation_split=0.25, verbose=0
        ).history
        results[weighting] = history
    reference, with_method = results[None], results[method]
    for key in ("loss", "val_loss", "a_loss", "b_loss"):
        np.testing.assert_allclose(with_method[key], reference[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(
        with_method["loss"], np.add(with_method["a_loss"], with_method["b_loss"]), rtol=1e-6
    )
    assert "objective" in with_method and "objective" not in reference
    assert "val_objective" not in with_method


def _two_tasks():
    i = keras.Input((4,))
    h = keras.layers.Dense(3, activation="tanh")(i)
    return kf.OptimizedModel(
        i, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    )


def test_unknown_loss_keys_name_the_bad_keys_and_the_outputs():
    model = _two_tasks()
    with pytest.raises(ValueError) as info:
        model.compile("sgd", {"class": "mse", "b": "mse"})
    message = str(info.value)
    assert "names outputs the model does not have: ['class']" in message
    assert "The model's outputs are ['a', 'b']" in message


def test_mixed_precision_warns_about_16_bit_outputs_at_compile():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _two_tasks()
    with pytest.warns(UserWarning, match="\\['a', 'b'\\].*bfloat16 keeps 8 bits"):
        model.compile("sgd", {"a": "mse", "b": "mse"})


def test_recommended_setup_says_what_it_chose_and_how_to_undo(capsys):
    setup = kf.tuning.recommended_setup()
    line = capsys.readouterr().out.strip()
    assert line == setup.summary()
    assert repr(setup.policy) in line and "Undo: keras.config.set_dtype_policy('float32')" in line
    keras.config.set_dtype_policy("float32")
    kf.tuning.recommended_setup(verbose=False)
    assert capsys.readouterr().out == ""
    keras.config.set_dtype_policy("float32")


# ------------------------- 10. where keras.Model's numbers depend on how its step was traced
#
# keras.Model gives two answers for the same data in these cases; OptimizedModel gives the one
# Keras intends (its eager path, or its path for data of known length). README, "deviations".


def _class_and_value_heads(cls):
    i = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(i)
    p = keras.layers.Dense(3, activation="softmax", name="p")(h)
    return cls(i, [p, keras.layers.Dense(1, name="q")(h)])


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_per_output_losses_of_a_partial_last_batch_are_keras_in_graph_and_eager_mode(
    steps_per_execution,
):
    """40 samples in batches of 16, 16, 8. Keras' `CompileLoss` weights each `{output}_loss`
    update by the prediction's *static* batch dimension: `None` in its graph step (each batch
    counts once), the batch's size in its eager step. That is Keras' definition of the logged
    value, not a bug: ours matches it on both paths, exactly."""
    x, _ = rng_data(40)
    labels = np.random.default_rng(1).integers(0, 3, 40)
    targets = np.random.default_rng(2).normal(size=(40, 1)).astype("float32")
    compile_kwargs = {
        "optimizer": "sgd",
        "loss": ["sparse_categorical_crossentropy", "mse"],
        "steps_per_execution": steps_per_execution,
    }
    fit = ((x, [labels, targets]), {"batch_size": 16, "epochs": 2})
    graph = fit_pair(_class_and_value_heads, compile_kwargs, *fit)
    assert_same(graph, atol=0)
    eager = fit_pair(_class_and_value_heads, dict(compile_kwargs, run_eagerly=True), *fit)
    assert_same(eager, atol=1e-6)
    # the partial last batch shows: graph and eager per-output logs differ (loss does not)
    (h_graph, _), (h_eager, _) = graph[1], eager[1]
    assert not np.allclose(h_graph["q_loss"], h_eager["q_loss"], rtol=1e-3)
    np.testing.assert_allclose(h_graph["loss"], h_eager["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        np.add(h_eager["p_loss"], h_eager["q_loss"]), h_eager["loss"], rtol=1e-5
    )


def test_unknown_length_data_counts_one_optimizer_step_per_batch():
    """A filtered dataset: 4 batches an epoch, cardinality unknown. keras.Model (steps_per_execution
    1) lets `optimizer.iterations` run one ahead per epoch (the end-of-data call increments it),
    which moves a step-based schedule; ours counts 4 and trains exactly like keras.Model on the
    same batches with their number known."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = rng.integers(0, 3, 48)

    def data(known):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: b != 1).batch(8)
        if known:
            ds = ds.apply(tf.data.experimental.assert_cardinality(4))
        assert (int(ds.cardinality()) == 4) == known
        return ds

    assert sum(1 for _ in data(False)) == 4
    results = []
    for cls, known in ((keras.Model, True), (kf.OptimizedModel, False)):
        keras.utils.set_random_seed(7)
        model = _single_softmax(cls)
        schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.8)
        model.compile(keras.optimizers.Adam(schedule), "sparse_categorical_crossentropy")
        history = model.fit(data(known), epochs=3, verbose=0)
        results.append((history.history, model))
    assert int(results[1][1].optimizer.iterations) == 12
    assert int(results[0][1].optimizer.iterations) == 12
    assert_same(results)
    # The reference itself: if keras.Model stops counting the end-of-data call on unknown
    # length, the README's deviation 5 can go.
    keras.utils.set_random_seed(7)
    model = _single_softmax(keras.Model)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(data(False), epochs=3, verbose=0)
    assert int(model.optimizer.iterations) > 12


def _single_softmax(cls):
    i = keras.Input((4,))
    return cls(i, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(8)(i)))


def test_mixed_float16_overflow_steps_update_weights_and_log_like_keras():
    """Under mixed_float16 the loss scale starts at 2**15 and an early step overflows.
    keras.Model and ours skip the same updates and halve the scale alike (identical weights);
    an overflow is routine (the loss is finite), so its batch is in the logged loss and
    metrics as in keras.Model: every epoch logs Keras' values."""
    keras.config.set_dtype_policy("mixed_float16")  # conftest resets it after the test
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = rng.integers(0, 3, 48)

    def build(cls):
        i = keras.Input((4,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(8, activation="relu")(i))
        return cls(i, keras.layers.Dense(3, activation="softmax")(h))

    (h_ref, m_ref), (h, m) = fit_pair(
        build,
        {"optimizer": "adam", "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]},
        (x, y),
        {"batch_size": 16, "epochs": 3},
    )
    for a, b in zip(m_ref.get_weights(), m.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)
    np.testing.assert_allclose(
        float(m.optimizer.dynamic_scale), float(m_ref.optimizer.dynamic_scale)
    )
    skipped = np.diff([0.0] + h["skipped_steps"])  # the logged count is the running total
    assert skipped[0] > 0
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h[key], h_ref[key], rtol=1e-6, err_msg=key)


# --------------------------------------------- subclass hooks: compute_metrics, own train_step


def _two_task_build(base):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return base(
        inputs,
        {
            "a": keras.layers.Dense(1, name="a")(hidden),
            "b": keras.layers.Dense(3, activation="softmax", name="b")(hidden),
        },
    )


def _two_task_data(n=48):  # whole batches of 16: no partial-batch deviation (see above)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, {"a": rng.normal(size=(n, 1)).astype("float32"), "b": rng.integers(0, 3, (n,))}


def _with_compute_metrics(base):
    class WithComputeMetrics(base):
        def compute_metrics(self, x, y, y_pred, sample_weight=None):
            logs = dict(super().compute_metrics(x, y, y_pred, sample_weight))
            logs["mean_pred"] = keras.ops.mean(tf.nest.flatten(y_pred)[0])
            return logs

    return WithComputeMetrics


def test_overridden_compute_metrics_is_called_by_the_train_step():
    """Keras' train step returns `compute_metrics(x, y, y_pred, sample_weight)`; its extra
    logs and its metric updates must reach fit's history (they did only in validation)."""
    x, y = rng_data(40)
    pair = fit_pair(
        lambda cls: (lambda i: _with_compute_metrics(cls)(i, keras.layers.Dense(1)(i)))(
            keras.Input((4,))
        ),
        {"optimizer": "sgd", "loss": "mse", "metrics": ["mae"]},
        (x, y),
        {"batch_size": 16, "epochs": 2, "validation_data": (x, y)},
    )
    assert {"mean_pred", "val_mean_pred", "mae"} <= set(pair[1][0])
    assert_same(pair)


def test_overridden_compute_metrics_runs_for_a_multi_output_model_with_clipping():
    x, y = _two_task_data()
    results = []
    for cls, extra in ((keras.Model, {}), (kf.OptimizedModel, {"gradient_clipping": 1e9})):
        keras.utils.set_random_seed(7)
        model = _two_task_build(_with_compute_metrics(cls))
        model.compile(
            "adam",
            {"a": "mse", "b": "sparse_categorical_crossentropy"},
            metrics={"b": ["accuracy"]},
            **extra,
        )
        results.append((model.fit(x, y, batch_size=16, epochs=2, verbose=0).history, model))
    assert "mean_pred" in results[1][0]
    assert results[1][0].pop("grad_norm")  # clipping logs the gradient norm too
    assert_same(results)


def test_overridden_compute_metrics_refuses_micro_batching():
    model = (lambda i: _with_compute_metrics(kf.OptimizedModel)(i, keras.layers.Dense(1)(i)))(
        keras.Input((4,))
    )
    with pytest.raises(ValueError, match="compute_metrics.*Received: micro_batch_size=2"):
        model.compile("sgd", "mse", micro_batch_size=2)


def _with_own_train_step(base):
    class OwnTrainStep(base):  # Keras' guide "Customizing what happens in fit()", multi-output
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            self._loss_tracker.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    return OwnTrainStep


def test_own_train_step_calling_compute_loss_logs_the_per_output_losses():
    """Keras' `compute_loss` updates the `{name}_loss` trackers itself; a user's train step
    that calls it must see them move (they stayed 0.0)."""
    x, y = _two_task_data()
    results = []
    for cls in (keras.Model, kf.OptimizedModel):
        keras.utils.set_random_seed(7)
        model = _two_task_build(_with_own_train_step(cls))
        model.compile("adam", {"a": "mse", "b": "sparse_categorical_crossentropy"})
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
        results.append((history, model))
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        results[-1] += (evaluated,)
    (h_ref, m_ref, e_ref), (h, m, e) = results
    assert h["a_loss"][0] > 0.0
    assert_same([(h_ref, m_ref), (h, m)])
    for key in e_ref:  # evaluate after fit: each output's loss counted once per batch
        np.testing.assert_allclose(e[key], e_ref[key], atol=1e-6, err_msg=key)


@pytest.mark.parametrize("reduction", [None, "none"])
def test_unreduced_loss_trains_and_logs_like_keras(reduction):
    """`reduction=None`: Keras differentiates the per-sample losses' sum and logs their mean."""
    x, y = rng_data(40)
    pair = fit_pair(
        lambda cls: (lambda i: cls(i, keras.layers.Dense(1)(i)))(keras.Input((4,))),
        {"optimizer": "sgd", "loss": keras.losses.MeanSquaredError(reduction=reduction)},
        (x, y),
        {"batch_size": 16, "epochs": 2, "validation_data": (x, y)},
    )
    assert_same(pair)


def test_unreduced_losses_of_two_outputs_train_and_log_like_keras():
    x, y = _two_task_data()
    results = []
    for cls in (keras.Model, kf.OptimizedModel):
        keras.utils.set_random_seed(7)
        model = _two_task_build(cls)
        model.compile(
            "adam",
            {
                "a": keras.losses.MeanSquaredError(reduction=None),
                "b": keras.losses.SparseCategoricalCrossentropy(reduction=None),
            },
            loss_weights={"a": 1.0, "b": 0.5},
        )
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        results.append((history.history, model))
    assert_same(results)


@pytest.mark.parametrize(
    "feature", [{"micro_batch_size": 2}, {"loss_weighting": "dwa"}, {"loss_weighting": "uw"}]
)
def test_unreduced_losses_refuse_what_needs_one_loss_per_batch(feature):
    model = _two_task_build(kf.OptimizedModel)
    with pytest.raises(ValueError, match="reduce to one value per batch.*Received: loss="):
        model.compile(
            "sgd", {"a": keras.losses.MeanSquaredError(reduction="none"), "b": "mse"}, **feature
        )


def test_unreduced_losses_refuse_several_replicas():
    with two_replica_strategy().scope():
        model = (lambda i: kf.OptimizedModel(i, keras.layers.Dense(1)(i)))(keras.Input((4,)))
        with pytest.raises(ValueError, match="several replicas needs every loss to reduce"):
            model.compile("sgd", keras.losses.MeanSquaredError(reduction=None))


def test_overridden_compute_metrics_forgets_a_skipped_step():
    """A batch whose gradient is NaN is skipped: metrics, extra logs and weights end as if the
    batch had not been there (the override ran, its metric updates were undone)."""
    x, y = rng_data(48)
    bad_x = x.copy()
    bad_x[16:32] = np.nan  # the middle batch of three
    clean = (np.concatenate([x[:16], x[32:]]), np.concatenate([y[:16], y[32:]]))
    runs = []
    for data in ((bad_x, y), clean):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((4,))
        model = _with_compute_metrics(kf.OptimizedModel)(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse", metrics=["mae"])
        runs.append((model.fit(*data, batch_size=16, verbose=0, shuffle=False).history, model))
    assert np.isfinite(runs[0][0]["mae"][0])
    assert_same(runs, atol=0.0)


# ------------------------------------------- checkpoints written by keras.Model or other compiles


def _regressor(cls):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,))
    return cls(inputs, keras.layers.Dense(1)(inputs))


@pytest.mark.parametrize("filename", ["ckpt.weights.h5", "model.keras"])
def test_compiled_model_loads_a_keras_model_checkpoint(tmp_path, filename):
    x, y = rng_data(32)
    source = _regressor(keras.Model)
    source.compile("adam", "mse")
    source.fit(x, y, batch_size=16, verbose=0)
    path = str(tmp_path / filename)
    source.save_weights(path) if filename.endswith(".weights.h5") else source.save(path)
    model = _regressor(kf.OptimizedModel)
    model.compile("adam", "mse", gradient_clipping=1.0)
    model.load_weights(path)  # failed: "Layer 'fastloop_state' expected 3 variables ... 0"
    for a, b in zip(source.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(b, a)
    assert int(model.skipped_steps) == 0


def test_checkpoint_of_another_loss_structure_loads_the_weights_and_names_what_it_kept(tmp_path):
    x, y = _two_task_data()
    source = _two_task_build(kf.OptimizedModel)
    source.compile("adam", {"a": "mse", "b": "sparse_categorical_crossentropy"})
    source.fit(x, y, batch_size=16, verbose=0)
    path = str(tmp_path / "two_heads.weights.h5")
    source.save_weights(path)
    model = _two_task_build(kf.OptimizedModel)
    model.compile("adam", {"a": "mse"})  # fine-tune one head: one task, not two
    with pytest.warns(FastloopWarning, match=r"\['loss_weights'\] keep their current values"):
        model.load_weights(path)
    for a, b in zip(source.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(b, a)
    np.testing.assert_array_equal(model.loss_weighting.weights.numpy(), [1.0])


def test_step_state_is_stored_and_loaded_by_name_only():
    """Index-keyed step state (an unreleased layout) is not guessed at: it is said, and the
    state keeps its values."""
    model = _regressor(kf.OptimizedModel)
    model.compile("sgd", "mse")
    state = model.fastloop_step.state
    store = {}
    state.save_own_variables(store)
    assert sorted(store) == sorted(v.name for v in state.variables)
    store["skipped_steps"] = np.int64(5)
    state.load_own_variables(store)
    assert int(model.skipped_steps) == 5
    by_index = {str(i): np.asarray(v.numpy()) for i, v in enumerate(state.variables)}
    by_index[str([v.name for v in state.variables].index("skipped_steps"))] = np.int64(9)
    with pytest.warns(kf.FastloopWarning, match="step state does not match"):
        state.load_own_variables(by_index)
    assert int(model.skipped_steps) == 5


def test_clone_model_of_a_compiled_sequential_with_features_off():
    """Keras clones any Sequential as a keras.Sequential and compiles it from the compile
    config, which must then hold no keras_fastloop-only key (it raised TypeError)."""
    x, y = rng_data(32)
    clones = []
    for cls in (keras.Sequential, kf.OptimizedSequential):
        keras.utils.set_random_seed(7)
        model = cls([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("adam", "mse", metrics=["mae"])
        model.fit(x, y, batch_size=8, verbose=0)  # a fitted model knows its tasks (review)
        clone = keras.models.clone_model(model)
        assert clone.compiled
        clone.set_weights(model.get_weights())
        clones.append(clone.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history)
    assert clones[1] == clones[0]


def test_sequential_with_features_on_clones_as_keras_advises_for_subclasses():
    """`keras.models.clone_model` builds every Sequential clone as a plain keras.Sequential,
    whose `compile` does not take our options; the README's way (Keras' advice for model
    subclasses) keeps the class and the compile options, and trains as the original."""
    x, y = rng_data(32)
    keras.utils.set_random_seed(7)
    model = kf.OptimizedSequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("adam", "mse", gradient_clipping=0.01, steps_per_execution="auto")
    clone = type(model).from_config(model.get_config())
    clone.compile_from_config(model.get_compile_config())
    assert type(clone) is kf.OptimizedSequential
    assert clone.get_compile_config() == model.get_compile_config()
    clone.set_weights(model.get_weights())
    histories = [
        m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        for m in (model, clone)
    ]
    assert histories[1] == histories[0]
    for a, b in zip(model.get_weights(), clone.get_weights()):
        np.testing.assert_array_equal(b, a)


def test_compile_config_keeps_the_features_that_are_on(tmp_path):
    model = _two_task_build(kf.OptimizedModel)
    model.compile("adam", {"a": "mse", "b": "sparse_categorical_crossentropy"})
    assert not {"gradient_clipping", "nonfinite", "task_names"} & set(model.get_compile_config())
    model.compile(
        "adam",
        {"a": "mse", "b": "sparse_categorical_crossentropy"},
        gradient_clipping=1.0,
        nonfinite="raise",
        loss_weighting="uw",
    )
    config = model.get_compile_config()
    assert {"gradient_clipping", "nonfinite", "loss_weighting"} <= set(config)
    path = str(tmp_path / "uw.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.loss_weighting.name == "uw" and loaded.gradient_clipping is not None


# ------------------------------------ a subclass' constructor arguments are its own


def _constructor_shapes(base):
    """One subclass of `base` per constructor shape; `build(name)` makes it, seeded."""

    def encoder():
        i = keras.Input((4,))
        return keras.Model(i, keras.layers.Dense(3, activation="tanh")(i))

    def decoder():
        i = keras.Input((3,))
        return keras.Model(i, keras.layers.Dense(1)(i))

    class TwoModels(base):  # keras-io's VAE(encoder, decoder)
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder = encoder, decoder

        def call(self, x):
            return self.decoder(self.encoder(x))

    class ThreeParts(base):
        def __init__(self, encoder, decoder, scale, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder, self.scale = encoder, decoder, scale

        def call(self, x):
            return self.scale * self.decoder(self.encoder(x))

    class KeywordOnly(base):
        def __init__(self, *, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder = encoder, decoder

        def call(self, x):
            return self.decoder(self.encoder(x))

    class PassesInputsOutputs(base):  # functional: its __init__ hands them to super()
        def __init__(self, units, **kwargs):
            i = keras.Input((4,))
            super().__init__(inputs=i, outputs=keras.layers.Dense(units)(i), **kwargs)

    class TensorsOwnUse(base):  # two tensors as its own arguments: not functional
        def __init__(self, a, b, **kwargs):
            super().__init__(**kwargs)
            self.shapes = (tuple(a.shape), tuple(b.shape))
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    class NoInit(base):  # the base's own (inputs, outputs) constructor
        pass

    def functional_args():
        i = keras.Input((4,))
        return i, keras.layers.Dense(1)(keras.layers.Dense(3, activation="tanh")(i))

    builders = {
        "(a, b)": lambda: TwoModels(encoder(), decoder()),
        "(a, b, c)": lambda: ThreeParts(encoder(), decoder(), 0.5),
        "keyword-only": lambda: KeywordOnly(encoder=encoder(), decoder=decoder()),
        "(units) -> super(inputs=, outputs=)": lambda: PassesInputsOutputs(1),
        "(a, b) tensors, own use": lambda: TensorsOwnUse(*functional_args()),
        "subclass(inputs, outputs)": lambda: NoInit(*functional_args()),
        "subclass(inputs=, outputs=)": lambda: NoInit(
            **dict(zip(("inputs", "outputs"), functional_args()))
        ),
        "base(inputs, outputs)": lambda: base(*functional_args()),
        "base(inputs=, outputs=)": lambda: base(
            **dict(zip(("inputs", "outputs"), functional_args()))
        ),
    }

    def build(name):
        keras.utils.set_random_seed(11)
        return builders[name]()

    return builders, build


@pytest.mark.parametrize("shape", list(_constructor_shapes(keras.Model)[0]))
def test_every_constructor_shape_builds_and_fits_like_keras(shape):
    """keras-io's VAE(encoder, decoder) failed with "Functional.__init__() missing 2 required
    positional arguments": `__new__` took any subclass' two positional arguments for
    (inputs, outputs). Functional-ness is now decided where Keras decides it."""
    x, y = rng_data()
    results = []
    for base in (keras.Model, kf.OptimizedModel):
        model = _constructor_shapes(base)[1](shape)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        results.append((isinstance(model, Functional), history, model))
    (f_ref, h_ref, m_ref), (f, h, m) = results
    assert f == f_ref
    assert isinstance(m, kf.OptimizedModel)
    assert h == h_ref
    for a, b in zip(m_ref.get_weights(), m.get_weights()):
        np.testing.assert_array_equal(b, a)
    assert kf.OptimizedModel.__bases__ == (kf.model.OptimizedTrainer, keras.Model)


# ----------------------------------- loading after Keras' registry has been cleared


@pytest.fixture
def cleared_registry():
    """`keras.saving.get_custom_objects().clear()`, as keras-io's serialization guide does;
    the registry is restored afterwards for the other tests."""
    registry = keras.saving.get_custom_objects()
    saved = dict(registry)
    registry.clear()
    try:
        yield
    finally:
        registry.clear()
        registry.update(saved)


CUSTOM = {"OptimizedModel": kf.OptimizedModel, "OptimizedSequential": kf.OptimizedSequential}


def _saved_models(tmp_path):
    x, y = rng_data()
    i = keras.Input((4,))
    functional = kf.OptimizedModel(i, keras.layers.Dense(1)(i))
    sequential = kf.OptimizedSequential([keras.Input((4,)), keras.layers.Dense(1)])
    out = {}
    for name, model in (("functional", functional), ("sequential", sequential)):
        # a loss object: Keras 3.15 cannot reload a string loss from .h5 (keras.Model too);
        # gradient_clipping: one of our own objects in the compile config
        model.compile("sgd", keras.losses.MeanSquaredError(), gradient_clipping=1.0)
        model.fit(x, y, verbose=0)
        for ext in ("keras", "h5"):
            model.save(str(tmp_path / f"{name}.{ext}"))
        out[name] = (model, model.to_json())
    return x, out


@pytest.mark.parametrize("how", ["custom_objects", "custom_object_scope", "model_from_json", "h5"])
def test_saved_models_load_after_the_registry_is_cleared(tmp_path, how, request):
    x, saved = _saved_models(tmp_path)
    request.getfixturevalue("cleared_registry")
    for name, (model, json) in saved.items():
        if how == "custom_objects":
            loaded = keras.saving.load_model(str(tmp_path / f"{name}.keras"), custom_objects=CUSTOM)
        elif how == "custom_object_scope":
            with keras.saving.custom_object_scope(CUSTOM):
                loaded = keras.saving.load_model(str(tmp_path / f"{name}.keras"))
        elif how == "model_from_json":
            loaded = keras.models.model_from_json(json, custom_objects=CUSTOM)
            loaded.set_weights(model.get_weights())
        else:
            loaded = keras.saving.load_model(str(tmp_path / f"{name}.h5"), custom_objects=CUSTOM)
        assert type(loaded).__name__ == type(model).__name__, name
        expected = kf.OptimizedSequential if name == "sequential" else kf.OptimizedModel
        assert isinstance(loaded, expected), name
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
        if how in ("custom_objects", "custom_object_scope"):  # compile config: our clipping too
            assert isinstance(loaded.gradient_clipping, kf.clipping.ClipByGlobalNorm), name


def test_a_bare_load_after_the_registry_is_cleared_names_the_class(tmp_path, cleared_registry):
    """Keras finds a library's classes only through the registry or `custom_objects`: after
    `clear()` a bare `load_model` fails as for any custom class, naming the class to pass."""
    keras.saving.get_custom_objects().update(CUSTOM)  # for the save only
    _saved_models(tmp_path)
    keras.saving.get_custom_objects().clear()
    with pytest.raises(TypeError, match="Could not locate class 'OptimizedModel'"):
        keras.saving.load_model(str(tmp_path / "functional.keras"))


def test_classes_serialize_under_their_bare_names_and_old_names_still_load():
    i = keras.Input((4,))
    model = kf.OptimizedModel(i, keras.layers.Dense(1)(i))
    assert keras.saving.get_registered_name(type(model)) == "OptimizedModel"
    assert keras.saving.get_registered_name(kf.OptimizedSequential) == "OptimizedSequential"
    # a file written by an earlier version names the class "keras_fastloop>OptimizedModel"
    old = model.to_json().replace(
        '"registered_name": "OptimizedModel"', '"registered_name": "keras_fastloop>OptimizedModel"'
    )
    assert old != model.to_json()
    assert isinstance(keras.models.model_from_json(old), kf.OptimizedModel)
