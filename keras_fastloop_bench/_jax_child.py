"""Child of `keras_fastloop_bench.stock.jax_contender`: Keras `fit` on the JAX backend.

Run as a script (`python _jax_child.py SPEC`, `KERAS_BACKEND=jax`): it imports Keras and NumPy
only (neither TensorFlow nor `keras_fastloop`, whose import would load TensorFlow). `SPEC` is a
JSON file: `{"model", "data", "policy", "epochs", "batch_size", "learning_rate", "loss", "out"}`.
It writes what a `harness.Run` holds to `out`, as JSON.
"""

import sys

sys.path.pop(0)  # this folder: its module names must not shadow anything

import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    import keras
    import numpy as np

    keras.config.set_dtype_policy(spec["policy"])
    data = np.load(spec["data"])
    x, y, x_val, y_val = data["x"], data["y"], data["x_val"], data["y_val"]
    model = keras.saving.load_model(spec["model"], compile=False)
    model.compile(keras.optimizers.Adam(spec["learning_rate"]), spec["loss"], metrics=["accuracy"])
    keras.utils.set_random_seed(0)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"curve": [], "train_seconds": [], "samples": []}

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = self.t_last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.t_last = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            out["curve"].append((time.perf_counter() - start, float(logs["loss"])))
            out["train_seconds"].append(self.t_last - self.t0)
            out["samples"].append(len(x))

    start = time.perf_counter()
    model.fit(
        x,
        y,
        batch_size=spec["batch_size"],
        epochs=spec["epochs"],
        validation_data=(x_val, y_val),
        validation_batch_size=256,
        shuffle=True,
        callbacks=[Timer()],
        verbose=0,
    )
    result = model.evaluate(x_val, y_val, batch_size=256, verbose=0, return_dict=True)
    out["val_accuracy"] = float(result["accuracy"])
    out["total_seconds"] = time.perf_counter() - start
    out["peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start_rss
    out["backend"] = keras.backend.backend()
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
