"""`compile(shared_variables=...)`: refused at compile when it cannot act, saved so that a
loaded model shares the same variables."""

import keras
import numpy as np
import pytest

from keras_fastloop import OptimizedModel


def _data(n=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = {"a": rng.normal(size=(n, 1)).astype("float32"), "b": rng.normal(size=(n, 1)) * 3}
    return x, y


def _functional():
    inputs = keras.Input((3,))
    trunk = keras.layers.Dense(4, name="trunk")
    h = trunk(inputs)
    outputs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    return trunk, OptimizedModel(inputs, outputs)


class TwoHeads(OptimizedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.trunk = keras.layers.Dense(4)
        self.a = keras.layers.Dense(1)
        self.b = keras.layers.Dense(1)

    def call(self, x):
        h = self.trunk(x)
        return {"a": self.a(h), "b": self.b(h)}


def test_a_frozen_layer_is_refused_at_compile():
    trunk, model = _functional()
    trunk.trainable = False
    with pytest.raises(ValueError, match="Received: shared_variables"):
        model.compile("sgd", "mse", loss_weighting="pcgrad", shared_variables=[trunk])
    assert not model.compiled


@pytest.mark.parametrize("given", ["foreign_layer", "frozen_layer", "frozen_variable"])
def test_what_an_unbuilt_model_cannot_share_is_refused_at_compile(given):
    model = TwoHeads()
    if given == "foreign_layer":
        shared = [keras.layers.Dense(4)]
    elif given == "frozen_layer":
        model.trunk.trainable = False
        shared = [model.trunk]
    else:
        shared = [keras.Variable(np.ones((3, 4)), trainable=False)]
    with pytest.raises(ValueError, match="Received: shared_variables"):
        model.compile("sgd", "mse", loss_weighting="pcgrad", shared_variables=shared)
    assert not model.compiled


def _branch(name):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(4, name="same")(inputs), name=name)


def test_variables_with_the_same_path_are_found_again_on_loading(tmp_path):
    # Functional sub-models give their variables paths without the sub-model's name.
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="trunk")(inputs)
    first, second = _branch("first"), _branch("second")
    outputs = {
        "a": keras.layers.Dense(1, name="a")(first(h)),
        "b": keras.layers.Dense(1, name="b")(second(h)),
    }
    model = OptimizedModel(inputs, outputs)
    given = first.get_layer("same").kernel
    assert given.path == second.get_layer("same").kernel.path
    model.compile("sgd", "mse", loss_weighting="pcgrad", shared_variables=[given])
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    x, y = _data()
    loaded.fit(x, y, verbose=0)
    (found,) = loaded.loss_weighting._given_shared
    assert found is loaded.get_layer("first").get_layer("same").kernel


@keras.saving.register_keras_serializable("test_shared_variables")
class OwnTrunk(OptimizedModel):
    """A subclassed model whose shared trunk is its own weight, beside auto-named heads."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(1)
        self.b = keras.layers.Dense(1)

    def build(self, input_shape):
        init = keras.initializers.GlorotUniform(seed=3)
        self.trunk = self.add_weight(shape=(input_shape[-1], 4), initializer=init, name="w")
        self.a.build((None, 4))
        self.b.build((None, 4))

    def call(self, x):
        h = keras.ops.matmul(x, self.trunk)
        return {"a": self.a(h), "b": self.b(h)}


@pytest.mark.parametrize("method", ["imtl", "db_mtl"])
def test_a_loaded_subclassed_model_shares_the_same_variables(method, tmp_path):
    x, y = _data(16)

    def compiled():
        keras.utils.set_random_seed(0)
        _ = TwoHeads()  # the next model's layers get other auto names than the saved ones
        model = OwnTrunk()
        model.build((None, 3))
        shared = [model.trunk, model.a.kernel]
        model.compile("sgd", "mse", loss_weighting=method, shared_variables=shared)
        return model

    uninterrupted = compiled()
    uninterrupted.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    first = compiled()
    first.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    first.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    loaded.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    assert [
        v is w for v, w in zip(loaded.loss_weighting._given_shared, [loaded.trunk, loaded.a.kernel])
    ] == [True, True]
    for resumed, reference in zip(loaded.weights, uninterrupted.weights):
        np.testing.assert_allclose(resumed.numpy(), reference.numpy(), rtol=1e-6, atol=1e-6)


def _fit(model, method, shared, epochs=2):
    x, y = _data(16)
    model.compile("sgd", "mse", loss_weighting=method, shared_variables=shared)
    history = model.fit(x, y, epochs=epochs, batch_size=8, verbose=0).history
    return history["loss"], [w.numpy() for w in model.weights]


@pytest.mark.parametrize("method", ["db_mtl", "excess_mtl"])
def test_per_variable_state_given_all_equals_inferred_and_a_subset_keeps_only_its_own(method):
    keras.utils.set_random_seed(0)
    _, model = _functional()
    initial = [w.numpy() for w in model.weights]
    inferred = _fit(model, method, None)
    for name in ("layer", "kernel"):
        trunk, model = _functional()
        model.set_weights(initial)
        run = _fit(model, method, [trunk] if name == "layer" else [trunk.kernel])
        buffered = [variable for variable, _, _ in model.loss_weighting._buffers]
        if name == "layer":  # the trunk's variables are the inferred shared set
            assert buffered == [trunk.kernel, trunk.bias]
            assert run[0] == inferred[0]
            for given, reference in zip(run[1], inferred[1]):
                np.testing.assert_array_equal(given, reference)
        else:
            assert buffered == [trunk.kernel]


def test_a_second_compile_uses_its_own_shared_variables():
    trunk, model = _functional()
    _fit(model, "db_mtl", [trunk.kernel], epochs=1)
    assert model.loss_weighting.shared_variable_paths == ["trunk/kernel"]
    _fit(model, "db_mtl", [trunk], epochs=1)
    assert model.loss_weighting.shared_variable_paths == ["trunk/kernel", "trunk/bias"]
    assert [v for v, _, _ in model.loss_weighting._buffers] == [trunk.kernel, trunk.bias]
    saved = model.get_compile_config()["shared_variables"]
    assert [entry["path"] for entry in saved] == ["trunk/kernel", "trunk/bias"]
    _fit(model, "db_mtl", None, epochs=1)
    assert "shared_variables" not in model.get_compile_config()
    assert model.loss_weighting.shared_variable_paths == ["trunk/kernel", "trunk/bias"]


def test_an_unbuilt_model_given_a_layer_equals_one_built_before_compile():
    runs = {}
    for build in ("called", "build_without_variables", "unbuilt"):
        keras.utils.set_random_seed(0)
        model = TwoHeads()
        if build == "called":
            model(np.zeros((1, 3), "float32"))
        elif build == "build_without_variables":  # Keras marks it built, its layers are not
            model.build((None, 3))
        runs[build] = (model, _fit(model, "db_mtl", [model.trunk]))
    reference, (loss, weights) = runs["called"]
    for build in ("build_without_variables", "unbuilt"):
        model, (other_loss, other_weights) = runs[build]
        shared = [variable for variable, _, _ in model.loss_weighting._buffers]
        assert shared == [model.trunk.kernel, model.trunk.bias]
        assert len(model.loss_weighting.shared_variable_paths) == 2
        assert other_loss == loss
        for a, b in zip(other_weights, weights):
            np.testing.assert_array_equal(a, b)
