"""OptimizedModel under Ray Train: `TensorflowTrainer`, 2 local workers, MultiWorkerMirroredStrategy.

The path of Ray's TensorFlow starter (each worker creates the strategy, builds and compiles in its
scope, fits a `tf.data` pipeline of global batches, reports through Ray's `ReportCheckpointCallback`)
on a local Ray cluster. Both workers must end with identical weights and give the losses, metrics
and weights of one process (default strategy) trained on the same global batches. In the same
workers a stock `keras.Model` fails at its first `fit` (the Keras 3 multi-worker build): the guide
says so, and this test fails when a Keras release makes it train, so the guide gets updated.
"""

import json
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # integration: the slow job

ray = pytest.importorskip("ray", reason="Ray is in the test extra: pip install -e '.[test]'")

GLOBAL_BATCH = 32
SAMPLES = 249  # 7 global batches of 32 and a last one of 25 (split 13/12 over the workers)
EPOCHS = 3


def _dataset():
    """scikit-learn's bundled digits (no download): 256 images of 8x8 in [0, 1], labels 0-9."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data[:SAMPLES] / 16.0).astype("float32")
    y = digits.target[:SAMPLES].astype("int32")
    options = tf.data.Options()
    # tf.distribute hands each worker its part of every global batch (the policy AUTO would
    # choose for in-memory data, said explicitly)
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)


def _build_and_fit(strategy, model_class, callbacks=()):
    """Build and compile `model_class` in `strategy`'s scope, fit it; return (model, history)."""
    import keras

    import keras_fastloop as kf

    with strategy.scope():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = model_class(inputs, keras.layers.Dense(10)(hidden))
        extra = {"gradient_clipping": 0.5} if issubclass(model_class, kf.OptimizedModel) else {}
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **extra,
        )
    history = model.fit(_dataset(), epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
    return model, history


def _summary(model, history):
    return {
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "weights": [np.asarray(w).ravel().tolist() for w in model.get_weights()],
    }


def _train_loop_per_worker(config):
    """What every Ray worker runs (Ray has set its TF_CONFIG)."""
    import tensorflow as tf

    # a timeout on the collectives: a worker that waits for a lost peer fails instead of hanging
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=180)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    import keras
    import ray.train
    from ray.train.tensorflow.keras import ReportCheckpointCallback

    import keras_fastloop as kf

    rank = ray.train.get_context().get_world_rank()
    model, history = _build_and_fit(strategy, kf.OptimizedModel, [ReportCheckpointCallback()])
    result = _summary(model, history)
    result["keras_fastloop"] = os.path.dirname(kf.__file__)
    result["keras"] = keras.__version__
    result["TF_USE_LEGACY_KERAS"] = os.environ.get("TF_USE_LEGACY_KERAS")
    result["local_batches"] = [
        sum(int(part.shape[0]) for part in strategy.experimental_local_results(x))
        for x, _ in strategy.experimental_distribute_dataset(_dataset())
    ]
    # stock keras.Model in the same strategy (after the swapped run, which has finished)
    try:
        _build_and_fit(strategy, keras.Model)
        result["stock"] = "trained"
    except Exception as error:  # what Keras raises is what the test records
        result["stock"] = f"{type(error).__name__}: {error}"[:400]
    with open(os.path.join(config["out"], f"worker{rank}.json"), "w") as f:
        json.dump(result, f)


def _run(out):
    """The Ray run (2 local workers) and the one-process reference: (workers, single, result)."""
    import tensorflow as tf
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    import keras_fastloop as kf

    tests = os.path.dirname(os.path.abspath(__file__))
    # The workers import this checkout's keras_fastloop and this module (the loop above is
    # pickled by reference); Ray's usage statistics stay off (nothing leaves the machine).
    path = os.pathsep.join(
        p for p in (os.path.dirname(tests), tests, os.environ.get("PYTHONPATH")) if p
    )
    env = {"PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2", "RAY_USAGE_STATS_ENABLED": "0"}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    try:
        trainer = TensorflowTrainer(
            _train_loop_per_worker,
            train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=str(out / "storage"), name="fastloop"),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    workers = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
    single = _summary(*_build_and_fit(tf.distribute.get_strategy(), kf.OptimizedModel))
    return workers, single, result


def _check_workers_import_this_checkout_and_keras_3(runs):
    import keras_fastloop as kf

    workers, _, _ = runs
    for worker in workers:
        assert worker["keras_fastloop"] == os.path.dirname(kf.__file__)
        # Ray's TensorFlow backend sets TF_USE_LEGACY_KERAS=1, which selects Keras 2 for
        # `tf.keras` only; `import keras` is still Keras 3
        assert worker["TF_USE_LEGACY_KERAS"] == "1"
        assert worker["keras"].startswith("3.")


def _check_workers_split_every_global_batch(runs):
    workers, _, _ = runs
    sizes = np.array([worker["local_batches"] for worker in workers])
    np.testing.assert_array_equal(sizes.sum(axis=0), [32] * 7 + [25])
    assert sorted(sizes[:, -1]) == [12, 13]  # an uneven split: shares must weight the losses


def _check_workers_end_with_identical_weights(runs):
    workers, _, _ = runs
    for a, b in zip(workers[0]["weights"], workers[1]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)


def _check_two_ray_workers_match_one_process(runs):
    # Tolerance: the two workers sum their halves' gradients in another order than one process
    # sums the batch (float32, ~1e-7 relative per step); 24 Adam steps keep that below 1e-5.
    workers, single, _ = runs
    for key in ("loss", "accuracy", "grad_norm"):
        for worker in workers:
            np.testing.assert_allclose(
                worker["history"][key], single["history"][key], rtol=1e-5, err_msg=key
            )
    for a, b in zip(workers[0]["weights"], single["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert single["history"]["loss"][-1] < 0.5 * single["history"]["loss"][0]  # it trained
    assert max(single["history"]["grad_norm"]) > 0.5  # clipping acted


def _check_ray_reports_and_checkpoints_the_model(runs):
    import keras
    from ray.train.tensorflow import TensorflowCheckpoint

    workers, single, result = runs
    assert result.error is None
    np.testing.assert_allclose(result.metrics["loss"], single["history"]["loss"][-1], rtol=1e-5)
    restored = TensorflowCheckpoint.from_directory(result.checkpoint.path).get_model()
    assert type(restored).__name__ == "OptimizedModel"
    assert isinstance(restored, keras.Model)
    for a, b in zip(restored.get_weights(), workers[0]["weights"], strict=True):
        np.testing.assert_array_equal(np.ravel(a), b)


def _check_stock_keras_model_fails_there(runs):
    # keras.Model.fit under MultiWorkerMirroredStrategy (Keras 3): the symbolic build converts
    # a per-replica batch to a tensor. When this starts to pass, update docs/guide.md.
    workers, _, _ = runs
    for worker in workers:
        assert worker["stock"].startswith("ValueError: Attempt to convert a value (PerReplica"), (
            worker["stock"]
        )


def test_ray_train_two_workers(tmp_path, monkeypatch):
    # One test, one Ray run (a module fixture would run once per pytest-xdist process).
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    runs = _run(tmp_path)
    _check_workers_import_this_checkout_and_keras_3(runs)
    _check_workers_split_every_global_batch(runs)
    _check_workers_end_with_identical_weights(runs)
    _check_two_ray_workers_match_one_process(runs)
    _check_ray_reports_and_checkpoints_the_model(runs)
    _check_stock_keras_model_fails_there(runs)
