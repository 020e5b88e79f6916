"""OptimizedModel under MirroredStrategy (2 logical CPU devices): exact and replica-invariant.

Every test compares 1 replica (default strategy) with 2 replicas on the same global batches and
the same initial weights. Clipping acts on the gradient that is applied (the sum over
replicas), which Keras' own `global_clipnorm` does not.
"""

import collections
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

import keras_fastloop as kf
from keras_fastloop import weighting as weighting_module
from keras_fastloop._step import distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # integration: the slow job

GLOBAL_BATCH = 8


def _two_replicas():
    """One MirroredStrategy over the 2 logical CPUs for the whole process.

    TensorFlow numbers collective instances per strategy object from the same start, so two
    MirroredStrategy objects on the same devices in one process can clash ("Shape mismatch in
    the collective instance") once their collectives differ; tests share one.
    """
    return two_replica_strategy()


def _data(n=32, nan_at=None):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = {
        "a": (x @ rng.normal(size=(4, 1)) * 5.0).astype("float32"),
        "b": (rng.normal(size=(n, 1)) * 3.0).astype("float32"),
    }
    sw = rng.uniform(0.0, 2.0, size=(n,)).astype("float32")
    sw[::5] = 0.0
    if nan_at is not None:
        x[nan_at, 0] = np.nan
    return x, y, sw


def _dataset(x, y, sw):
    return tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(GLOBAL_BATCH)


def _build(cls, regularize=True):
    keras.utils.set_random_seed(3)
    reg = keras.regularizers.L2(0.01) if regularize else None
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", kernel_regularizer=reg, name="shared")(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a")(h),
        "b": keras.layers.Dense(1, name="b")(h),
    }
    return cls(inputs, outputs)


_INITIAL = {}


def _initial_weights():
    if "w" not in _INITIAL:
        _INITIAL["w"] = [w.numpy() for w in _build(keras.Model).weights]
    return _INITIAL["w"]


def _train(strategy, cls=kf.OptimizedModel, epochs=2, data=None, optimizer=None, **kwargs):
    """Fit under `strategy`; return (per-epoch losses, final weights, per-replica weights)."""
    x, y, sw = data if data is not None else _data()
    with strategy.scope():
        model = _build(cls, regularize=kwargs.pop("regularize", True))
        model.set_weights(_initial_weights())
        opt = optimizer() if optimizer else keras.optimizers.SGD(0.05, momentum=0.9)
        # Adaptive weighting methods refuse loss_weights (weighting.check_loss_weights).
        loss_weights = None if kwargs.get("loss_weighting") else {"a": 1.0, "b": 0.5}
        if "shared" in kwargs:  # a function of the model: its variables exist only here
            kwargs["shared_variables"] = kwargs.pop("shared")(model)
        model.compile(opt, {"a": "mse", "b": "mse"}, loss_weights=loss_weights, **kwargs)
    history = model.fit(_dataset(x, y, sw), epochs=epochs, verbose=0)
    replicas = [
        [np.asarray(v) for v in strategy.experimental_local_results(w.value)]
        for w in model.trainable_weights
    ]
    return history.history, [w.numpy() for w in model.weights], replicas, model


def _assert_invariant(one, two, atol=1e-5):
    (h1, w1, _, _), (h2, w2, r2, _) = one, two
    np.testing.assert_allclose(h2["loss"], h1["loss"], rtol=1e-5, atol=atol)
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=atol)
    for per_replica in r2:  # every replica holds the same weights
        np.testing.assert_array_equal(per_replica[0], per_replica[1])


def _lso():
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0**10, dynamic_growth_steps=3
    )


# ----------------------------------------------------------------------- replica invariance


def test_all_features_replica_invariant():
    """Clipping + loss scaling + regularization + sample weights + loss-based weighting + micro-batches."""
    strategy = _two_replicas()
    kwargs = dict(gradient_clipping=1.0, loss_weighting="loss_ema", micro_batch_size=2)
    one = _train(tf.distribute.get_strategy(), optimizer=_lso, **kwargs)
    two = _train(strategy, optimizer=_lso, **kwargs)
    _assert_invariant(one, two)
    # The clip was active (true norms above 1.0) and the loss scale moved identically.
    assert min(one[0]["grad_norm"]) > 1.0
    np.testing.assert_array_equal(two[0]["loss_scale"], one[0]["loss_scale"])
    np.testing.assert_allclose(
        two[3].loss_weighting.weights.numpy(), one[3].loss_weighting.weights.numpy(), atol=1e-6
    )


@pytest.mark.parametrize("method", ["pcgrad", "db_mtl"])
def test_given_shared_subset_replica_invariant(method):
    """Only the trunk's kernel shared (its bias then gets the plain sum): 2 replicas equal 1."""
    strategy = _two_replicas()
    kwargs = dict(loss_weighting=method, regularize=False)
    shared = lambda model: [model.get_layer("shared").kernel]  # noqa: E731
    one = _train(tf.distribute.get_strategy(), shared=shared, **kwargs)
    two = _train(strategy, shared=shared, **kwargs)
    _assert_invariant(one, two)
    assert two[3].loss_weighting.shared_variable_paths == ["shared/kernel"]
    inferred = _train(tf.distribute.get_strategy(), **kwargs)
    assert inferred[3].loss_weighting.shared_variable_paths == ["shared/kernel", "shared/bias"]
    assert not np.array_equal(inferred[1][1], one[1][1])  # the bias: the subset acted


def test_micro_batching_replica_invariant():
    strategy = _two_replicas()
    one = _train(tf.distribute.get_strategy(), gradient_clipping=1.0, micro_batch_size=3)
    two = _train(strategy, gradient_clipping=1.0, micro_batch_size=3)
    _assert_invariant(one, two)


_METHODS = [m for m in ("uw", "rlw", "dwa", "famo") if m in weighting_module.METHODS] + [
    m for m in weighting_module.METHODS if weighting_module.get(m).requires_task_gradients
][:1]


@pytest.mark.parametrize("method", _METHODS)
def test_weighting_methods_replica_invariant(method):
    """FAMO included: its objective takes the log of the global losses (loss_shares)."""
    strategy = _two_replicas()
    data = _data(n=16)
    one = _train(tf.distribute.get_strategy(), epochs=1, data=data, loss_weighting=method)
    two = _train(strategy, epochs=1, data=data, loss_weighting=method)
    _assert_invariant(one, two)
    for key in [k for k in one[0] if k == "objective" or k.endswith("_weight")]:
        np.testing.assert_allclose(two[0][key], one[0][key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_features_off_equals_keras_under_two_replicas():
    strategy = _two_replicas()
    data = _data(n=16)
    ours = _train(strategy, epochs=1, data=data)
    theirs = _train(strategy, cls=keras.Model, epochs=1, data=data)
    np.testing.assert_allclose(ours[0]["loss"], theirs[0]["loss"], rtol=1e-5)
    for a, b in zip(ours[1], theirs[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- clipping the cross-replica sum


def _applied_update_norm(strategy, cls, **compile_kwargs):
    """Global norm of the first update (SGD, lr 1): the gradient that was actually applied."""
    x, y, _ = _data(n=GLOBAL_BATCH)
    with strategy.scope():
        model = _build(cls, regularize=False)
        model.set_weights(_initial_weights())
        model.compile(
            keras.optimizers.SGD(1.0, **compile_kwargs.pop("opt", {})), "mse", **compile_kwargs
        )
    before = [w.numpy() for w in model.trainable_weights]
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), verbose=0)
    after = [w.numpy() for w in model.trainable_weights]
    return float(np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(after, before))))


def test_c10_clipping_acts_on_the_applied_gradient():
    strategy = _two_replicas()
    keras_one = _applied_update_norm(
        tf.distribute.get_strategy(), keras.Model, opt={"global_clipnorm": 1.0}
    )
    keras_two = _applied_update_norm(strategy, keras.Model, opt={"global_clipnorm": 1.0})
    ours_two = _applied_update_norm(strategy, kf.OptimizedModel, gradient_clipping=1.0)
    # Keras clips each replica's share before the sum: the applied update exceeds the clip.
    np.testing.assert_allclose(keras_one, 1.0, rtol=1e-5)
    assert keras_two > 1.05, keras_two
    # OptimizedModel clips the summed gradient: exactly the threshold, as on one replica.
    np.testing.assert_allclose(ours_two, 1.0, rtol=1e-5)


# --------------------------------------------------------------------- non-finite decision


def _nan_run(strategy, cls, **kwargs):
    x, y, sw = _data(n=16, nan_at=GLOBAL_BATCH // 2 + 1)  # replica 1's shard of the 1st batch
    with strategy.scope():
        model = _build(cls)
        model.set_weights(_initial_weights())
        model.compile(
            kwargs.pop("optimizer", lambda: keras.optimizers.SGD(0.05))(),
            {"a": "mse", "b": "mse"},
            **kwargs,
        )
    before = [w.numpy() for w in model.weights]
    first = _dataset(x, y, sw).take(1)
    model.fit(first, verbose=0)
    replicas = [
        [np.asarray(v) for v in strategy.experimental_local_results(w.value)]
        for w in model.trainable_weights
    ]
    return model, before, replicas


@EXPECT_SKIP_WARNINGS[0]  # the NaN batch is skipped on purpose (the skip report warns)
@EXPECT_SKIP_WARNINGS[1]
@pytest.mark.parametrize("loss_scale", [False, True], ids=["sgd", "loss_scale"])
def test_nan_on_one_replica_skips_the_update_on_every_replica(loss_scale):
    strategy = _two_replicas()
    kwargs = {"gradient_clipping": 1.0}
    if loss_scale:
        kwargs["optimizer"] = _lso
    model, before, replicas = _nan_run(strategy, kf.OptimizedModel, **kwargs)
    for per_replica, w in zip(replicas, before):
        np.testing.assert_array_equal(per_replica[0], w)
        np.testing.assert_array_equal(per_replica[1], w)
    if loss_scale:
        # NaN data makes the (global) loss NaN: bad data, not an overflow, so the scale stays
        assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**10
    assert int(model.skipped_steps.numpy()) == 1
    assert int(model.optimizer.iterations.numpy()) == 0


def test_nan_on_one_replica_corrupts_plain_keras():
    """Documents why the decision must be taken on the summed gradient."""
    strategy = _two_replicas()
    _, _, replicas = _nan_run(strategy, keras.Model)
    assert all(np.isnan(r).any() for r in replicas[0])


def test_keras_still_fails_on_integer_steps_per_execution_under_two_replicas():
    """Why `compile` refuses it (keras#19246): when this fails, Keras is fixed; drop the check."""
    with two_replica_strategy().scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        model.compile("sgd", "mse", steps_per_execution=4)
    x = np.ones((64, 3), "float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="placeholder"):
        model.fit(x, np.ones((64, 2), "float32"), batch_size=8, epochs=1, verbose=0)


# ---------------------------------------------------------------------------- regularization


def test_regularization_counted_once_per_global_batch():
    """Zero data loss (all sample weights 0): the update is the L2 term's alone, on 1 or 2 replicas.

    Keras 3.15's TensorFlow trainer divides regularization losses by the number of replicas
    (`_aggregate_additional_loss`), so plain Keras counts them once as well; OptimizedModel
    does the same division itself (its step does not use Keras' `compute_loss`).
    """
    strategy = _two_replicas()
    x, y, sw = _data(n=GLOBAL_BATCH)
    data = (x, y, np.zeros_like(sw))
    runs = {}
    for name, strat, cls in [
        ("ours_1", tf.distribute.get_strategy(), kf.OptimizedModel),
        ("ours_2", strategy, kf.OptimizedModel),
        ("keras_2", strategy, keras.Model),
    ]:
        runs[name] = _train(
            strat, cls=cls, epochs=1, data=data, optimizer=lambda: keras.optimizers.SGD(1.0)
        )[1]
    kernel = _initial_weights()[0]
    expected = kernel - 1.0 * 2 * 0.01 * kernel
    for name, weights in runs.items():
        np.testing.assert_allclose(weights[0], expected, rtol=1e-6, err_msg=name)


# ------------------------------------------------------------------------ collective count


def _collective_ops(model, dataset):
    """Cross-replica collective ops in the traced train function, by op type.

    Reads Keras 3.15's `multi_step_on_iterator` from the closure of `train_function`: the
    traced step must run under the model's own `make_function` (which keeps the optimizer
    from all-reducing a second time), and Keras' `train_function` cannot be re-traced inside
    another `tf.function` (its `raise StopIteration`). Breaks loudly if Keras renames it.
    """
    model.make_train_function()
    fn = inspect.getclosurevars(model.train_function).nonlocals["multi_step_on_iterator"]
    strategy = model.distribute_strategy
    graph = fn.get_concrete_function(iter(strategy.experimental_distribute_dataset(dataset))).graph
    counts = collections.Counter()
    seen = set()

    def walk(g):
        for op in g.get_operations():
            if any(k in op.type for k in ("AllReduce", "CollectiveReduce", "NcclAllReduce")):
                counts[op.type] += 1
        for name, f in getattr(g, "_functions", {}).items():
            sub = getattr(f, "graph", None)
            if sub is not None and name not in seen:
                seen.add(name)
                walk(sub)

    walk(graph)
    return sum(counts.values())


def test_one_small_all_reduce_more_than_plain_fit():
    """The gradients' all-reduce (as Keras) plus one small one: every task's loss denominator,
    the batch size and the losses (keras_fastloop/_step/loss_shares.py), which makes replicas with
    unequal shares exact and also serves the loss-scale check (no third collective)."""
    strategy = _two_replicas()
    x, y, sw = _data(n=16)
    dataset = _dataset(x, y, sw)
    with strategy.scope():
        plain = _build(keras.Model)
        plain.compile(keras.optimizers.SGD(0.1), {"a": "mse", "b": "mse"})
        ours = _build(kf.OptimizedModel)
        ours.compile(_lso(), {"a": "mse", "b": "mse"}, gradient_clipping=1.0)
    n_plain = _collective_ops(plain, dataset)
    n_ours = _collective_ops(ours, dataset)
    assert n_plain >= 1  # the count sees Keras' own gradient all-reduce
    # Plain fit issues one all-reduce (the gradients'), seen once per replica and per traced
    # copy of the step: n_plain ops. Ours: two all-reduces (the denominators', then the
    # gradients'), so twice as many ops.
    assert n_ours == 2 * n_plain, (n_ours, n_plain)


def test_gradients_already_reduced_is_reentrant_and_restores_the_optimizer():
    strategy = _two_replicas()
    with strategy.scope():
        optimizer = keras.optimizers.SGD()
    with strategy.scope(), distributed.gradients_already_reduced(optimizer):
        with distributed.gradients_already_reduced(optimizer):
            assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
        assert "_all_reduce_sum_gradients" in optimizer.__dict__
    assert "_all_reduce_sum_gradients" not in optimizer.__dict__
