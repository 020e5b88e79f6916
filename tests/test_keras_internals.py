"""Keras/TensorFlow internals keras_fastloop relies on: fail loudly if an upgrade changes them.

Each block names the module of keras_fastloop that uses the internal.
"""

import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

# ------------------------------------------------------------- keras_fastloop/_step/distributed.py


def _tf_optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def test_optimizer_all_reduce_hook_exists_and_is_the_only_gradient_sum():
    """`gradients_already_reduced` replaces this hook on the optimizer instance."""
    cls = _tf_optimizer_class()
    assert isinstance(keras.optimizers.SGD(), cls)
    hook = cls._all_reduce_sum_gradients
    assert list(inspect.signature(hook).parameters) == ["self", "grads_and_vars"]
    update = inspect.getsource(cls._backend_update_step)
    assert "self._all_reduce_sum_gradients(grads_and_vars)" in update
    # The hook is looked up on the instance (an attribute set there wins).
    opt = keras.optimizers.SGD()
    object.__setattr__(opt, "_all_reduce_sum_gradients", lambda gv: "patched")
    assert opt._all_reduce_sum_gradients([]) == "patched"
    object.__delattr__(opt, "_all_reduce_sum_gradients")
    assert opt._all_reduce_sum_gradients.__func__ is hook


def test_loss_scale_optimizer_applies_through_its_inner_optimizer():
    """The hook is replaced on `inner_optimizer`; LSO must still delegate to it."""
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert isinstance(lso.inner_optimizer, _tf_optimizer_class())
    source = inspect.getsource(type(lso)._stateful_handle_finite_grads)
    assert "self.inner_optimizer.apply(" in source


def test_trainer_make_function_and_symbolic_build_signatures():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers.trainer import Trainer

    assert list(inspect.signature(TensorFlowTrainer._make_function).parameters) == [
        "self",
        "step_function",
    ]
    for name in ("make_train_function", "make_test_function"):
        assert "self._make_function(" in inspect.getsource(getattr(TensorFlowTrainer, name))
    params = list(inspect.signature(TensorFlowTrainer._maybe_symbolic_build).parameters)
    assert params == ["self", "iterator", "data_batch"]
    assert list(inspect.signature(Trainer._symbolic_build).parameters)[:3] == [
        "self",
        "iterator",
        "data_batch",
    ]
    fit = inspect.getsource(TensorFlowTrainer.fit)
    assert "self._maybe_symbolic_build(iterator=" in fit


def test_multi_worker_reduction_of_step_outputs_is_mean_over_axis_0():
    """`make_function` packs outputs as `(1, K)` because Keras reduces them this way."""
    from keras.src.backend.tensorflow import trainer

    source = inspect.getsource(trainer.reduce_per_replica)
    assert 'strategy.reduce("MEAN", v, axis=0)' in source
    assert "MultiWorkerMirroredStrategy" in inspect.getsource(
        trainer._collective_all_reduce_multi_worker
    )
    # Outside multi-worker mode a plain tensor passes through unchanged (packing still works).
    out = trainer.reduce_per_replica(tf.ones((1, 3)), tf.distribute.get_strategy(), "auto")
    assert out.shape == (1, 3)


def test_merge_call_helpers_exist():
    """`distributed.cond` uses these to run branches with synchronisation points."""
    assert callable(tf.__internal__.distribute.strategy_supports_no_merge_call)
    strategy = tf.distribute.get_strategy()
    assert hasattr(strategy.extended, "call_for_each_replica")
    assert hasattr(tf.distribute.get_replica_context(), "merge_call")


def test_every_keras_internal_we_use_still_exists_with_its_signature():
    """All `keras.src` names are imported in one module; fail loudly when Keras moves them."""
    import inspect

    from keras_fastloop import _keras_internals as internals

    for name in internals.__all__:
        assert getattr(internals, name) is not None, name
    assert list(inspect.signature(internals.get_loss).parameters) == [
        "identifier",
        "y_true",
        "y_pred",
    ]
    assert list(inspect.signature(internals.reduce_per_replica).parameters)[:3] == [
        "values",
        "strategy",
        "reduction",
    ]
    assert internals.functional_init_arguments((1, 2), {}) is True
    assert internals.functional_init_arguments((), {}) is False
    assert issubclass(internals.Functional, internals.Trainer)
    # Keras rewrites a subclass' bases when it is used functionally; OptimizedModel must not be.
    import keras

    import keras_fastloop as kf

    i = keras.Input((2,))
    kf.OptimizedModel(i, keras.layers.Dense(1)(i))
    assert kf.OptimizedModel.__bases__[-1] is keras.Model


def test_saved_as_names_the_class_keras_registered():
    """`save_as` writes Keras' registry of names: a variant saves under the name given."""
    import keras

    from keras_fastloop import _keras_internals as internals

    assert internals.Model is keras.Model

    @keras.saving.register_keras_serializable(package="fastloop_test")
    class Registered(keras.Model):
        pass

    variant = type("Registered", (Registered,), {})
    internals.save_as(variant, "fastloop_test>Variant")
    assert keras.saving.get_registered_name(variant) == "fastloop_test>Variant"
    assert keras.saving.get_registered_object("fastloop_test>Registered") is Registered
    assert keras.saving.get_registered_object("fastloop_test>Variant") is None


# --------------------------------------------- keras_fastloop/_fit_loop.py, resume.py, tuning/


def test_epoch_iterator_seams_of_the_fit_loop():
    """The fit loop replaces `_enumerate_iterator` on fit's iterator and reads its length."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers.epoch_iterator import EpochIterator

    assert inspect.isgeneratorfunction(EpochIterator._enumerate_iterator)
    assert "self._epoch_iterator = self._enumerate_iterator()" in inspect.getsource(
        EpochIterator.__iter__
    )
    iterator = EpochIterator(tf.data.Dataset.range(6).batch(2))
    assert iterator.data_adapter.num_batches == 3
    from keras_fastloop import _keras_internals as internals

    original = internals.enumerate_iterator(iterator)

    def first_slot():
        yield from list(original())[:1]

    internals.set_enumerate_iterator(iterator, first_slot)
    assert len(list(iterator)) == 1  # iterating goes through the replacement
    internals.set_enumerate_iterator(iterator, None)
    assert len(list(iterator)) == 3
    unknown = EpochIterator(tf.data.Dataset.range(6).filter(lambda v: v >= 0).batch(2))
    assert unknown.data_adapter.num_batches is None
    fit = inspect.getsource(TensorFlowTrainer.fit)
    # BackupAndRestore (and the exact resume) set `_initial_epoch` in on_train_begin, read after.
    assert fit.index("callbacks.on_train_begin()") < fit.index("self._initial_epoch or")


def test_checkpoint_callback_counters_used_by_resume_and_step_events():
    """Save points are read from (and after a resume realigned in) these counters."""
    backup = keras.callbacks.BackupAndRestore("/tmp/unused_backup_dir", save_freq=8)
    assert backup._batches_seen_since_last_saving == 0 and backup._last_batch_seen == 0
    assert backup._current_epoch == 0
    assert backup._training_metadata_path and backup._weights_path
    source = inspect.getsource(keras.callbacks.BackupAndRestore._should_save_on_batch)
    assert "batch - self._last_batch_seen" in source
    checkpoint = keras.callbacks.ModelCheckpoint("/tmp/unused.weights.h5", save_freq=8)
    assert checkpoint._batches_seen_since_last_saving == 0 and checkpoint._last_batch_seen is None
    source = inspect.getsource(keras.callbacks.ModelCheckpoint._should_save_on_batch)
    assert "self._batches_seen_since_last_saving >= self.save_freq" in source
    from keras_fastloop import _keras_internals as internals

    assert internals.batches_since_saving(checkpoint) == 0
    assert internals.batches_since_saving(keras.callbacks.EarlyStopping()) is None
    files = internals.backup_files(backup)
    assert files == (
        backup._weights_path,
        backup._training_metadata_path,
        backup._prev_weights_path,
        backup._prev_training_metadata_path,
    )
    internals.set_save_counters(backup, epoch=3, last_batch=5, batches_since_saving=2)
    assert (backup._current_epoch, backup._last_batch_seen) == (3, 5)
    assert backup._batches_seen_since_last_saving == 2
    with pytest.raises(KeyError):
        internals.set_save_counters(checkpoint, epochs=1)  # a counter no callback has


# ----------------------------------------------------------- keras_fastloop/_step/prebuild.py


def test_keras_defers_building_without_a_strategy_and_keeps_the_epoch_dataset():
    """The prebuild exists because of this early return; it reads the iterator's dataset spec."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, TFEpochIterator

    source = inspect.getsource(TensorFlowTrainer._maybe_symbolic_build)
    assert "if self._distribute_strategy is None:" in source
    assert "self._distributed_dataset = dataset" in inspect.getsource(TFEpochIterator.__init__)

    from keras_fastloop import _keras_internals as internals

    iterator = TFEpochIterator(
        distribute_strategy=tf.distribute.get_strategy(),
        x=tf.data.Dataset.from_tensor_slices((tf.zeros((4, 2)), tf.zeros((4,)))).batch(2),
    )
    spec = internals.epoch_iterator_element_spec(iterator)
    assert spec[0].shape.as_list() == [None, 2] and spec[1].dtype == tf.float32
    assert internals.epoch_iterator_element_spec(None) is None


# ----------------------------------------------------------- keras_fastloop/callbacks/monitors.py


def test_profiler_plugin_converts_traces_to_the_op_stats_table(tmp_path):
    """`ProfilerWindow.op_time_by_type` reads these columns of `framework_op_stats`."""
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    from keras_fastloop import _tf_internals as internals

    assert callable(_pywrap_profiler_plugin.xspace_to_tools_data)
    tf.profiler.experimental.start(str(tmp_path))
    tf.linalg.matmul(tf.ones((64, 64)), tf.ones((64, 64)))
    tf.profiler.experimental.stop()
    paths = sorted(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    labels, rows = internals.profiler_op_stats(paths)
    needed = {"operation type", "host/device", "total self-time (us)", "#occurrences"}
    assert needed <= {label.lower() for label in labels}
    assert rows


def test_onednn_switch_is_readable_and_follows_the_environment_variable():
    """The bench's own-process oneDNN contender and its report header read this switch."""
    import subprocess
    import sys

    from keras_fastloop import _keras_internals as internals

    here = internals.onednn_enabled()
    assert isinstance(here, bool)
    flipped = "0" if here else "1"
    code = "from keras_fastloop import _keras_internals as i; print(i.onednn_enabled())"
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=flipped, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == str(not here)


# ------------------------------------------ keras_fastloop/_keras_internals.py (rematerialization)


def test_every_keras_remat_goes_through_backend_core_remat():
    """`RematScope` (Operation/Layer.rematerialized_call) and `keras.remat` both call
    `keras.src.backend.common.remat.remat`, which calls `backend.core.remat(f)` at call time:
    the one function `install_remat_hook` replaces (TensorFlow's: `tf.recompute_grad`)."""
    from keras.src import backend
    from keras.src.backend.common import remat
    from keras.src.backend.tensorflow import core
    from keras.src.layers.layer import Layer
    from keras.src.ops.operation import Operation

    from keras_fastloop import _keras_internals as internals

    assert keras.remat is remat.remat
    assert "backend.core.remat(f)" in inspect.getsource(remat.remat)
    assert backend.core is core
    assert core.remat is internals.remat._keras_remat_hook
    assert "tf.recompute_grad(f)" in inspect.getsource(internals.remat._stock_core_remat)
    for cls in (Operation, Layer):
        assert "remat.remat(" in inspect.getsource(cls.rematerialized_call)
    source = inspect.getsource(Operation.__call__)
    assert "self.rematerialized_call(" in source and "symbolic_call" in source


def test_remat_mode_is_kept_on_each_layer_built_in_a_scope():
    from keras_fastloop import _keras_internals as internals

    with keras.RematScope(mode="larger_than", output_size_threshold=7, layer_names=["a"]):
        layer = keras.layers.Dense(2, name="d")
    outside = keras.layers.Dense(2)
    assert layer._remat_mode == ("larger_than", 7, ["a"])
    assert layer._remat_mode._fields == ("mode", "output_size_threshold", "layer_names")
    assert outside._remat_mode is None
    model = keras.Sequential([keras.Input((3,)), layer, outside])
    assert internals.remat_modes(model) == [("d", layer._remat_mode)]


def test_call_context_autocast_scope_and_stateless_scope_are_where_the_replay_reads_them():
    """The recompute restores Keras' thread-local `current_call_ctx` (the `training` flag a
    sublayer inherits) and `autocast_scope`, and maps variables by `id` in a `StatelessScope`."""
    from keras.src.backend.common import global_state
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.backend.common.symbolic_scope import SymbolicScope, in_symbolic_scope
    from keras.src.backend.common.variables import AutocastScope, get_autocast_scope
    from keras.src.layers.layer import Layer

    assert '"current_call_ctx"' in inspect.getsource(Layer._get_call_context)
    with AutocastScope("bfloat16") as _:
        assert global_state.get_global_attribute("autocast_scope") is get_autocast_scope()
        assert get_autocast_scope().dtype == "bfloat16"
    variable = keras.Variable(np.ones(2, "float32"))
    scope = StatelessScope(initialize_variables=False)
    scope.state_mapping[id(variable)] = tf.constant([5.0, 6.0])
    with scope:
        np.testing.assert_array_equal(np.asarray(variable.value), [5.0, 6.0])
        variable.assign([7.0, 8.0])
    np.testing.assert_array_equal(variable.numpy(), [1.0, 1.0])
    with SymbolicScope():
        assert in_symbolic_scope()
    assert not in_symbolic_scope()


def test_seed_generator_state_is_a_layer_variable_whose_mapped_value_replays_a_draw():
    """Dropout draws from its `SeedGenerator`'s state (one of the layer's non-trainable
    variables); mapped to an earlier value in a `StatelessScope`, it draws the same mask and
    the advance is not applied."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    layer = keras.layers.Dropout(0.5, seed=1)
    state = layer._seed_generators[0].state
    assert any(v is state for v in layer.non_trainable_variables)
    x = tf.ones((4, 8))
    before = tf.convert_to_tensor(state.value)
    first = layer(x, training=True)
    advanced = state.numpy()
    with StatelessScope(state_mapping=[(state, before)]):
        again = layer(x, training=True)
    np.testing.assert_array_equal(first.numpy(), again.numpy())
    np.testing.assert_array_equal(state.numpy(), advanced)


def test_stock_keras_model_fit_under_a_remat_scope_fails_in_graph_mode():
    """keras#21207: Keras passes `training=` to `tf.recompute_grad`, which takes keyword
    arguments only eagerly. When this test fails, Keras fixed it: update the README's line."""
    with keras.RematScope(mode="full"):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1)(keras.layers.Dropout(0.5)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x = np.ones((8, 4), "float32")
    with pytest.raises(ValueError, match="keywords arguments only when eager execution"):
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)


def test_multi_worker_start_up_knobs_of_tensorflow():
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import collective_all_reduce_strategy
    from tensorflow.python.eager import context

    from keras_fastloop import _tf_internals as internals

    fields = coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    assert {"cluster_register_timeout_in_ms", "cluster_register_with_barrier"} <= set(fields)
    assert (
        "coordinated_jobs"
        in inspect.signature(context.Context.configure_coordination_service).parameters
    )
    ctx = context.context()
    assert hasattr(ctx, "_coordination_service_config") and hasattr(ctx, "_context_handle")
    timeout = (
        collective_all_reduce_strategy.CollectiveAllReduceExtended._check_health_initial_timeout
    )
    assert isinstance(timeout, int)
    with internals.first_health_check_timeout(7):
        assert (
            collective_all_reduce_strategy.CollectiveAllReduceExtended._check_health_initial_timeout
            == 7
        )
    assert (
        collective_all_reduce_strategy.CollectiveAllReduceExtended._check_health_initial_timeout
        == timeout
    )
    tf.constant(0.0)  # the context starts
    assert internals.eager_context_started()
    # `num_workers` reads the count every multi-worker set-up of the strategy records.
    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    for set_up in (extended._initialize_local, extended._initialize_multi_worker):
        assert "self._num_workers = " in inspect.getsource(set_up)
    assert internals.num_workers(tf.distribute.get_strategy()) == 1
    assert internals.num_workers(None) == 1


# ------------------------------------------------------------ keras_fastloop/callbacks/ema.py


def test_optimizer_ema_attributes_and_update_hook():
    """`ema_pairs` reads them; `use_ema_warmup` replaces the update hook on the instance."""
    from keras.src.optimizers import base_optimizer

    from keras_fastloop import _keras_internals as internals

    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.5)
    optimizer.build([variable])
    assert [v for v, _ in internals.ema_pairs(optimizer)] == [variable]
    apply_source = inspect.getsource(base_optimizer.BaseOptimizer._backend_apply_gradients)
    assert "self._update_model_variables_moving_average(" in apply_source
    calls = []
    internals.set_ema_update(
        optimizer, lambda variables: calls.append((variables, int(optimizer.iterations)))
    )
    optimizer.apply([keras.ops.ones(2)], [variable])
    assert calls == [(optimizer._trainable_variables, 0)]  # before the increment


# ------------------------------------------- keras_fastloop/tuning/_glue.py, data/bucketing.py


def test_tensorflow_optional_spec_and_dataset_inputs():
    """The "auto" loop sets an `Optional`'s spec as Keras' own multi-step loop does; the
    bucketing check walks a data set's inputs."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    from keras_fastloop import _tf_internals as internals

    assert "._element_spec = " in inspect.getsource(TensorFlowTrainer._make_function)
    optional = tf.experimental.Optional.empty(None)
    spec = tf.TensorSpec((), tf.float32)
    internals.set_optional_spec(optional, spec)
    assert optional.element_spec == spec
    source = tf.data.Dataset.range(4)
    (inputs,) = internals.dataset_inputs(source.batch(2))
    assert inputs is source
