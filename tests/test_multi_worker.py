"""OptimizedModel under MultiWorkerMirroredStrategy: 2 worker processes on loopback ports.

The workers are started and stopped by the test through `keras_fastloop_cli.launch` (bounded by a
timeout). Both must end with identical weights, and their losses, evaluation and predictions
must match a 1-worker run (default strategy, in this process) on the same global batches.
"""

import io
import json
import os
import runpy
import sys

import numpy as np
import pytest

from keras_fastloop_cli import launch as launch_module

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # integration: the slow job

WORKER_SCRIPT = r"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

MULTI = "TF_CONFIG" in os.environ
strategy = tf.distribute.MultiWorkerMirroredStrategy() if MULTI else tf.distribute.get_strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fastloop as kf  # noqa: E402

GLOBAL_BATCH = 8
rng = np.random.default_rng(11)
x = rng.normal(size=(32, 4)).astype("float32")
y = {
    "a": (x @ rng.normal(size=(4, 1)) * 5.0).astype("float32"),
    "b": (rng.normal(size=(32, 1)) * 3.0).astype("float32"),
}
sw = rng.uniform(0.0, 2.0, size=(32,)).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
train = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(GLOBAL_BATCH).with_options(options)
inputs_only = tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH).with_options(options)

with strategy.scope():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(
        6, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)
    )(inputs)
    model = kf.OptimizedModel(
        inputs, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    )
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0**10
    )
    model.compile(
        optimizer,
        {"a": "mse", "b": "mse"},
        metrics={"a": ["mae"]},
        gradient_clipping=1.0,
        loss_weighting="loss_ema",
        micro_batch_size=2,
    )
history = model.fit(train, epochs=2, verbose=0)
evaluation = model.evaluate(train, verbose=0, return_dict=True)
predictions = model.predict(inputs_only, verbose=0)
result = {
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "evaluate": {k: float(v) for k, v in evaluation.items()},
    "predict_a": np.asarray(predictions["a"]).ravel().tolist(),
    "weights": [w.numpy().ravel().tolist() for w in model.weights],
}
name = f"worker{os.environ.get('KERAS_FASTLOOP_WORKER', 'single')}.json"
with open(os.path.join(sys.argv[1], name), "w") as f:
    json.dump(result, f)
print("done", name)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_worker")
    script = out / "worker.py"
    script.write_text(WORKER_SCRIPT)
    log = io.StringIO()
    # The workers import this checkout's keras_fastloop (not another editable install).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    code = launch_module.launch([str(script), str(out)], workers=2, timeout=75, stdout=log, env=env)
    assert code == 0, log.getvalue()[-6000:]
    workers = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
    # The 1-worker reference: the same script in this process, default strategy.
    saved = sys.argv
    try:
        sys.argv = [str(script), str(out)]
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    single = json.loads((out / "workersingle.json").read_text())
    return workers, single, log.getvalue()


def test_workers_end_with_identical_weights(runs):
    workers, _, _ = runs
    for a, b in zip(workers[0]["weights"], workers[1]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_multi_worker_matches_one_worker(runs):
    workers, single, _ = runs
    for key in ("loss", "a_loss", "b_loss", "grad_norm", "loss_scale"):
        np.testing.assert_allclose(
            workers[0]["history"][key], single["history"][key], rtol=1e-5, err_msg=key
        )
    for a, b in zip(workers[0]["weights"], single["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(single["history"]["grad_norm"]) > 1.0  # clipping was active


def test_multi_worker_evaluate_and_predict(runs):
    workers, single, _ = runs
    for worker in workers:
        for key, value in single["evaluate"].items():
            np.testing.assert_allclose(worker["evaluate"][key], value, rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(worker["predict_a"], single["predict_a"], rtol=1e-5, atol=1e-6)


def test_launcher_prefixes_output(runs):
    _, _, log = runs
    assert "[worker 0] done worker0.json" in log
    assert "[worker 1] done worker1.json" in log


# ----------------------------------------------------------------------------- the launcher


def test_launch_fails_when_a_worker_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['KERAS_FASTLOOP_WORKER'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    log = io.StringIO()
    assert launch_module.launch([str(script)], workers=2, timeout=30, stdout=log) == 3
    assert "worker 1 exited with code 3" in log.getvalue()


def test_launch_times_out(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    log = io.StringIO()
    assert launch_module.launch([str(script)], workers=2, timeout=1, stdout=log) == 124


def test_launch_sets_tf_config(tmp_path):
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(os.environ['TF_CONFIG'])\n")
    log = io.StringIO()
    assert launch_module.launch([str(script)], workers=2, timeout=30, stdout=log) == 0
    configs = [
        json.loads(line.split("] ", 1)[1]) for line in log.getvalue().splitlines() if "{" in line
    ]
    assert sorted(c["task"]["index"] for c in configs) == [0, 1]
    hosts = {tuple(c["cluster"]["worker"]) for c in configs}
    assert len(hosts) == 1 and len(next(iter(hosts))) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"script_args": []},
        {"script_args": ["x.py"], "workers": 0},
        {"script_args": ["x.py"], "timeout": 0},
    ],
)
def test_launch_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        launch_module.launch(**kwargs)


def test_main_parses_the_command_line(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import sys\nsys.exit(0)\n")
    assert launch_module.main(["--workers", "2", "--timeout", "30", "--", str(script)]) == 0
    with pytest.raises(SystemExit):
        launch_module.main(["--workers", "2"])


def test_free_ports_are_distinct():
    ports = launch_module.free_ports(3)
    assert len(set(ports)) == 3
