"""Validation on the optimizer's EMA weights (keras#18949): against a
hand-computed EMA and `model.evaluate` on manually assigned weights; raw weights restored
bit for bit; saved and resumed; warmup-corrected decay."""

import keras
import numpy as np
import pytest
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

import keras_fastloop as kf
from keras_fastloop.callbacks import EMAValidation, PeriodicValidation, ema_weights, use_ema_warmup

RNG = np.random.default_rng(7)
X = RNG.normal(size=(64, 3)).astype("float32")
Y = (X @ RNG.normal(size=(3, 2)) + 0.3).astype("float32")
X_VAL = RNG.normal(size=(16, 3)).astype("float32")
Y_VAL = RNG.normal(size=(16, 2)).astype("float32")
MOMENTUM = 0.8


def make_model(cls=keras.Model, use_ema=True, momentum=MOMENTUM, batch_norm=False, **compile_kw):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    hidden = keras.layers.BatchNormalization()(inputs) if batch_norm else inputs
    model = cls(inputs, keras.layers.Dense(2)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, use_ema=use_ema, ema_momentum=momentum),
        loss="mse",
        metrics=["mae"],
        **compile_kw,
    )
    return model


class Recorder(keras.callbacks.Callback):
    """Raw weights (all, and trainable) after every step, by optimizer step."""

    def __init__(self):
        super().__init__()
        self.weights, self.trainable = {}, {}

    def on_train_batch_end(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.weights[step] = self.model.get_weights()
        self.trainable[step] = [keras.ops.convert_to_numpy(v) for v in self.model.trainable_weights]


def hand_ema(trainable_by_step, momentum=MOMENTUM, warmup=False):
    """`{step: averages}`: Keras' rule (the first update copies), float64."""
    averages, result = None, {}
    for step in sorted(trainable_by_step):
        weights = [w.astype("float64") for w in trainable_by_step[step]]
        t = step - 1  # optimizer.iterations when the update of `step` ran
        decay = min(momentum, (1 + t) / (10 + t)) if warmup else momentum
        if averages is None:
            averages = weights
        else:
            averages = [decay * a + (1 - decay) * w for a, w in zip(averages, weights)]
        result[step] = averages
    return result


def evaluate_with(raw_weights, trainable, batch_norm=False):
    """`model.evaluate` of a fresh model: the raw weights, trainable ones assigned by hand."""
    model = make_model(batch_norm=batch_norm)
    model.set_weights(raw_weights)
    for variable, value in zip(model.trainable_weights, trainable):
        variable.assign(value.astype("float32"))
    return model.evaluate(X_VAL, Y_VAL, verbose=0, return_dict=True)


def fit(model, callbacks, epochs=1, **kwargs):
    return model.fit(
        X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **kwargs
    ).history


def assert_bit_equal(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


# --- PeriodicValidation(ema=True) ------------------------------------------------------------


@pytest.mark.parametrize("batch_norm", [False, True], ids=["dense", "batch_norm"])
def test_periodic_validation_evaluates_the_hand_computed_ema(batch_norm):
    model = make_model(batch_norm=batch_norm)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=3, ema=True)
    recorder = Recorder()
    fit(model, [validation, recorder])
    averages = hand_ema(recorder.trainable)
    assert [entry["step"] for entry in validation.history] == [3, 6]
    for entry in validation.history:
        step = entry["step"]
        # BatchNorm moving statistics: the live (raw) ones, as recorded at the step.
        expected = evaluate_with(recorder.weights[step], averages[step], batch_norm)
        raw = evaluate_with(recorder.weights[step], recorder.trainable[step], batch_norm)
        assert entry["val_loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert entry["val_mae"] == pytest.approx(expected["mae"], rel=1e-5)
        assert entry["val_loss"] != pytest.approx(raw["loss"], rel=1e-3)  # not the raw weights


@pytest.mark.parametrize("batch_norm", [False, True], ids=["dense", "batch_norm"])
def test_training_continues_on_the_raw_weights_bit_for_bit(batch_norm):
    plain, validated = Recorder(), Recorder()
    plain_model = make_model(batch_norm=batch_norm)
    plain_logs = fit(plain_model, [plain], epochs=2)
    model = make_model(batch_norm=batch_norm)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=1, ema=True)
    logs = fit(model, [validation, validated], epochs=2)
    assert len(validation.history) == 16
    assert {key: logs[key] for key in plain_logs} == plain_logs
    for step in plain.weights:  # moving statistics included
        assert_bit_equal(plain.weights[step], validated.weights[step])
    assert_bit_equal(
        [v.numpy() for v in plain_model.optimizer.variables],
        [v.numpy() for v in model.optimizer.variables],
    )


def test_steps_per_execution_auto_validates_at_the_steps_with_the_same_values():
    reference = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=5, ema=True)
    fit(make_model(kf.OptimizedModel), [reference], epochs=3)
    auto = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=5, ema=True)
    fit(make_model(kf.OptimizedModel, steps_per_execution="auto"), [auto], epochs=3)
    assert [entry["step"] for entry in auto.history] == [5, 10, 15, 20]
    for first, second in zip(reference.history, auto.history, strict=True):
        assert second == pytest.approx(first, rel=1e-6)


def test_ema_weights_restores_the_raw_weights_when_the_body_raises():
    model = make_model()
    fit(model, [])
    model.set_weights([w + 1 for w in model.get_weights()])  # raw != EMA after finalize
    raw = model.get_weights()
    with pytest.raises(RuntimeError, match="boom"), ema_weights(model):
        assert not np.array_equal(model.get_weights()[0], raw[0])
        raise RuntimeError("boom")
    assert_bit_equal(raw, model.get_weights())


# --- Keras' validation_data: EMAValidation vs keras.callbacks.SwapEMAWeights -------------------


class SwapProbe(keras.callbacks.Callback):
    """Raw weights just before the swap in and just after the swap back (list around it)."""

    def __init__(self, where):
        super().__init__()
        self.where, self.seen = where, []

    def on_test_begin(self, logs=None):
        if self.where == "before":
            self.seen.append(self.model.get_weights())

    def on_test_end(self, logs=None):
        if self.where == "after":
            self.seen.append(self.model.get_weights())


def _swap_run(swap):
    model = make_model()
    before, after, recorder = SwapProbe("before"), SwapProbe("after"), Recorder()
    history = fit(model, [before, swap, after, recorder], epochs=3, validation_data=(X_VAL, Y_VAL))
    return before.seen, after.seen, history, recorder


def test_keras_swap_ema_weights_changes_the_raw_weights_in_the_last_bits():
    """Why `EMAValidation` exists: Keras swaps by `a + b`, `a - b` on TensorFlow."""
    before, after, _, _ = _swap_run(keras.callbacks.SwapEMAWeights())
    assert any(
        not np.array_equal(a, b)
        for seen_before, seen_after in zip(before, after)
        for a, b in zip(seen_before, seen_after)
    )


def test_ema_validation_evaluates_validation_data_on_the_ema_and_restores_exactly():
    before, after, history, recorder = _swap_run(EMAValidation())
    for seen_before, seen_after in zip(before, after, strict=True):
        assert_bit_equal(seen_before, seen_after)
    averages = hand_ema(recorder.trainable)
    for epoch, step in enumerate([8, 16, 24]):
        expected = evaluate_with(recorder.weights[step], averages[step])
        assert history["val_loss"][epoch] == pytest.approx(expected["loss"], rel=1e-5)
    # Training itself is the run without any validation, bit for bit.
    plain = Recorder()
    fit(make_model(), [plain], epochs=3)
    for step in plain.weights:
        assert_bit_equal(plain.weights[step], recorder.weights[step])


class EpochEndProbe(keras.callbacks.Callback):
    """Trainable weights a callback listed after the swap sees at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([keras.ops.convert_to_numpy(v) for v in self.model.trainable_weights])


def test_swap_on_epoch_shows_later_callbacks_the_ema_and_trains_on_the_raw_weights():
    model, probe, recorder = make_model(), EpochEndProbe(), Recorder()
    history = fit(
        model,
        [EMAValidation(swap_on_epoch=True), probe, recorder],
        epochs=3,
        validation_data=(X_VAL, Y_VAL),
    )
    averages = hand_ema(recorder.trainable)
    for seen, step in zip(probe.seen, [8, 16, 24], strict=True):
        for got, want in zip(seen, averages[step]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # Training and validation: those of EMAValidation() without swap_on_epoch, bit for bit.
    _, _, reference_history, reference = _swap_run(EMAValidation())
    assert history == reference_history
    for step in reference.weights:
        assert_bit_equal(recorder.weights[step], reference.weights[step])
    # After fit, the model holds the averages (Keras' finalize_variable_values).
    for got, want in zip(model.trainable_weights, averages[24]):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(got), want, rtol=1e-5, atol=1e-7)


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "callback",
    [
        lambda: PeriodicValidation((X_VAL, Y_VAL), every_n_steps=2, ema=True),
        lambda: EMAValidation(),
    ],
    ids=["PeriodicValidation", "EMAValidation"],
)
def test_ema_without_use_ema_is_refused_before_the_first_step(callback):
    model = make_model(use_ema=False)
    with pytest.raises(ValueError, match=r"needs an optimizer with `use_ema=True`.*use_ema=False"):
        fit(model, [callback()])
    assert int(model.optimizer.iterations) == 0


def test_ema_functions_refuse_an_optimizer_without_use_ema():
    with pytest.raises(ValueError, match=r"`use_ema_warmup` needs .*Received: optimizer=SGD"):
        use_ema_warmup(keras.optimizers.SGD())
    model = make_model(use_ema=False)
    fit(model, [])
    with (
        pytest.raises(ValueError, match=r"`ema_weights` needs .*use_ema=False"),
        ema_weights(model),
    ):
        pass
    fresh = make_model()
    with pytest.raises(ValueError, match=r"at least one optimizer update.*iterations=0"):
        with ema_weights(fresh):
            pass
    with pytest.raises(ValueError, match=r"`ema` must be a bool\. Received: ema='yes'"):
        PeriodicValidation((X_VAL, Y_VAL), every_n_steps=2, ema="yes")


# --- warmup-corrected decay ------------------------------------------------------------------


def test_warmup_decay_equals_a_hand_written_ema_loop():
    model = make_model(momentum=0.99)
    use_ema_warmup(model.optimizer)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=4, ema=True)
    recorder = Recorder()
    fit(model, [validation, recorder], epochs=2)
    warm = hand_ema(recorder.trainable, momentum=0.99, warmup=True)
    plain = hand_ema(recorder.trainable, momentum=0.99)
    for entry in validation.history:
        step = entry["step"]
        expected = evaluate_with(recorder.weights[step], warm[step])
        assert entry["val_loss"] == pytest.approx(expected["loss"], rel=1e-5)
    # After 16 updates the warm average is mostly recent weights, Keras' mostly the first.
    averages = [v.numpy() for _, v in kf._keras_internals.ema_pairs(model.optimizer)]
    for average, expected, keras_rule in zip(averages, warm[16], plain[16]):
        np.testing.assert_allclose(average, expected, rtol=1e-5, atol=1e-6)
        assert not np.allclose(average, keras_rule, rtol=1e-3)


# --- saved and resumed ---------------------------------------------------------------------------


def _averages(model):
    return [v.numpy() for v in model.optimizer.variables if "average" in v.path]


def test_ema_variables_survive_save_and_load(tmp_path):
    model = make_model(kf.OptimizedModel)
    fit(model, [])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert len(_averages(model)) == 2
    assert_bit_equal(_averages(model), _averages(loaded))
    assert loaded.optimizer.use_ema and loaded.optimizer.ema_momentum == MOMENTUM


def test_backup_and_restore_resumes_the_ema_bit_for_bit(tmp_path):
    straight = make_model(kf.OptimizedModel)
    use_ema_warmup(straight.optimizer)
    straight_validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=4, ema=True)
    fit(straight, [straight_validation], epochs=2)

    first = make_model(kf.OptimizedModel)
    use_ema_warmup(first.optimizer)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    fit(first, [backup], epochs=1)
    resumed = make_model(kf.OptimizedModel)
    use_ema_warmup(resumed.optimizer)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=4, ema=True)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    fit(resumed, [backup, validation], epochs=2)

    assert int(resumed.optimizer.iterations) == 16
    assert_bit_equal(_averages(straight), _averages(resumed))
    assert [entry["step"] for entry in validation.history] == [12, 16]
    assert validation.history == straight_validation.history[2:]


class Preempted(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("preempted")


def test_swap_on_epoch_resumes_exactly_with_backup_and_restore_listed_first(tmp_path):
    def run(callbacks, epochs=4):
        model = make_model(kf.OptimizedModel)
        return model, fit(model, callbacks, epochs=epochs, validation_data=(X_VAL, Y_VAL))

    straight, straight_history = run([EMAValidation(swap_on_epoch=True)])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="preempted"):
        run([keras.callbacks.BackupAndRestore(backup_dir), EMAValidation(True), Preempted()])
    resumed, history = run([keras.callbacks.BackupAndRestore(backup_dir), EMAValidation(True)])
    assert history["val_loss"] == straight_history["val_loss"][2:]
    assert_bit_equal(straight.get_weights(), resumed.get_weights())


def test_backup_and_restore_after_a_swap_on_epoch_is_refused_before_training(tmp_path):
    model, batches = make_model(kf.OptimizedModel), []
    callbacks = [
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b)),
        EMAValidation(swap_on_epoch=True),
        keras.callbacks.BackupAndRestore(str(tmp_path)),
    ]
    with pytest.raises(ValueError, match="must be listed before `EMAValidation"):
        fit(model, callbacks, validation_data=(X_VAL, Y_VAL))
    assert batches == []


# --- replicas --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_replicas_evaluate_the_ema_and_keep_the_raw_weights():
    strategy = two_replica_strategy()

    def run(callbacks):
        with strategy.scope():
            model = make_model()
        recorder = Recorder()
        fit(model, [*callbacks, recorder])
        return recorder

    plain = run([])
    validation = PeriodicValidation(
        {"a": (X_VAL, Y_VAL), "b": (X_VAL[:8], Y_VAL[:8])}, every_n_steps=3, ema=True
    )
    recorder = run([validation])
    for step in plain.weights:
        assert_bit_equal(plain.weights[step], recorder.weights[step])
    averages = hand_ema(recorder.trainable)
    for entry in validation.history:
        expected = evaluate_with(recorder.weights[entry["step"]], averages[entry["step"]])
        assert entry["val_a_loss"] == pytest.approx(expected["loss"], rel=1e-5)


# --- with the rest of the step: micro-batching, non-finite skips, loss scaling ---------------


def _trained(model, callbacks=(), x=X, y=Y, **kwargs):
    """Raw trainable weights by step (`Recorder`), after `fit(x, y)` of 1 epoch of batch 8."""
    recorder = Recorder()
    model.fit(
        x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[*callbacks, recorder], **kwargs
    )
    return recorder


def _inner_averages(model):
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return [keras.ops.convert_to_numpy(a) for _, a in kf._keras_internals.ema_pairs(optimizer)]


@pytest.mark.parametrize("warmup", [False, True], ids=["keras_decay", "warmup"])
def test_micro_batching_updates_the_ema_once_per_step_as_the_full_batch(warmup):
    def run(cls, **compile_kw):
        model = make_model(cls, **compile_kw)
        if warmup:
            use_ema_warmup(model.optimizer)
        return model, _trained(model)

    reference, reference_steps = run(keras.Model)
    model, steps = run(kf.OptimizedModel, micro_batch_size=2)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    averages = hand_ema(steps.trainable, warmup=warmup)[8]
    for ours, keras_average, hand in zip(
        _inner_averages(model), _inner_averages(reference), averages, strict=True
    ):
        np.testing.assert_allclose(ours, keras_average, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours, hand, rtol=1e-5, atol=1e-6)
    for ours, keras_weights in zip(steps.trainable[8], reference_steps.trainable[8], strict=True):
        np.testing.assert_allclose(ours, keras_weights, rtol=1e-5, atol=1e-6)
    with ema_weights(model):
        for weight, average in zip(model.trainable_weights, averages):
            np.testing.assert_allclose(weight.numpy(), average, rtol=1e-5, atol=1e-6)


@EXPECT_SKIP_WARNINGS[0]
@pytest.mark.parametrize("steps_per_execution", [1, "auto"])
def test_a_skipped_step_moves_neither_the_weights_the_average_nor_the_warmup(steps_per_execution):
    """A NaN target in batch 3: the run equals the run without that batch."""
    y_bad = Y.copy()
    y_bad[26, 1] = np.nan
    keep = np.r_[0:24, 32:64]

    def run(x, y, **compile_kw):
        model = make_model(kf.OptimizedModel, momentum=0.99, **compile_kw)
        use_ema_warmup(model.optimizer)
        validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=3, ema=True)
        return model, _trained(model, [validation], x, y), validation

    reference, reference_steps, reference_validation = run(X[keep], Y[keep])
    model, _, validation = run(X, y_bad, nonfinite="skip", steps_per_execution=steps_per_execution)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 7
    assert_bit_equal(model.get_weights(), reference.get_weights())  # after fit: the EMA
    assert_bit_equal(_inner_averages(model), _inner_averages(reference))
    # the reference runs one step per execution: its recorder sees every step
    warm = hand_ema(reference_steps.trainable, momentum=0.99, warmup=True)[7]
    for average, hand in zip(_inner_averages(model), warm, strict=True):
        np.testing.assert_allclose(average, hand, rtol=1e-5, atol=1e-6)
    assert [entry["step"] for entry in validation.history] == [3, 6]
    assert validation.history == reference_validation.history


def _mixed_model(cls, optimizer, **compile_kw):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4)(inputs)
    outputs = keras.layers.Dense(2, dtype="float32")(hidden)
    model = cls(inputs, outputs)
    model.compile(optimizer=optimizer, loss="mse", **compile_kw)
    return model


@EXPECT_SKIP_WARNINGS[1]  # the first step overflows the initial scale 2**15 (Keras' too)
@pytest.mark.parametrize("warmup", [False, True], ids=["keras_decay", "warmup"])
@pytest.mark.parametrize("wrapped_by", ["compile", "user"])
def test_clipping_and_loss_scaling_keep_the_inner_optimizers_ema(wrapped_by, warmup):
    """Under mixed_float16 the `LossScaleOptimizer`'s inner optimizer keeps the average."""

    def sgd(**kwargs):
        optimizer = keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=MOMENTUM, **kwargs)
        if wrapped_by == "user":
            return keras.optimizers.LossScaleOptimizer(optimizer)
        return optimizer

    # Keras clips the unscaled gradient in the inner optimizer: with one replica, the same.
    reference = _mixed_model(keras.Model, sgd(global_clipnorm=0.1))
    model = _mixed_model(kf.OptimizedModel, sgd(), gradient_clipping=0.1)
    if warmup:  # given the LossScaleOptimizer: it reaches the inner one
        use_ema_warmup(reference.optimizer)
        use_ema_warmup(model.optimizer)
    reference_steps = _trained(reference)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=4, ema=True)
    steps = _trained(model, [validation])

    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert optimizer.inner_optimizer.use_ema and not optimizer.use_ema
    updates = int(optimizer.inner_optimizer.iterations)
    assert int(optimizer.iterations) == int(reference.optimizer.iterations) == updates
    assert int(model.skipped_steps) == 8 - updates > 0  # an overflow: no update, no average
    initial = _mixed_model(keras.Model, "sgd").get_weights()
    first_update = np.sqrt(sum(np.sum((w - w0) ** 2) for w, w0 in zip(steps.trainable[1], initial)))
    assert first_update == pytest.approx(0.05 * 0.1, rel=1e-4)  # the clipping acted
    averages = hand_ema(steps.trainable, warmup=warmup)
    for ours, keras_average, hand in zip(
        _inner_averages(model), _inner_averages(reference), averages[updates], strict=True
    ):
        np.testing.assert_allclose(ours, keras_average, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours, hand, rtol=1e-5, atol=1e-6)
    last, reference_last = steps.trainable[updates], reference_steps.trainable[updates]
    for ours, keras_weights in zip(last, reference_last, strict=True):
        np.testing.assert_allclose(ours, keras_weights, rtol=1e-5, atol=1e-6)
    entry = validation.history[0]
    assert entry["step"] == 4
    fresh = _mixed_model(keras.Model, "sgd")
    for variable, value in zip(fresh.trainable_weights, averages[4]):
        variable.assign(value.astype("float32"))
    expected = fresh.evaluate(X_VAL, Y_VAL, verbose=0, return_dict=True)
    assert entry["val_loss"] == pytest.approx(expected["loss"], rel=1e-5)
