# Over 500 lines on purpose: the default suite's contenders, its run loop and its report sections
# are one table's parts; the parts other suites share already live in `harness.py`, `stock.py`
# and `own_process.py`.
"""The main job: plain `fit` vs the seed's hand-written loops vs OptimizedModel, on real data.


Every contender trains the same small CNN from identical initial weights on scikit-learn's
digits (1,797 real images, upsampled to 16x16; a stratified 20% held out for validation), with
the same optimizer (Adam, 1e-3), batch size (64), data order and number of epochs, validating on
the held-out split after every epoch. Contenders run in alternation, several rounds, and the
report gives medians and ratios against plain `keras.Model.fit`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import keras
import tensorflow as tf

from keras_fastloop import mixed_precision, tuning
from keras_fastloop.callbacks.monitors import ProfilerWindow
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation
from keras_fastloop.datasets.digits import load_digits_data
from keras_fastloop.model import OptimizedModel
from keras_fastloop_bench import flops, harness, stock, torch_contender
from keras_fastloop_bench.own_process import own_process_contender

BATCH_SIZE = 64
LEARNING_RATE = 1e-3
SEED = 0
BASELINE = "keras.Model.fit (per-epoch validation)"
VALIDATE_EVERY_2 = "OptimizedModel.fit + PeriodicValidation (every 2 epochs)"
RECOMMENDED = "OptimizedModel, recommended setup"
RECOMMENDED_ONEDNN = "OptimizedModel, recommended setup + oneDNN (own process)"
RECOMMENDED_CONTROL = "OptimizedModel, recommended setup (own process, oneDNN off: control)"
TORCH = "PyTorch eager, same CNN (float32)"
TORCH_BF16 = "PyTorch eager, same CNN (bf16 autocast)"

# The seed article's claim (harness.SEED_ARTICLE), printed next to what we measure.
SEED_CLAIM = (
    f"The seed article {harness.SEED_ARTICLE} claims a custom GradientTape loop lowers the loss 15.3% faster than `fit` "
    "(ResNet-50, CIFAR-10, V100). A custom loop runs the same mathematics as `fit`, so any gain "
    "can only come from wall-clock savings; this table measures them."
)


def build_cnn(model_cls=keras.Model, image_size=16, num_classes=10):
    """Small CNN for digits: 3 conv layers (16, 32, 64 filters), 2 poolings, softmax head.

    The head is float32 so the loss stays float32 under mixed precision.
    """
    inputs = keras.Input((image_size, image_size, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(keras.layers.MaxPooling2D()(h))
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(h)
    return model_cls(inputs, outputs)


class Data:
    """The digits split as tf.data pipelines, rebuilt identically for every run."""

    def __init__(self, quick=False):
        self.quick = quick
        (self.x, self.y), (self.x_val, self.y_val) = load_digits_data(image_size=16)
        if quick:
            self.x, self.y = self.x[:256], self.y[:256]
            self.x_val, self.y_val = self.x_val[:128], self.y_val[:128]

    def train(self):
        ds = tf.data.Dataset.from_tensor_slices((self.x, self.y))
        ds = ds.shuffle(len(self.x), seed=0, reshuffle_each_iteration=True)
        return ds.batch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE)

    def train_epochs(self, epochs):
        """One iterable of batches per epoch, in the order `fit` trains `self.train()`.

        Every opening of the dataset draws the next shuffle order. Keras' epoch iterator
        opens it once more before each epoch after the first, so `fit`'s epoch `k` trains
        order `2k`; the hand-written loops train the same batches through this method (a
        test compares their losses with `fit`'s).
        """
        dataset = self.train()
        for epoch in range(epochs):
            if epoch:
                iter(dataset)
            yield dataset

    def val(self):
        ds = tf.data.Dataset.from_tensor_slices((self.x_val, self.y_val))
        return ds.batch(256).prefetch(tf.data.AUTOTUNE)


def fit_contender(data, model_cls=keras.Model, compile_kwargs=None, callbacks=(), validate=True):
    """A contender that trains with `model.fit` (plain Keras or OptimizedModel)."""

    def train(run):
        model = build_cnn(model_cls)
        model.set_weights(run.initial_weights)
        model.compile(
            keras.optimizers.Adam(LEARNING_RATE),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
            **(compile_kwargs or {}),
        )
        extra = [cb() for cb in callbacks]
        model.fit(
            data.train(),
            epochs=run.epochs,
            validation_data=data.val() if validate else None,
            callbacks=[harness.EpochTimer(run, len(data.x)), *extra],
            verbose=0,
        )
        run.finish(model.evaluate(data.val(), verbose=0, return_dict=True)["accuracy"])

    return train


def loop_contender(data, compiled):
    """The seed's hand-written GradientTape loop, eager or wrapped in `tf.function`."""

    def train(run):
        model = build_cnn(keras.Model)
        model.set_weights(run.initial_weights)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        train_loss = keras.metrics.Mean()
        val_acc = keras.metrics.SparseCategoricalAccuracy()

        def train_step(x, y):
            with tf.GradientTape() as tape:
                preds = model(x, training=True)
                loss = loss_fn(y, preds)
            grads = tape.gradient(
                loss, model.trainable_weights, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
            train_loss.update_state(loss, sample_weight=tf.shape(x)[0])

        def val_step(x, y):
            val_acc.update_state(y, model(x, training=False))

        if compiled:
            train_step, val_step = tf.function(train_step), tf.function(val_step)
        for epoch_data in data.train_epochs(run.epochs):
            train_loss.reset_state()
            t0 = time.perf_counter()
            for x, y in epoch_data:
                train_step(x, y)
            loss = float(train_loss.result())  # reading the metric waits for the last step
            seconds = time.perf_counter() - t0
            val_acc.reset_state()
            for x, y in data.val():
                val_step(x, y)
            float(val_acc.result())
            run.epoch_done(loss, seconds, len(data.x))
        val_acc.reset_state()
        for x, y in data.val():
            val_step(x, y)
        run.finish(val_acc.result())

    return train


def confirm_recommended_policy(data, steps=10):
    """Times the recommended mixed policy against float32 on this CNN once (a user does it once
    per machine and model); restores float32 globally. Returns `(PolicyChoice, seconds)`."""

    def model_fn():
        model = build_cnn()
        model.compile(keras.optimizers.Adam(LEARNING_RATE), "sparse_categorical_crossentropy")
        return model

    t0 = time.perf_counter()
    try:
        setup = tuning.recommended_setup(
            model_fn, (data.x[:BATCH_SIZE], data.y[:BATCH_SIZE]), steps=steps
        )
    finally:
        keras.config.set_dtype_policy("float32")
    return setup.policy_choice, time.perf_counter() - t0


def recommended_contender(data, policy=None):
    """OptimizedModel with `tuning.recommended_setup`: the policy (confirmed by timing before
    the rounds, else the hardware rule), `steps_per_execution="auto"`, `optimize_pipeline`
    for the training and the validation data."""

    def train(run):
        chosen = policy or mixed_precision.recommended_policy()
        try:
            keras.config.set_dtype_policy(chosen)
            setup = tuning.RecommendedSetup(policy=chosen, policy_choice=None)
            model = build_cnn(OptimizedModel)
            model.set_weights(run.initial_weights)
            model.compile(
                keras.optimizers.Adam(LEARNING_RATE),
                "sparse_categorical_crossentropy",
                metrics=["accuracy"],
                **setup.compile_kwargs,
            )
            model.fit(
                setup.pipeline(data.train()),
                epochs=run.epochs,
                validation_data=setup.pipeline(data.val()),
                callbacks=[harness.EpochTimer(run, len(data.x))],
                verbose=0,
            )
            tuner = tuning.steps_per_execution_tuner(model)
            run.extra["steps_per_execution"] = f"{tuner.steps} ({tuner.phase})"
            run.finish(model.evaluate(data.val(), verbose=0, return_dict=True)["accuracy"])
        finally:
            keras.config.set_dtype_policy("float32")

    return train


PROFILED = (
    BASELINE,
    "OptimizedModel.fit (features off)",
    "OptimizedModel.fit (+ clipping, guards)",
    RECOMMENDED,
)


def profile_step(
    data, out_dir, compile_kwargs=None, model_cls=keras.Model, top=6, policy=None, pipeline=False
):
    """Op time by type over the second epoch of a fresh 2-epoch `fit` (`ProfilerWindow`).

    Run after the timed rounds, so profiling never slows a timed run. `policy`: the dtype
    policy to build the model under (`None`: the current one); `pipeline`: train on
    `optimize_pipeline(data.train())`. Returns the rows of `ProfilerWindow.op_time_by_type` as
    dicts plus `op_ms_per_step` (all op types).
    """
    steps = -(-len(data.x) // BATCH_SIZE)
    profiler = ProfilerWindow(steps + 1, 2 * steps, logdir=out_dir)
    with harness.dtype_policy(policy):
        model = build_cnn(model_cls)
    model.compile(
        keras.optimizers.Adam(LEARNING_RATE),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **(compile_kwargs or {}),
    )
    train = tuning.optimize_pipeline(data.train()) if pipeline else data.train()
    model.fit(train, epochs=2, callbacks=[profiler], verbose=0)
    rows = profiler.op_time_by_type()
    by_type = {}
    for r in rows:
        by_type[r.op_type] = by_type.get(r.op_type, 0.0) + r.ms_per_step
    return {
        "op_ms_per_step": sum(r.ms_per_step for r in rows),
        "top": [r._asdict() for r in rows[:top]],
        "ms_per_step_by_type": by_type,
    }


def _profile_section(profiles):
    lines = [
        "Where a step's time goes (`ProfilerWindow` over epoch 2 of a separate 2-epoch `fit`, "
        "after the timed rounds; op self time summed over threads, so it can exceed wall time):\n",
        "| contender | op time per step (ms) | op types plain `fit` does not run (ms per step) "
        "| largest op types (ms per step, share) |",
        "|---|---:|---|---|",
    ]
    baseline = set(profiles[BASELINE]["ms_per_step_by_type"])
    for name, profile in profiles.items():
        top = ", ".join(
            f"`{r['op_type']}` {r['ms_per_step']:.2f} ({100 * r['share']:.0f} %)"
            for r in profile["top"]
        )
        extra = {k: v for k, v in profile["ms_per_step_by_type"].items() if k not in baseline}
        extra_text = (
            f"{sum(extra.values()):.3f}: " + ", ".join(f"`{k}`" for k in sorted(extra))
            if extra
            else "–"
        )
        lines.append(f"| {name} | {profile['op_ms_per_step']:.2f} | {extra_text} | {top} |")
    return "\n".join(lines) + "\n"


def contenders(data, recommended_policy=None, extras=True, notes=None):
    """Name -> contender; the first one is the baseline of every ratio.

    With `extras` (the default; the child of `bench.own_process` passes `False`):

    - where this process runs without oneDNN on an x86 CPU (TensorFlow's default on CPUs
      without AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX), the recommended setup runs twice more
      in child processes (`bench.own_process`; TensorFlow reads the switch only at import):
      with `TF_ENABLE_ONEDNN_OPTS=1`, and with `=0` as the control that isolates oneDNN from
      running in a fresh process;
    - where PyTorch is installed, the same CNN in eager PyTorch (`bench.torch_contender`),
      float32, and with bf16 autocast where the recommended policy is `mixed_bfloat16`;
    - Keras on the JAX backend in its own process where jax imports there
      (`bench.stock.jax_contenders`; why not, appended to `notes`).

    Always: plain `fit` at the recommended policy with `steps_per_execution` 1, 8 and 32
    (`bench.stock.policy_contenders`), from which the report picks Keras at its best.
    """
    notes = [] if notes is None else notes
    suite = {
        BASELINE: fit_contender(data),
        "seed's GradientTape loop (eager)": loop_contender(data, compiled=False),
        "seed's GradientTape loop (tf.function)": loop_contender(data, compiled=True),
        "OptimizedModel.fit (features off)": fit_contender(data, OptimizedModel),
        "OptimizedModel.fit (+ clipping, guards)": fit_contender(
            data, OptimizedModel, {"gradient_clipping": 1.0}
        ),
        VALIDATE_EVERY_2: fit_contender(
            data,
            OptimizedModel,
            callbacks=[lambda: PeriodicValidation(data.val(), every_n_epochs=2)],
            validate=False,
        ),
        RECOMMENDED: recommended_contender(data, recommended_policy),
    }
    # Keras at its best (bench.stock): plain `fit` at the recommended policy, fixed
    # steps_per_execution 1, 8, 32
    policy = recommended_policy or mixed_precision.recommended_policy()
    suite.update(stock.policy_contenders(lambda kw: fit_contender(data, compile_kwargs=kw), policy))
    if extras:
        suite.update(
            stock.jax_contenders(
                build_cnn,
                {"x": data.x, "y": data.y, "x_val": data.x_val, "y_val": data.y_val},
                policy,
                BATCH_SIZE,
                LEARNING_RATE,
                notes,
            )
        )
    if extras and tuning.onednn_off_on_x86():
        for name, value in ((RECOMMENDED_CONTROL, "0"), (RECOMMENDED_ONEDNN, "1")):
            suite[name] = own_process_contender(
                RECOMMENDED, {"TF_ENABLE_ONEDNN_OPTS": value}, data.quick, recommended_policy
            )
    if extras and torch_contender.torch_available():
        suite[TORCH] = torch_contender.torch_contender(data, LEARNING_RATE)
        if recommended_policy == "mixed_bfloat16":  # the CPU or GPU has bf16 units
            suite[TORCH_BF16] = torch_contender.torch_contender(data, LEARNING_RATE, bf16=True)
    return suite


def run(
    out_dir: Path,
    quick: bool = False,
    rounds: int | None = None,
    epochs: int | None = None,
    target_loss: float | None = None,
    progress=print,
) -> dict:
    """Run the default suite; write `default.md`, `default.json`, `default.png`.

    Args:
        out_dir: folder for the report files (created if missing).
        quick: tiny sizes (256 training images, 2 epochs, 1 round) for tests.
        rounds: rounds of alternation. Default 3 (1 when `quick`).
        epochs: epochs per run. Default 12 (2 when `quick`).
        target_loss: training loss for "time to target". Default 0.05, reached after most
            of the epochs, so the ratio reflects the whole run (quick: the baseline's final
            loss).
        progress: callable that receives progress lines. Default `print`.

    Returns:
        A JSON-able dict: `machine`, `config`, `rows` (one per contender) and `markdown`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = rounds or (1 if quick else 3)
    epochs = epochs or (2 if quick else 12)
    data = Data(quick)
    keras.utils.set_random_seed(SEED)  # also seeds tf.data's shuffle (own_process repeats it)
    initial = build_cnn().get_weights()
    progress(f"[default] {len(data.x)} training images, {epochs} epochs x {rounds} rounds")
    choice, choice_seconds = confirm_recommended_policy(data)
    notes = []
    runs = harness.run_alternating(
        contenders(data, choice.policy, notes=notes),
        lambda: [w.copy() for w in initial],
        epochs,
        rounds,
        progress,
    )
    if target_loss is None:
        target_loss = 0.05 if not quick else max(r.curve[-1][1] for r in runs[BASELINE])
    rows = harness.summarize(runs, target_loss, BASELINE)
    progress("[default] profiling one epoch of: " + ", ".join(PROFILED))
    profile_kwargs = {
        BASELINE: {},
        "OptimizedModel.fit (features off)": {"model_cls": OptimizedModel},
        "OptimizedModel.fit (+ clipping, guards)": {
            "model_cls": OptimizedModel,
            "compile_kwargs": {"gradient_clipping": 1.0},
        },
        RECOMMENDED: {
            "model_cls": OptimizedModel,
            "compile_kwargs": {"steps_per_execution": tuning.AUTO},
            "policy": choice.policy,
            "pipeline": True,
        },
    }
    with tempfile.TemporaryDirectory() as logdir:
        profiles = {
            name: profile_step(data, f"{logdir}/{i}", **profile_kwargs[name])
            for i, name in enumerate(PROFILED)
        }
    machine = harness.machine_description()
    table = harness.markdown_table(rows, BASELINE, target_loss)
    at_best = stock.at_best_section(runs, rows, [RECOMMENDED], BASELINE, target_loss)
    table += "\n" + at_best + "".join(f"\n{note}\n" for note in notes)
    markdown = (
        f"# keras-fastloop bench — default suite\n\nMachine: {machine}\n\n"
        f"Data: scikit-learn digits (real, {len(data.x)} train / {len(data.x_val)} validation "
        f"images, 16x16), batch {BATCH_SIZE}, Adam {LEARNING_RATE}, {epochs} epochs, "
        f"validation after every epoch (except the PeriodicValidation contender: every 2 epochs), {rounds} alternating rounds (medians).\n\n"
        f"{table}\n{_onednn_note(runs)}{_flops_section(rows, choice, choice_seconds)}{_auto_note(runs)}\n"
        f"{_profile_section(profiles)}\n"
        f"{SEED_CLAIM}\n"
    )
    harness.plot_curves(
        runs,
        out_dir / "default.png",
        "digits CNN: loss vs wall time",
        target_loss=target_loss,
        highlight=[RECOMMENDED],
    )
    payload = {
        "suite": "default",
        "machine": machine,
        "config": {
            "epochs": epochs,
            "rounds": rounds,
            "batch_size": BATCH_SIZE,
            "target_loss": target_loss,
            "train_images": len(data.x),
        },
        "rows": rows,
        "recommended_policy": {
            "policy": choice.policy,
            "recommended": choice.recommended,
            "seconds_per_step": choice.seconds_per_step,
            "confirm_seconds": choice_seconds,
        },
        "curves": {name: [r.curve for r in rs] for name, rs in runs.items()},
        "extra": {name: [r.extra for r in rs] for name, rs in runs.items()},
        "profiles": profiles,
        "markdown": markdown,
    }
    harness.write_report(out_dir, "default", markdown, payload)
    return payload


def _onednn_note(runs):
    """A paragraph on the own-process oneDNN contender, or `""` when it did not run."""
    if RECOMMENDED_ONEDNN not in runs:
        return ""
    child = {run.extra.get("onednn") for run in runs[RECOMMENDED_ONEDNN]}
    control = {run.extra.get("onednn") for run in runs[RECOMMENDED_CONTROL]}
    state = "on" if child == {True} else f"NOT on ({sorted(map(str, child))})"
    control_state = "off" if control == {False} else f"NOT off ({sorted(map(str, control))})"
    return (
        f"`{RECOMMENDED_ONEDNN}`: TensorFlow left oneDNN off in this process (its default on "
        "x86 CPUs without AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX), so this row is the "
        "recommended setup in a child process started with `TF_ENABLE_ONEDNN_OPTS=1` (oneDNN "
        f"{state} there), and `{RECOMMENDED_CONTROL}` the same child with `=0` (oneDNN "
        f"{control_state}): the difference between the two rows is oneDNN's, not the fresh "
        "process'. Both alternate with the others; TensorFlow's import in a child is not "
        "timed. To get oneDNN, set the variable before Python imports TensorFlow (its kernels "
        "round differently: float32 results change in the last digits).\n\n"
    )


def _flops_section(rows, choice, choice_seconds):
    """Adds achieved FLOP/s and % of peak to `rows`; returns a markdown section."""
    train_flops = flops.count_flops(build_cnn()).training
    peak = flops.machine_peak()
    lines = [
        f"Achieved FLOP/s: {train_flops / 1e6:.2f} MFLOP per training sample (analytic, 3 x "
        f"forward) x samples/s. Peak: {peak.device}, fp32 {peak.fp32 / 1e9:.0f} GFLOP/s"
        + (f", bf16 {peak.low_precision / 1e9:.0f} GFLOP/s" if peak.low_precision else "")
        + f" ({peak.formula}).\n",
        "| contender | policy | GFLOP/s | % of peak |",
        "|---|---|---:|---:|",
    ]
    for row in rows:
        recommended = row["contender"] in (
            RECOMMENDED,
            RECOMMENDED_ONEDNN,
            RECOMMENDED_CONTROL,
            stock.JAX,
        ) or row["contender"].startswith(stock.POLICY_FIT)
        policy = choice.policy if recommended else "float32"
        if row["contender"] == TORCH_BF16:
            policy = "mixed_bfloat16"
        achieved = row["throughput_samples_per_s"] * train_flops
        ceiling = peak.for_policy(policy)
        row["achieved_flops"] = achieved
        row["percent_of_peak"] = 100 * achieved / ceiling
        lines.append(
            f"| {row['contender']} | {policy} | {achieved / 1e9:.2f} | "
            f"{row['percent_of_peak']:.2f} |"
        )
    timed = ", ".join(f"{k} {1e3 * v:.1f} ms/step" for k, v in choice.seconds_per_step.items())
    lines.append(
        f"\nRecommended setup: policy `{choice.policy}` (hardware rule: `{choice.recommended}`; "
        f"confirmed once before the rounds in {choice_seconds:.1f} s, not counted above: "
        f'{timed or "not timed"}), `steps_per_execution="auto"`, `optimize_pipeline` (prefetch, tf.data autotuning off).'
    )
    return "\n".join(lines) + "\n"


def _auto_note(runs):
    """A line on where `"auto"` ended in each recommended-setup run, or `""` when none ran."""
    chosen = [
        f"{name}: " + ", ".join(run.extra.get("steps_per_execution", "?") for run in runs[name])
        for name in (RECOMMENDED, RECOMMENDED_CONTROL, RECOMMENDED_ONEDNN)
        if name in runs
    ]
    if not chosen:
        return ""
    return (
        '`"auto"` at the end of each run (steps per execution, tuner phase; rounds in order): '
        + "; ".join(chosen)
        + ".\n"
    )
