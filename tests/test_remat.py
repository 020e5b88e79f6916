"""Keras' own rematerialization (`keras.RematScope`, `keras.remat`) inside our models' `fit`.

The reference for every test is the same model built without a scope: rematerialization
recomputes the forward pass in the backward pass, so with the recompute replaying the forward
pass' random draws (Dropout, GaussianNoise), `training` flag and autocast scope, the losses and
every weight (moving statistics and seed generator states included) are the no-remat ones.
Stock Keras redraws them (the eager test below shows the gradients it then gives differ).
Where rematerialization changes which ops TensorFlow or XLA fuse, the last float bit may move:
those comparisons allow 1e-6, far below what a redrawn mask moves (~0.1).
Synthetic tensors throughout.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

import keras_fastloop as kf

MODES = ["full", "activations", "larger_than", "list_of_layers"]


class Block(keras.layers.Layer):
    """A residual block with Dropout and GaussianNoise; its sublayers read `training` from
    the call context (Dropout) or from the argument (GaussianNoise). Counts its calls."""

    calls = 0

    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="relu", name="inner_dense")
        self.drop = keras.layers.Dropout(0.4, seed=5)
        self.noise = keras.layers.GaussianNoise(0.2, seed=6)

    def call(self, x, training=None):
        type(self).calls += 1
        return x + self.noise(self.drop(self.dense(x)), training=training)


def scope(mode):
    if mode is None:
        return keras.RematScope(mode=None)
    return keras.RematScope(
        mode=mode, output_size_threshold=64, layer_names=["block", "inner_dense", "head_dense"]
    )


def functional(mode, outputs=1, base=kf.OptimizedModel):
    keras.utils.set_random_seed(7)
    with scope(mode):
        inputs = keras.Input((16,))
        h = Block(name="block")(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Dense(16, activation="tanh", name="head_dense")(h)
        h = keras.layers.Dropout(0.3, seed=8)(h)
        heads = [keras.layers.Dense(1, dtype="float32", name=f"out{i}")(h) for i in range(outputs)]
    return base(inputs, heads[0] if outputs == 1 else heads)


class RematBlockModel(kf.OptimizedModel):
    """`keras.remat` on a whole block, called with `training=` (a keyword argument)."""

    def __init__(self):
        super().__init__()
        self.block = Block(name="block")
        self.remat_block = keras.remat(self.block)
        self.out = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(self.remat_block(x, training=training))


class PlainBlockModel(RematBlockModel):
    def call(self, x, training=None):
        return self.out(self.block(x, training=training))


def data(n=64, d=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    return x, y


def train(model, x, y, batch_size=16, epochs=2, **compile_kwargs):
    compile_kwargs.setdefault("optimizer", keras.optimizers.SGD(0.05))
    compile_kwargs.setdefault("loss", "mse")
    model.compile(**compile_kwargs)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return history.history, [np.asarray(w.numpy()) for w in model.weights]


def assert_same_training(reference, remat, atol=0.0):
    (ref_history, ref_weights), (history, weights) = reference, remat
    assert len(ref_weights) == len(weights)
    for key, values in ref_history.items():
        np.testing.assert_allclose(history[key], values, rtol=0, atol=atol, err_msg=key)
    for a, b in zip(ref_weights, weights):
        np.testing.assert_allclose(b.astype("float64"), a.astype("float64"), rtol=0, atol=atol)


def counted_calls(build, **kwargs):
    Block.calls = 0
    result = train(build(), *data(), **kwargs)
    return result, Block.calls


# ----------------------------------------------------------------------------- exactness


def test_full_scope_replays_dropout_and_noise_exactly_in_graph_mode():
    """One SGD step at learning rate 1: each weight's change is its gradient, to the bit."""
    x, y = data()
    ref, plain_calls = counted_calls(
        lambda: functional(None), optimizer=keras.optimizers.SGD(1.0), epochs=1
    )
    got, remat_calls = counted_calls(
        lambda: functional("full"), optimizer=keras.optimizers.SGD(1.0), epochs=1
    )
    assert remat_calls > plain_calls  # the backward pass recomputed the block
    assert_same_training(ref, got)


def test_stock_eager_recompute_redraws_dropout_so_the_comparison_can_fail():
    """Keras' own recompute (eager `keras.Model`) draws new masks: the weights differ."""
    x, y = data()
    ref = train(functional(None, base=keras.Model), x, y, epochs=1, run_eagerly=True)
    got = train(functional("full", base=keras.Model), x, y, epochs=1, run_eagerly=True)
    differences = [np.max(np.abs(a - b)) for a, b in zip(ref[1], got[1]) if a.dtype.kind == "f"]
    assert max(differences) > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_every_scope_mode_trains_as_without_remat_in_graph_mode(mode):
    """To float32 rounding: a rematerialized activation changes which ops TensorFlow fuses
    (`"activations"` moves the last bit); a redrawn mask would move weights by ~0.1."""
    x, y = data()
    ref = train(functional(None), x, y)
    assert_same_training(ref, train(functional(mode), x, y), atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "larger_than"])
def test_scope_modes_train_as_without_remat_eagerly(mode):
    x, y = data()
    ref = train(functional(None), x, y, epochs=1, run_eagerly=True)
    assert_same_training(ref, train(functional(mode), x, y, epochs=1, run_eagerly=True))


def test_keras_remat_of_a_block_called_with_training_keyword():
    x, y = data()
    keras.utils.set_random_seed(3)
    ref = train(PlainBlockModel(), x, y)
    keras.utils.set_random_seed(3)
    assert_same_training(ref, train(RematBlockModel(), x, y))


def test_optimized_wraps_a_keras_model_built_under_a_scope():
    x, y = data()
    ref = train(kf.optimized(functional(None, base=keras.Model)), x, y)
    assert_same_training(ref, train(kf.optimized(functional("full", base=keras.Model)), x, y))


def test_optimized_sequential_with_integer_ids_under_full_scope():
    """An Embedding's only input is integer ids: nothing positional to recompute from, the
    gradient reaches its table through the recompute's variables."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (32, 6))
    y = rng.normal(size=(32, 1)).astype("float32")

    def build(mode):
        keras.utils.set_random_seed(1)
        with scope(mode):
            return kf.OptimizedSequential(
                [
                    keras.Input((6,), dtype="int32"),
                    keras.layers.Embedding(20, 8),
                    keras.layers.Dropout(0.3, seed=2),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(1),
                ]
            )

    ref = train(build(None), x, y, batch_size=8)
    got = train(build("full"), x, y, batch_size=8)
    assert_same_training(ref, got, atol=1e-6)
    assert np.max(np.abs(got[1][0] - build(None).weights[0].numpy())) > 1e-4  # it trained


def test_evaluate_and_predict_run_under_a_scope_in_graph_mode():
    x, y = data()
    plain, remat = functional(None), functional("full")
    for model in (plain, remat):
        model.compile("sgd", "mse")
    np.testing.assert_allclose(remat.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0))
    np.testing.assert_allclose(remat.predict(x, verbose=0), plain.predict(x, verbose=0))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_scope_mode_trains_as_without_remat_under_xla(mode):
    x, y = data()
    ref = train(functional(None), x, y, jit_compile=True)
    assert_same_training(ref, train(functional(mode), x, y, jit_compile=True), atol=1e-6)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Loss-scale overflows only:keras_fastloop.FastloopWarning")
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_recompute_runs_in_the_forward_autocast_scope(policy):
    """Under a mixed policy the recompute reads float variables as the compute dtype, as the
    forward pass did (else the matmul gets float32 weights and bfloat16 inputs).
    `mixed_float16` also runs the step's loss scaling (one overflow, the same in both)."""
    x, y = data()
    keras.mixed_precision.set_global_policy(policy)
    try:
        ref = train(functional(None), x, y)
        got = train(functional("full"), x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_same_training(ref, got)


# ------------------------------------------------------------------ pairs with the step


@pytest.mark.slow
def test_bfloat16_under_xla_matches_to_bfloat16_rounding():
    """XLA fuses the forward pass and its recompute differently, so under bfloat16 their
    roundings may differ: within bfloat16's precision, far below a redrawn mask's error."""
    x, y = data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        ref = train(functional(None), x, y, jit_compile=True)
        got = train(functional("larger_than"), x, y, jit_compile=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_same_training(ref, got, atol=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"micro_batch_size": 4},
        {"gradient_clipping": 0.05},
        {"steps_per_execution": 2},
        {"micro_batch_size": 4, "jit_compile": True},
        {"micro_batch_size": 4, "run_eagerly": True},
    ],
    ids=["micro_batch", "clipping", "steps_per_execution", "micro_batch_xla", "micro_eager"],
)
def test_full_scope_composes_with_step_options(options):
    x, y = data()
    atol = 1e-6 if options.get("jit_compile") else 0.0
    ref = train(functional(None), x, y, **options)
    assert_same_training(ref, train(functional("full"), x, y, **options), atol=atol)


@pytest.mark.slow
def test_full_scope_composes_with_pcgrad_on_two_outputs():
    x, y = data()
    targets = [y, -y]
    kwargs = {"loss": ["mse", "mse"], "loss_weighting": "pcgrad"}
    ref = train(functional(None, outputs=2), x, targets, **kwargs)
    assert_same_training(ref, train(functional("full", outputs=2), x, targets, **kwargs))


@pytest.mark.slow
def test_full_scope_composes_with_mirrored_strategy():
    x, y = data()
    with two_replica_strategy().scope():
        ref = train(functional(None), x, y)
        got = train(functional("full"), x, y)
    assert_same_training(ref, got, atol=1e-6)


def guide(mode):
    """A model's own `train_step` (the Keras guide's) reaching the stages with `minimize`."""

    class Guide(kf.OptimizedModel):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.fastloop_step.minimize(loss, self.trainable_variables, tape)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    model = functional(mode)
    return Guide(model.inputs, model.outputs)


@pytest.mark.slow
def test_full_scope_in_a_models_own_train_step():
    x, y = data()
    kwargs = {"gradient_clipping": 0.05}
    assert_same_training(train(guide(None), x, y, **kwargs), train(guide("full"), x, y, **kwargs))


# ------------------------------------------------------------------------------ bad input


def test_a_mode_keras_rejects_fails_where_the_scope_is_made():
    with pytest.raises(ValueError, match="Invalid mode 'everything'"):
        keras.RematScope(mode="everything")


@pytest.mark.parametrize("threshold", [-1, 2.5, "big"])
def test_an_output_size_threshold_keras_takes_is_refused_at_compile(threshold):
    with keras.RematScope(mode="larger_than", output_size_threshold=threshold):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(2)(inputs)
    model = kf.OptimizedModel(inputs, outputs)
    with pytest.raises(ValueError, match=r"`output_size_threshold` must be a non-negative"):
        model.compile("sgd", "mse")


def test_layer_names_not_strings_are_refused_at_compile():
    with keras.RematScope(mode="list_of_layers", layer_names=[3]):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(2)(inputs)
    model = kf.OptimizedModel(inputs, outputs)
    with pytest.raises(ValueError, match=r"`layer_names` must be a list of layer names"):
        model.compile("sgd", "mse")


class StatefulNoise(keras.layers.Layer):
    """Noise from TensorFlow's stateful RNG: no seed generator, nothing to replay."""

    def call(self, x, training=None):
        if training:
            return x + tf.random.uniform(tf.shape(x))
        return x


class AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(tf.reduce_mean(tf.square(x)))
        return x


@pytest.mark.parametrize(
    "layer, message",
    [(StatefulNoise, "stateful TensorFlow ops"), (AddsLoss, "adds a loss")],
    ids=["stateful_random", "add_loss"],
)
def test_a_layer_the_recompute_cannot_replay_is_refused_not_trained_wrong(layer, message):
    with keras.RematScope(mode="full"):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1)(layer()(inputs))
    model = kf.OptimizedModel(inputs, outputs)
    model.compile("sgd", "mse")
    before = [w.numpy() for w in model.weights]
    x, y = data(16, 4)
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for a, w in zip(before, model.weights):
        np.testing.assert_array_equal(a, w.numpy())


class RegularizedBlock(keras.layers.Layer):
    """A block whose *sublayer* adds a loss (an activity regularizer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(10.0))

    def call(self, x):
        return self.dense(x)


def test_a_sublayers_added_loss_in_a_rematerialized_block_is_refused():
    with keras.RematScope(mode="list_of_layers", layer_names=["blk"]):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1)(RegularizedBlock(name="blk")(inputs))
    model = kf.OptimizedModel(inputs, outputs)
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="adds a loss"):
        model.fit(*data(16, 4), batch_size=8, epochs=1, verbose=0)


def test_auto_steps_per_execution_trains_under_a_scope():
    x, y = data()
    ref = train(functional(None), x, y, steps_per_execution="auto")
    got = train(functional("full"), x, y, steps_per_execution="auto")
    assert_same_training(ref, got, atol=1e-6)


def test_a_subclass_own_predict_step_runs_under_a_scope():
    class Doubled(kf.OptimizedModel):
        def predict_step(self, data):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            return self(x, training=False) * 2.0

    plain, remat = functional(None), functional("full")
    x, _ = data()
    expected = plain.predict(x, verbose=0) * 2.0
    got = Doubled(remat.inputs, remat.outputs).predict(x, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_replicated_fit_leaves_no_model_in_the_trace_state():
    import threading

    from keras_fastloop import _keras_internals as internals

    x, y = data()
    with two_replica_strategy().scope():
        model = functional("full")
        got = train(model, x, y, epochs=1)
        ref = train(functional(None), x, y, epochs=1)
    assert_same_training(ref, got, atol=1e-6)
    # the replicas' threads traced with their own stacks; this thread's is empty again
    assert internals.remat._traced_models() == []
    assert isinstance(internals.remat._remat_state, threading.local)


def test_a_list_of_layers_scope_naming_no_layer_is_said_at_compile():
    with keras.RematScope(mode="list_of_layers", layer_names=["blok"]):  # a typo
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1, name="block")(inputs)
    model = kf.OptimizedModel(inputs, outputs)
    with pytest.warns(kf.FastloopWarning, match=r"rematerializes nothing.*layer_names=\['blok'\]"):
        model.compile("sgd", "mse")
