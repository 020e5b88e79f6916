"""compile(sam_rho=...): sharpness-aware minimization against a hand-written GradientTape loop.

SAM (Foret et al., ICLR 2021): the gradient g at w, the perturbation e = rho * g / ||g|| (ASAM,
Kwon et al. 2021: e = rho * T^2 g / ||T g||, T = |w| + 0.01), the gradient at w + e, w restored,
that gradient applied.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

import keras_fastloop as kf
from keras_fastloop._warnings import FastloopWarning

RHO = 0.05
BATCH = 32


def _digits(n=224):
    (x, y), _ = kf.datasets.load_digits_data(image_size=8)
    return x[:n].reshape(n, 64), y[:n]


def _layers():
    keras.utils.set_random_seed(11)
    return [
        keras.Input((64,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(10, dtype="float32"),
    ]


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit(x, y, batch_size=BATCH, **options):
    model = kf.OptimizedSequential(_layers())
    model.compile(keras.optimizers.SGD(0.5), _loss(), **options)
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model, history


def _perturbation(grads, variables, rho, adaptive):
    if adaptive:
        t = [tf.abs(v) + 0.01 for v in variables]
        norm = tf.sqrt(sum(tf.reduce_sum(tf.square(ti * g)) for ti, g in zip(t, grads)))
        factor = rho / (norm + 1e-12)
        return [factor * ti * ti * g for ti, g in zip(t, grads)]
    norm = tf.sqrt(sum(tf.reduce_sum(tf.square(g)) for g in grads))
    factor = rho / (norm + 1e-12)
    return [factor * g for g in grads]


def _reference(x, y, rho=RHO, adaptive=False, clip=None):
    """The hand-written SAM loop: perturb, recompute, restore, (clip,) apply."""
    model = keras.Sequential(_layers())
    optimizer = keras.optimizers.SGD(0.5)
    loss_fn = _loss()
    variables = model.trainable_variables
    for start in range(0, len(x), BATCH):
        xb, yb = x[start : start + BATCH], y[start : start + BATCH]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, variables)
        saved = [tf.identity(v) for v in variables]
        for v, e in zip(variables, _perturbation(grads, variables, rho, adaptive)):
            v.assign_add(e)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, variables)
        for v, s in zip(variables, saved):
            v.assign(s)
        if clip is not None:
            grads, _ = tf.clip_by_global_norm(grads, clip)
        optimizer.apply(grads, variables)
    return [v.numpy() for v in variables]


def _assert_weights(model, expected, atol=1e-6):
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_equals_hand_written_loop(adaptive):
    x, y = _digits()
    expected = _reference(x, y, adaptive=adaptive)
    model, _ = _fit(x, y, sam_rho=RHO, sam_adaptive=adaptive)
    _assert_weights(model, expected)
    plain, _ = _fit(x, y)
    assert max(np.abs(a - b).max() for a, b in zip(plain.get_weights(), expected)) > 1e-4


def test_sam_clips_the_second_gradient_only():
    x, y = _digits()
    expected = _reference(x, y, clip=0.2)
    model, _ = _fit(x, y, sam_rho=RHO, gradient_clipping=0.2)
    _assert_weights(model, expected)


def test_sam_micro_batching_equals_full_batch():
    x, y = _digits()
    full, want = _fit(x, y, sam_rho=RHO, metrics=["accuracy"])
    micro, got = _fit(x, y, sam_rho=RHO, micro_batch_size=8, metrics=["accuracy"])
    _assert_weights(micro, full.get_weights(), atol=1e-5)
    for name in ("loss", "accuracy"):  # of the first pass only
        np.testing.assert_allclose(got.history[name], want.history[name], rtol=1e-5)


def test_sam_second_pass_leaves_metrics_and_statistics():
    """The loss and metrics are those of the first pass (at w); BatchNormalization's moving
    statistics are updated once per step."""
    x, y = _digits(64)
    keras.utils.set_random_seed(5)
    layers = [keras.Input((64,)), keras.layers.BatchNormalization(), keras.layers.Dense(10)]
    model = kf.OptimizedSequential(layers)
    model.compile(keras.optimizers.SGD(0.0), _loss(), metrics=["accuracy"], sam_rho=RHO)
    keras.utils.set_random_seed(5)
    plain = kf.OptimizedSequential(
        [keras.Input((64,)), keras.layers.BatchNormalization(), keras.layers.Dense(10)]
    )
    plain.compile(keras.optimizers.SGD(0.0), _loss(), metrics=["accuracy"])
    got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    want = plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
    _assert_weights(model, plain.get_weights())


def test_sam_nonfinite_first_gradient_skips_the_step():
    x, y = _digits(64)
    x = x.copy()
    x[40, 3] = np.nan  # second batch
    with pytest.warns(FastloopWarning, match="1 training step skipped for a non-finite"):
        model, history = _fit(x, y, sam_rho=RHO, log_metrics=["skipped_steps"])
    assert history.history["skipped_steps"][-1] == 1
    assert int(model.optimizer.iterations) == 1
    assert all(np.isfinite(w).all() for w in model.get_weights())


@EXPECT_SKIP_WARNINGS[1]
def test_sam_mixed_float16_overflow_skips_then_trains():
    """Scaled first gradients that overflow skip the step and halve the scale; no NaN reaches
    the weights through the perturbation."""
    x, y = _digits()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = kf.OptimizedSequential(_layers())
        initial = [w.copy() for w in model.get_weights()]
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.5), initial_scale=2.0**24
        )
        model.compile(optimizer, _loss(), sam_rho=RHO)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert float(optimizer.dynamic_scale) < 2.0**24
    assert 0 < int(optimizer.iterations) < len(x) // BATCH
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), initial)) > 1e-3


@pytest.mark.parametrize("options", [{"steps_per_execution": 3}, {"run_eagerly": True}])
def test_sam_same_numbers_grouped_and_eager(options):
    x, y = _digits(160)
    base, _ = _fit(x, y, sam_rho=RHO)
    other, _ = _fit(x, y, sam_rho=RHO, **options)
    _assert_weights(other, base.get_weights())


def _reference_mixed(x, y, optimizer):
    """The hand-written SAM loop under mixed_float16: the perturbation from the unscaled
    gradient, the second gradient applied through the `LossScaleOptimizer`."""
    model = keras.Sequential(_layers())
    loss_fn = _loss()
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function  # float16 kernels differ between eager and graph: compare graph with graph
    def step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(loss_fn(yb, model(xb, training=True)))
        scale = optimizer.dynamic_scale
        grads = [g / scale for g in tape.gradient(scaled, variables)]
        saved = [tf.identity(v) for v in variables]
        for v, e in zip(variables, _perturbation(grads, variables, RHO, False)):
            v.assign_add(e)
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(loss_fn(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, variables)
        for v, s in zip(variables, saved):
            v.assign(s)
        optimizer.apply(grads, variables)

    for start in range(0, len(x), BATCH):
        step(x[start : start + BATCH], y[start : start + BATCH])
    return [v.numpy() for v in variables]


def test_sam_mixed_float16_equals_hand_written_loop():
    x, y = _digits()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        expected = _reference_mixed(
            x, y, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5))
        )
        model = kf.OptimizedSequential(_layers())
        model.compile(keras.optimizers.SGD(0.5), _loss(), sam_rho=RHO)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    _assert_weights(model, expected)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("options", [{}, {"micro_batch_size": 8, "gradient_clipping": 0.2}])
def test_sam_two_replicas_uneven_equals_one(options):
    x, y = _digits(221)  # last batch of 29: 15 and 14 per replica
    one, _ = _fit(x, y, sam_rho=RHO, **options)
    with two_replica_strategy().scope():
        two, _ = _fit(x, y, sam_rho=RHO, **options)
    _assert_weights(two, one.get_weights(), atol=1e-5)


@pytest.mark.parametrize("rho", [0, -0.1, float("nan"), float("inf"), "0.05", True, [0.05]])
def test_sam_rho_bad_input(rho):
    model = kf.OptimizedSequential(_layers())
    with pytest.raises(ValueError, match="Received: sam_rho="):
        model.compile("sgd", _loss(), sam_rho=rho)
    assert not model.compiled


def test_sam_adaptive_bad_input():
    model = kf.OptimizedSequential(_layers())
    with pytest.raises(ValueError, match="Received: sam_adaptive=1"):
        model.compile("sgd", _loss(), sam_rho=RHO, sam_adaptive=1)
    with pytest.raises(ValueError, match="Received: sam_adaptive=True"):
        model.compile("sgd", _loss(), sam_adaptive=True)


def test_sam_custom_train_step_refused():
    class Own(kf.OptimizedSequential):
        def train_step(self, data):
            return super().train_step(data)

    with pytest.raises(ValueError, match="Received: sam_rho=0.05"):
        Own(_layers()).compile("sgd", _loss(), sam_rho=RHO)


def test_sam_survives_save_and_load(tmp_path):
    x, y = _digits(64)
    model, _ = _fit(x, y, sam_rho=RHO, sam_adaptive=True)
    path = tmp_path / "sam.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    config = loaded.get_compile_config()
    assert config["sam_rho"] == RHO and config["sam_adaptive"] is True
    assert (
        loaded.fastloop_step.settings.sam_rho == RHO and loaded.fastloop_step.settings.sam_adaptive
    )


def test_sam_through_optimized_equals_hand_written_loop():
    x, y = _digits()
    expected = _reference(x, y)
    model = keras.Sequential(_layers())
    model.compile(keras.optimizers.SGD(0.5), _loss())
    kf.optimized(model, sam_rho=RHO).fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _assert_weights(model, expected)
