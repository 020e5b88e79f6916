"""Features that compose: every pair of step features against its reference run.

Features that must not change the mathematics ("neutral"): `steps_per_execution=4`,
`micro_batch_size`, two replicas, the optimizer's `gradient_accumulation_steps` (two batches
of 8 accumulated == one batch of 16 with SGD). Features that do change it: `gradient_clipping`,
`mixed_float16`, a loss-based (`uw`) and a gradient-based (`pcgrad`) weighting. Each pair
that contains a neutral feature is compared with the run without it (the reference:
`steps_per_execution=1`, full batch, one replica, no accumulation) — exact to 1e-5, or to
2e-3 under `mixed_float16`, where float16 gradients are rounded per micro-batch or replica
before they are summed (a difference by nature). Pairs of two non-neutral features are checked
for finite, decreasing training and exact step counts. The fit-loop pairs (resume,
PeriodicValidation, ModelCheckpoint x `steps_per_execution`) are in `test_fit_loop.py`.
"""

import contextlib
import itertools

import keras
import numpy as np
import pytest
from _helpers import two_replica_strategy

import keras_fastloop as kf

pytestmark = pytest.mark.slow  # integration: the slow job

SAMPLES, BATCH, EPOCHS = 64, 16, 2
NEUTRAL = ("spe4", "micro", "replicas", "accumulation")
CHANGING = ("clipping", "mixed_float16", "uw", "pcgrad")


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    return x, {"a": np.sin(x[:, :1]), "b": np.cos(x[:, 1:2]) + x[:, 2:3]}


def _initial_weights():
    rng = np.random.default_rng(11)
    shapes = [(4, 8), (8,), (8, 1), (1,), (8, 1), (1,)]
    return [rng.normal(scale=0.5, size=s).astype("float32") for s in shapes]


def _build():
    i = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(i)
    outputs = {
        "a": keras.layers.Dense(1, name="a", dtype="float32")(h),
        "b": keras.layers.Dense(1, name="b", dtype="float32")(h),
    }
    model = kf.OptimizedModel(i, outputs)
    model.set_weights(_initial_weights())
    return model


def run(features):
    """Train the two-head model with `features`; returns (weights, history, iterations)."""
    features = set(features)
    if "mixed_float16" in features:
        keras.config.set_dtype_policy("mixed_float16")
    accumulate = "accumulation" in features
    kwargs = {
        "gradient_clipping": 0.5 if "clipping" in features else None,
        "loss_weighting": "uw" if "uw" in features else "pcgrad" if "pcgrad" in features else None,
        "micro_batch_size": 5 if "micro" in features else None,
        "steps_per_execution": 4 if "spe4" in features else 1,
    }
    scope = two_replica_strategy().scope() if "replicas" in features else contextlib.nullcontext()
    with scope:
        model = _build()
        optimizer = keras.optimizers.SGD(
            0.05, momentum=0.5, gradient_accumulation_steps=2 if accumulate else None
        )
        if "mixed_float16" in features:  # a scale that does not overflow on this problem
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**8)
        model.compile(optimizer, {"a": "mse", "b": "mse"}, **kwargs)
    x, y = _data()
    batch = BATCH // 2 if accumulate else BATCH
    history = model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    keras.config.set_dtype_policy("float32")
    applied = int(model.optimizer.iterations.numpy())
    return model.get_weights(), history.history, (applied, int(model.skipped_steps.numpy()))


STEPS = EPOCHS * SAMPLES // BATCH


def _pairs():
    for pair in itertools.combinations(NEUTRAL + CHANGING, 2):
        if set(pair) <= set(CHANGING):
            continue
        yield pair


def _refused(pair):
    pair = set(pair)
    return pair in (
        {"accumulation", "clipping"},
        {"accumulation", "replicas"},  # fails in keras.Model.fit too: refused at compile
        {"spe4", "replicas"},  # the same (keras#19246)
        {"micro", "pcgrad"},
    )


# PCGrad projects each batch's task gradients: accumulating two projected half-batches is not
# the projection of the whole batch (a nonlinear method; checked as a training pair below).
BY_NATURE = [("accumulation", "pcgrad")]


SLOW = {"replicas", "mixed_float16"}


@pytest.mark.parametrize(
    "pair",
    [
        pytest.param(p, marks=pytest.mark.slow, id="+".join(p))
        if set(p) >= SLOW or ("replicas" in p and "pcgrad" in p)
        else pytest.param(p, id="+".join(p))
        for p in _pairs()
        if not _refused(p) and p not in BY_NATURE
    ],
)
def test_pair_matches_its_reference(pair):
    reference_features = [f for f in pair if f in CHANGING]
    w_ref, h_ref, steps_ref = run(reference_features)
    w, h, steps = run(pair)
    assert steps == steps_ref and sum(steps) == STEPS  # (applied, skipped) updates
    tolerance = 2e-3 if "mixed_float16" in pair else 1e-5
    for got, expected in zip(w, w_ref):
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=tolerance, atol=tolerance)
    assert set(h) == set(h_ref)


@pytest.mark.parametrize("pair", [*itertools.combinations(CHANGING, 2), *BY_NATURE], ids="+".join)
def test_changing_pairs_train(pair):
    weights, history, (applied, skipped) = run(pair)
    assert (applied, skipped) == (STEPS, 0)
    assert all(np.all(np.isfinite(w)) for w in weights)
    assert history["loss"][-1] < history["loss"][0]


def test_refused_pairs_say_why_at_compile():
    model = _build()
    with pytest.raises(ValueError, match="gradient_accumulation_steps.*micro_batch_size"):
        model.compile(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
            {"a": "mse", "b": "mse"},
            gradient_clipping=1.0,
        )
    with pytest.raises(ValueError, match="micro_batch_size"):
        model.compile("sgd", {"a": "mse", "b": "mse"}, loss_weighting="pcgrad", micro_batch_size=4)
    with two_replica_strategy().scope():
        model = _build()
        with pytest.raises(ValueError, match="tf.distribute.*micro_batch_size"):
            model.compile(
                keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), {"a": "mse", "b": "mse"}
            )


def test_accumulation_with_clipping_reference_is_keras_clipped_mean():
    """The issue's two-batch case: Keras' global_clipnorm clips the accumulated mean."""
    i = keras.Input((2,))
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    model = keras.Model(i, layer(i))
    optimizer = keras.optimizers.SGD(1.0, global_clipnorm=1.0, gradient_accumulation_steps=2)
    model.compile(optimizer, lambda y_true, y_pred: -keras.ops.mean(y_pred * y_true))
    x = np.array([[1.0, 0.0], [0.0, 1.0]], "float32")
    model.fit(x, np.full((2, 1), 2.0, "float32"), batch_size=1, shuffle=False, verbose=0)
    # gradients [-2, 0] and [0, -2]: their mean [-1, -1] clipped to norm 1 -> [0.7071, 0.7071]
    # (a mean of clipped gradients would give [0.5, 0.5])
    np.testing.assert_allclose(layer.kernel.numpy()[:, 0], [0.70710677, 0.70710677], rtol=1e-6)
    # keras_fastloop refuses to do it differently (a mean of clipped gradients)
    ours = kf.OptimizedModel(i, keras.layers.Dense(1, use_bias=False)(i))
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        ours.compile(
            keras.optimizers.SGD(1.0, gradient_accumulation_steps=2), "mse", gradient_clipping=1.0
        )
