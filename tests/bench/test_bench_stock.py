"""Keras at its best (`bench.stock`) and the workload suites (`bench.resnet`, `bench.text`):
pure selection and ratios against hand-computed values, and the suites end to end at tiny
size (structure only; speed is measured by the bench, never asserted)."""

import keras
import numpy as np
import pytest

from keras_fastloop_bench import harness, resnet, stock, text, workloads

pytestmark = pytest.mark.slow  # integration: the slow job


def _run(name, seconds_per_epoch, curve_losses=(1.0, 0.5), first=2.0):
    run = harness.Run(name=name, epochs=len(curve_losses), initial_weights=[])
    train = [first] + [seconds_per_epoch] * (len(curve_losses) - 1)
    t = 0.0
    for loss, seconds in zip(curve_losses, train):
        t += seconds
        run.curve.append((t, loss))
    run.train_seconds = train
    run.samples = [100] * len(curve_losses)
    run.total_seconds = t
    return run


def _runs():
    # throughput = 100 / seconds of epoch 2
    return {
        "float32": [_run("float32", 1.0), _run("float32", 1.0)],
        stock.policy_fit_name(1): [_run("p1", 0.5, first=1.0), _run("p1", 0.5, first=1.0)],
        stock.policy_fit_name(8): [_run("p8", 0.25), _run("p8", 0.4)],
        stock.policy_fit_name(32): [_run("p32", 0.4), _run("p32", 0.4)],
        "ours": [_run("ours", 0.2, first=0.8), _run("ours", 0.25, first=0.8)],
    }


def test_names_of_the_stock_rows():
    assert stock.policy_fit_names() == [
        "keras.Model.fit, recommended policy",
        "keras.Model.fit, recommended policy, steps_per_execution=8",
        "keras.Model.fit, recommended policy, steps_per_execution=32",
    ]


def test_keras_at_its_best_is_the_fastest_stock_row_by_median():
    runs = _runs()
    rows = harness.summarize(runs, 0.5, "float32")
    # medians: p1 200, p8 median(400, 250) = 325, p32 250; "ours" is not a stock row
    assert stock.keras_at_its_best(rows) == stock.policy_fit_name(8)
    assert stock.keras_at_its_best([r for r in rows if r["contender"] == "ours"]) is None


def test_the_gain_over_keras_at_its_best_is_reported_apart_from_float32():
    runs = _runs()
    rows = harness.summarize(runs, 0.5, "float32")
    text_ = stock.at_best_section(runs, rows, ["ours"], "float32", 0.5)
    ours = next(r for r in rows if r["contender"] == "ours")
    # ours: median(500, 400) = 450 samples/s; float32 100; Keras at its best 325
    assert ours["throughput_ratio"] == pytest.approx(4.5)
    assert ours["vs_keras_at_best"] == pytest.approx(450 / 325)
    # first epoch 0.8 s against plain fit at the policy's 1.0 s
    assert ours["first_epoch_vs_policy_fit"] == pytest.approx(0.8)
    # time to loss 0.5: ours median(1.0, 1.05) = 1.025; policy fit 1.5; p8 median(2.25, 2.4)
    assert ours["speedup_to_target_vs_policy_fit"] == pytest.approx(1.5 / 1.025)
    assert ours["speedup_to_target_vs_keras_at_best"] == pytest.approx(2.325 / 1.025)
    assert ours["keras_at_best"] == stock.policy_fit_name(8)
    # per round, paired: 500/400 = 1.25 and 400/250 = 1.6
    assert "1.43 (1.25-1.60)" in text_
    assert "**1.38×**" in text_


def test_with_policy_builds_under_the_policy_and_restores_the_previous_one():
    seen = []

    def train(run):
        seen.append(keras.config.dtype_policy().name)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        stock.with_policy(train, "mixed_bfloat16")(None)
    assert seen == ["mixed_bfloat16"]
    assert keras.config.dtype_policy().name == "float32"


def test_jax_missing_is_skipped_with_the_reason(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("jax") is not None:
        pytest.skip("jax is importable in this environment")
    monkeypatch.setenv(stock.JAX_PATH_ENV, "/nonexistent-jax-path")
    stock.jax_status.cache_clear()
    try:
        notes = []
        assert stock.jax_contenders(None, {}, "float32", 8, 1e-3, notes) == {}
        assert "skipped" in notes[0] and "pip install --target" in notes[0]
    finally:
        stock.jax_status.cache_clear()


def test_jax_contender_trains_in_its_own_process_where_jax_imports(monkeypatch):
    # Where jax is installed apart (e.g. `pip install --target /tmp/jaxenv jax jaxlib`).
    import os

    path = os.environ.get(stock.JAX_PATH_ENV) or "/tmp/jaxenv"
    monkeypatch.setenv(stock.JAX_PATH_ENV, path)
    stock.jax_status.cache_clear()
    try:
        ok, why = stock.jax_status()
        if not ok:
            pytest.skip(why)

        def build():
            inputs = keras.Input((4,))
            return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))

        rng = np.random.default_rng(0)
        arrays = {
            "x": rng.normal(size=(32, 4)).astype("float32"),
            "y": rng.integers(0, 3, 32),
            "x_val": rng.normal(size=(16, 4)).astype("float32"),
            "y_val": rng.integers(0, 3, 16),
        }
        train = stock.jax_contender(build, arrays, "float32", 8, 1e-2)
        run = harness.Run(name="jax", epochs=2, initial_weights=build().get_weights())
        train(run)
        assert run.extra["backend"] == "jax"
        assert len(run.curve) == 2 and run.samples == [32, 32]
        assert 0.0 <= run.val_accuracy <= 1.0
    finally:
        stock.jax_status.cache_clear()


def test_resnet20_has_the_papers_layer_count():
    model = resnet.build_resnet20(image_size=32)
    convs = [x for x in model.layers if isinstance(x, keras.layers.Conv2D)]
    dense = [x for x in model.layers if isinstance(x, keras.layers.Dense)]
    # 19 3x3 convolutions + 1 dense = 20 weighted layers, plus 2 1x1 projection shortcuts
    assert sum(c.kernel_size == (3, 3) for c in convs) == 19 and len(dense) == 1
    assert sum(c.kernel_size == (1, 1) for c in convs) == 2
    bns = [x for x in model.layers if isinstance(x, keras.layers.BatchNormalization)]
    assert bns and all(b.momentum == 0.9 for b in bns)
    assert model.output_shape == (None, 10)


def test_encoder_output_does_not_depend_on_padding():
    keras.utils.set_random_seed(0)
    model = text.build_encoder(vocab_size=50, num_classes=6, max_length=16)
    x = np.array([[5, 7, 9, 0, 0, 0, 0, 0]], dtype="int32")
    short = model.predict(x[:, :3], verbose=0)
    padded = model.predict(x, verbose=0)
    np.testing.assert_allclose(short, padded, atol=1e-5)


def test_tf_buckets_are_the_same_buckets_as_ours():
    data = text.TextData(quick=True)
    lengths_ours = [x.shape[1] for x, _ in data.bucketing()]
    lengths_tf = [x.shape[1] for x, _ in data.tf_bucketing()]
    assert sum(len(x) for x, _ in data.tf_bucketing()) == len(data.x)

    def bucket(length):
        return next(i for i, b in enumerate(data.boundaries) if length <= b)

    # every tf.data batch lies within one of our buckets: its longest is within it
    assert {bucket(n) for n in lengths_tf} <= {bucket(n) for n in lengths_ours}
    assert set(lengths_ours) <= set(data.boundaries)


def test_our_bucketing_trains_the_stock_rows_batches_in_their_order():
    """Padding aside, `bucket_by_length` must give `fit` the same batches in the same order as
    tf.data's bucketing, epoch after epoch: the plan's scan of the lengths once drew a shuffle
    order of its own, and our rows trained each epoch on the next epoch's order (to the target
    an epoch sooner on one seed, by luck of the order)."""
    data = text.TextData(quick=True)

    def epochs(dataset, count=2):
        # each epoch opens the dataset anew, as fit does: a new shuffle order
        return [
            [(y.numpy().tolist(), np.count_nonzero(x.numpy(), axis=1).tolist()) for x, y in dataset]
            for _ in range(count)
        ]

    ours, stock_rows = epochs(data.bucketing()), epochs(data.tf_bucketing())
    assert ours[0] != ours[1]  # reshuffled: the check below can fail
    assert ours == stock_rows
    assert int(data.bucketing().cardinality()) == len(ours[0])  # `fit` knows the epoch length


@pytest.mark.slow
@pytest.mark.parametrize("suite", [resnet, text])
def test_workload_suites_quick(tmp_path, suite):
    kwargs = {"jax": False} if suite is resnet else {}
    result = suite.run(tmp_path, quick=True, progress=lambda line: None, **kwargs)
    names = [row["contender"] for row in result["rows"]]
    assert names[0] == workloads.BASELINE
    assert set(stock.policy_fit_names()) <= set(names)
    for row in result["rows"]:
        assert row["throughput_samples_per_s"] > 0
    assert "Keras at its best:" in result["markdown"]
    ours = [r for r in result["rows"] if "vs_keras_at_best" in r]
    assert ours and all(r["vs_keras_at_best"] > 0 for r in ours)
    for suffix in ("md", "json", "png"):
        assert (tmp_path / f"{suite.__name__.rsplit('.', 1)[1]}.{suffix}").stat().st_size > 0


def _timed_run(train_seconds, walls, losses):
    run = harness.Run(name="r", epochs=len(losses), initial_weights=[])
    run.curve = list(zip(walls, losses))
    run.train_seconds = list(train_seconds)
    run.samples = [100] * len(losses)
    return run


def test_time_to_target_parts_add_up_to_the_wall_time_to_target():
    # epoch walls 3.0, 4.5, 6.0, 7.5: training 1.5, 1.0, 1.0, 1.0 -> non-training 1.5, 0.5, 0.5, 0.5
    run = _timed_run([1.5, 1.0, 1.0, 1.0], [3.0, 4.5, 6.0, 7.5], [0.9, 0.6, 0.3, 0.1])
    parts = run.time_to_target_parts(0.3)  # reached in epoch 3 (wall 6.0)
    assert parts == pytest.approx(
        {"epochs": 3, "setup": 1.0, "first_epoch": 1.5, "later_epochs": 2.0, "validation": 1.5}
    )
    assert sum(parts[k] for k in harness.PARTS) == pytest.approx(run.time_to_loss(0.3))
    assert run.time_to_target_parts(0.01) is None  # never reached


def test_parts_section_gives_each_contender_and_the_smallest_of_each_part():
    fast_start = _timed_run([0.5, 1.0], [1.0, 2.5], [0.5, 0.1])  # setup 0, val 0.5 each
    fast_steps = _timed_run([2.0, 0.5], [4.0, 5.0], [0.5, 0.1])  # setup 1.5, val 0.5 each
    runs = {"a": [fast_start], "b": [fast_steps]}
    rows = harness.summarize(runs, 0.1, "a")
    section = harness.parts_section(rows, ["a", "b", "missing"], 0.1)
    assert "| a | 2 | 0.00 | 0.50 | 1.00 | 1.00 | 2.50 |" in section
    assert "| b | 2 | 1.50 | 2.00 | 0.50 | 1.00 | 5.00 |" in section
    assert "| limit (smallest of each part) | 2 | 0.00 | 0.50 | 0.50 | 1.00 | 2.00 |" in section
    assert harness.parts_section(harness.summarize(runs, 0.01, "a"), ["a"], 0.01) == ""
