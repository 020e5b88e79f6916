"""Micro-batching: k micro-batches == one batch (masked tokens included).

Every reference is a plain `keras.Model` with the same initial weights trained on the full
batch, or a NumPy value.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

import keras_fastloop as kf
from keras_fastloop import _compile_checks, _replicas
from keras_fastloop._step import micro_batching

ATOL = 1e-6


def assert_weights_close(a, b, atol=ATOL):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, atol=atol, rtol=0)


def mlp(cls, seed=0, kernel_regularizer=None, activity_regularizer=None, dict_outputs=False):
    keras.utils.set_random_seed(seed)
    i = keras.Input((5,))
    h = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=kernel_regularizer,
        activity_regularizer=activity_regularizer,
    )(i)
    if dict_outputs:
        cls_head = keras.layers.Dense(3, activation="softmax", name="cls")(h)
        reg_head = keras.layers.Dense(2, name="reg")(h)
        return cls(i, {"cls": cls_head, "reg": reg_head})
    return cls(i, keras.layers.Dense(3, activation="softmax")(h))


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, rng.integers(0, 3, n), rng.normal(size=(n, 2)).astype("float32")


def pair(builder, optimizer, loss, micro_batch_size, **compile_kwargs):
    """A keras.Model reference and an OptimizedModel with micro-batching, same weights."""
    ref = builder(keras.Model)
    model = builder(kf.OptimizedModel)
    model.set_weights(ref.get_weights())
    ref_kwargs = {k: v for k, v in compile_kwargs.items() if k != "gradient_clipping"}
    ref.compile(optimizer(), loss, **ref_kwargs)
    model.compile(optimizer(), loss, micro_batch_size=micro_batch_size, **compile_kwargs)
    return ref, model


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.5, weight_decay=0.1),
    "adam": lambda: keras.optimizers.Adam(0.05),
}


# ------------------------------------------------ k micro-batches == one batch


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_c11_three_micro_batches_of_4_equal_one_batch_of_12(name):
    x, y, _ = data(12)
    ref, model = pair(mlp, OPTIMIZERS[name], "sparse_categorical_crossentropy", 4)
    ref.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_weights_close(ref, model)


@pytest.mark.parametrize("name", ["sgd_weight_decay", "adam"])
def test_c11_clipping_and_weight_decay_act_once_on_the_accumulated_gradient(name):
    # The threshold binds (true norm is ~1); per-micro-batch clipping would give another update.
    x, y, _ = data(12)

    def optimizer():
        return OPTIMIZERS[name]().__class__.from_config(
            {**OPTIMIZERS[name]().get_config(), "global_clipnorm": 0.05}
        )

    ref = mlp(keras.Model)
    model = mlp(kf.OptimizedModel)
    ref.compile(optimizer(), "sparse_categorical_crossentropy")
    model.compile(
        OPTIMIZERS[name](),
        "sparse_categorical_crossentropy",
        gradient_clipping=kf.clipping.ClipByGlobalNorm(0.05),
        micro_batch_size=4,
    )
    ref.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0).history
    assert history["grad_norm"][0] > 0.05 * 3  # clipping really binds
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_weights_close(ref, model)


def test_several_fit_steps_with_quarter_batches_match_keras_fit():
    x, y, _ = data(64)
    ref, model = pair(
        mlp,
        lambda: keras.optimizers.Adam(0.02),
        "sparse_categorical_crossentropy",
        4,
        metrics=["accuracy", "sparse_categorical_crossentropy"],
    )
    h_ref = ref.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], atol=1e-5, err_msg=key)
    assert int(model.optimizer.iterations.numpy()) == 12
    assert_weights_close(ref, model, atol=1e-5)
    e_ref, e = ref.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(e, e_ref, atol=1e-5)


def test_ragged_last_micro_batch():
    # Batch 10 with k=4: micro-batches of 4, 4 and 2; shares 0.4, 0.4, 0.2 (not 1/3 each).
    x, y, _ = data(10)
    ref, model = pair(mlp, lambda: keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", 4)
    h_ref = ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h["loss"], h_ref["loss"], atol=1e-6)
    assert_weights_close(ref, model)
    # A mean of the three micro-batch means is a different number: the test can tell.
    probe = mlp(keras.Model)
    ce = keras.losses.SparseCategoricalCrossentropy()
    p = probe(x)
    per_micro = [float(ce(y[s], p[s])) for s in (slice(0, 4), slice(4, 8), slice(8, 10))]
    assert abs(np.mean(per_micro) - float(ce(y, p))) > 1e-3


def test_uneven_batches_in_one_epoch():
    # 22 samples, batch 8: batches of 8, 8, 6; k=3 gives ragged micro-batches in every batch.
    x, y, _ = data(22)
    ref, model = pair(
        mlp, lambda: keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy", 3
    )
    h_ref = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h["loss"], h_ref["loss"], atol=1e-6)
    assert_weights_close(ref, model, atol=1e-5)


# ----------------------------------------------------------------------- weights of samples


@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum"])
def test_sample_weight_matches_keras(reduction):
    x, y, _ = data(12)
    sw = np.array([0, 0, 0, 0, 1, 2, 0.5, 1, 3, 0, 0, 1], "float32")  # first micro-batch: all zero
    ref, model = pair(
        mlp,
        lambda: keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(reduction=reduction),
        4,
        weighted_metrics=["accuracy"],
    )
    h_ref = ref.fit(
        x, y, sample_weight=sw, batch_size=12, epochs=2, shuffle=False, verbose=0
    ).history
    h = model.fit(x, y, sample_weight=sw, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], atol=1e-6, err_msg=key)
    assert_weights_close(ref, model)


def test_class_weight_matches_keras():
    x, y, _ = data(12)
    ref, model = pair(mlp, lambda: keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", 5)
    cw = {0: 0.1, 1: 3.0, 2: 1.0}
    h_ref = ref.fit(
        x, y, class_weight=cw, batch_size=12, epochs=2, shuffle=False, verbose=0
    ).history
    h = model.fit(x, y, class_weight=cw, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h["loss"], h_ref["loss"], atol=1e-6)
    assert_weights_close(ref, model)


def test_multi_output_with_loss_weights_and_metrics():
    x, y_cls, y_reg = data(12)
    y = {"cls": y_cls, "reg": y_reg}
    ref, model = pair(
        lambda cls: mlp(cls, dict_outputs=True),
        lambda: keras.optimizers.Adam(0.02),
        {"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        4,
        loss_weights={"cls": 1.0, "reg": 0.3},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )
    h_ref = ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], atol=1e-6, err_msg=key)
    np.testing.assert_allclose(
        h["loss"], np.add(h["cls_loss"], np.multiply(0.3, h["reg_loss"])), atol=1e-6
    )
    assert_weights_close(ref, model, atol=1e-5)


def test_kernel_and_activity_regularizers_count_once_per_batch():
    x, y, _ = data(12)

    def builder(cls):
        return mlp(
            cls,
            kernel_regularizer=keras.regularizers.L2(0.5),
            activity_regularizer=keras.regularizers.L2(0.3),
        )

    ref, model = pair(
        builder, lambda: keras.optimizers.SGD(0.2), "sparse_categorical_crossentropy", 4
    )
    h_ref = ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h["loss"], h_ref["loss"], atol=1e-6)
    assert_weights_close(ref, model)


# ------------------------------------------------------------------ masked, padded tokens


def seq_model(cls, two_heads=False):
    keras.utils.set_random_seed(3)
    i = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(i)
    h = keras.layers.Dense(8, activation="tanh")(h)
    tok_layer = keras.layers.Dense(4, activation="softmax", name="tok")
    tok = tok_layer(h)
    tok_layer.bias.assign([3.0, 0.0, 0.0, -3.0])  # class 0 likely, class 3 very unlikely
    if not two_heads:
        return cls(i, tok)
    return cls(i, {"tok": tok, "val": keras.layers.Dense(1, name="val")(h)})


def padded_batch():
    """8 sequences padded to 12: the first 4 long (10-12 tokens), the last 4 short (1-2)."""
    rng = np.random.default_rng(5)
    lengths = [12, 11, 10, 12, 1, 2, 1, 2]
    x = np.zeros((8, 12), "int32")
    for row, n in enumerate(lengths):
        x[row, :n] = rng.integers(1, 20, n)
    y = rng.integers(0, 3, (8, 12))
    y[4:] = 3  # the short rows have a high loss, the long rows a low one
    return x, y, rng.normal(size=(8, 12, 1)).astype("float32"), lengths


def test_masked_tokens_are_weighted_equally_not_per_micro_batch():
    x, y, _, lengths = padded_batch()
    ref, model = pair(
        seq_model,
        lambda: keras.optimizers.SGD(0.5),
        "sparse_categorical_crossentropy",
        4,
        metrics=["accuracy"],
    )
    h_ref = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], atol=1e-6, err_msg=key)
    assert_weights_close(ref, model)

    # The naive mean of micro-batch means (HF PR#34191) is far from the token mean here.
    probe = seq_model(keras.Model)
    ce = keras.losses.SparseCategoricalCrossentropy()
    full = float(ce(y, probe(x)))
    naive = np.mean([float(ce(y[s], probe(x[s]))) for s in (slice(0, 4), slice(4, 8))])
    tokens = [sum(lengths[:4]), sum(lengths[4:])]
    weighted = sum(
        t * float(ce(y[s], probe(x[s]))) for t, s in zip(tokens, (slice(0, 4), slice(4, 8)))
    )
    np.testing.assert_allclose(weighted / sum(tokens), full, rtol=1e-6)
    assert abs(naive - full) > 0.5


def test_masked_padding_length_does_not_change_the_update():
    # masked loss with micro-batches: the same sequences padded to 12 or to 24 give the same step.
    x, y, _, _ = padded_batch()
    models = []
    for pad in (12, 24):
        xp = np.pad(x, ((0, 0), (0, pad - 12)))
        yp = np.pad(y, ((0, 0), (0, pad - 12)))
        model = seq_model(kf.OptimizedModel)
        model.compile(
            keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", micro_batch_size=3
        )
        model.fit(xp, yp, batch_size=8, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    assert_weights_close(*models)


def test_masked_two_tasks_with_different_reductions_and_sample_weights():
    # Two masked heads, one divided by its token count and one by its weighted token count:
    # each task needs its own denominator (one shared divisor would be wrong).
    x, y, y_val, _ = padded_batch()
    sw = np.linspace(0.5, 2.0, 8).astype("float32")[:, None]
    loss = {
        "tok": "sparse_categorical_crossentropy",
        "val": keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    }
    ref, model = pair(
        lambda cls: seq_model(cls, two_heads=True),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        loss,
        3,
        loss_weights={"tok": 1.0, "val": 0.5},
    )
    targets = {"tok": y, "val": y_val}
    h_ref = ref.fit(
        x, targets, sample_weight=sw, batch_size=8, epochs=3, shuffle=False, verbose=0
    ).history
    h = model.fit(
        x, targets, sample_weight=sw, batch_size=8, epochs=3, shuffle=False, verbose=0
    ).history
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], atol=1e-5, err_msg=key)
    assert_weights_close(ref, model, atol=1e-5)


# --------------------------------------------------------- optimizers, precision, replicas


def test_keras_gradient_accumulation_steps_keeps_working():
    x, y, _ = data(32)
    runs = []
    for cls, k in ((keras.Model, None), (kf.OptimizedModel, None), (kf.OptimizedModel, 2)):
        model = mlp(cls)
        kwargs = {} if cls is keras.Model else {"micro_batch_size": k}
        model.compile(
            keras.optimizers.SGD(0.3, momentum=0.5, gradient_accumulation_steps=2),
            "sparse_categorical_crossentropy",
            **kwargs,
        )
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append(model)
    for model in runs[1:]:
        assert int(model.optimizer.iterations.numpy()) == int(runs[0].optimizer.iterations.numpy())
        assert_weights_close(runs[0], model)
    moved = max(
        np.abs(a - b).max() for a, b in zip(runs[0].get_weights(), mlp(keras.Model).get_weights())
    )
    assert moved > 1e-3


def test_loss_scale_optimizer_gives_the_same_update():
    x, y, _ = data(12)
    ref, model = pair(mlp, lambda: keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", 4)
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=1024.0),
        "sparse_categorical_crossentropy",
        micro_batch_size=4,
    )
    h_ref = ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    h = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h["loss"], h_ref["loss"], atol=1e-6)
    assert h["loss_scale"][-1] == 1024.0
    assert_weights_close(ref, model)


def test_mixed_float16_trains_close_to_the_full_batch():
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = data(12)
    models = []
    for k in (None, 4):
        model = mlp(kf.OptimizedModel)
        with pytest.warns(UserWarning, match="not float32"):  # a float16 softmax output
            model.compile(
                keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", micro_batch_size=k
            )
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        h = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
        assert np.all(np.isfinite(h["loss"]))
        models.append(model)
    assert_weights_close(*models, atol=2e-3)


@pytest.mark.distributed
def test_mirrored_strategy_two_replicas_accumulate_per_replica_share():
    # The loop runs per replica on the replica's 8 samples (micro-batches 3, 3, 2); the
    # cross-replica sum of the accumulated gradients is the gradient of the global batch mean.
    strategy = two_replica_strategy()
    x, y, _ = data(16)
    ref = mlp(keras.Model)
    with strategy.scope():
        model = mlp(kf.OptimizedModel)
        model.compile(
            keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", micro_batch_size=3
        )
    model.set_weights(ref.get_weights())
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    )

    @tf.function
    def step(xb, yb):
        def replica_fn(xr, yr):
            result = micro_batching.accumulate(
                model, model.fastloop_step, xr, yr, None, model.trainable_variables, 3
            )
            return _replicas.all_reduce_sum([*result.grads, result.logged_loss])

        return strategy.experimental_local_results(strategy.run(replica_fn, args=(xb, yb)))[0]

    *grads, global_loss = step(*next(iter(dist)))
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy()(y, ref(x))
    expected = tape.gradient(loss, ref.trainable_variables)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, atol=1e-6)
    # per-replica losses are 1/R-scaled: their sum is the global batch's loss
    assert float(global_loss) == pytest.approx(float(loss), abs=1e-6)


def test_jit_compile_with_ragged_last_micro_batch():
    x, y, _ = data(10)
    ref = mlp(keras.Model)
    model = mlp(kf.OptimizedModel)
    ref.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
    model.compile(
        keras.optimizers.SGD(0.5),
        "sparse_categorical_crossentropy",
        jit_compile=True,
        micro_batch_size=4,
    )
    ref.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(ref, model)


# ------------------------------------------------------------------------------- errors


def test_bad_micro_batch_size_raises_at_compile():
    model = mlp(kf.OptimizedModel)
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match="micro_batch_size"):
            model.compile("sgd", "mse", micro_batch_size=bad)


def test_unreduced_loss_raises_a_clear_error_at_compile():
    model = mlp(kf.OptimizedModel)
    with pytest.raises(ValueError, match="micro_batch_size needs every loss to reduce"):
        model.compile(
            "sgd", keras.losses.SparseCategoricalCrossentropy(reduction=None), micro_batch_size=4
        )
    assert not model.compiled  # nothing half-set


def test_validate_micro_batch_size_passes_none_and_ints():
    assert _compile_checks.validate_micro_batch_size(None) is None
    assert _compile_checks.validate_micro_batch_size(3) == 3


@pytest.mark.parametrize("micro_batch_size", [4, 3])
def test_sparse_labels_of_shape_batch_by_one(micro_batch_size):
    """Keras squeezes `(batch, 1)` sparse labels only when the 1 is static: the micro-batch
    slices keep the batch's trailing shape (they lost it: a rank error inside fit)."""
    x, labels, _ = data(20)
    y = labels.reshape(-1, 1).astype("int32")
    runs = []
    for cls, extra in (
        (keras.Model, {}),
        (kf.OptimizedModel, {"micro_batch_size": micro_batch_size}),
    ):
        model = mlp(cls)
        model.compile(
            keras.optimizers.SGD(0.1),
            "sparse_categorical_crossentropy",
            metrics=["sparse_categorical_accuracy"],
            **extra,
        )
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        runs.append((history, model.get_weights()))
    (h_ref, w_ref), (h, w) = runs
    assert set(h) == set(h_ref)
    for key in h_ref:
        np.testing.assert_allclose(h[key], h_ref[key], rtol=1e-6, atol=1e-7, err_msg=key)
    for a, b in zip(w_ref, w):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
