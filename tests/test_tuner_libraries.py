"""KerasTuner and Optuna with the swap, as a user runs them: reference values from `keras.Model`.

Each search or study runs twice on the bundled digits, once building `keras.Model` and once
`kf.OptimizedModel` with compile options that leave the numbers Keras' (micro-batching, a
clipping threshold never reached, `steps_per_execution="auto"`); the trials' hyperparameters,
scores, intermediate values and pruning decisions must be the same. A pruned trial raises
`optuna.TrialPruned` from a callback inside `fit`: the model must come out of it as a
`keras.Model` does, with no `fit` of ours left running, and train on as Keras' does; a step
it skipped is said once, and not as a skip of the next `fit`.
"""

import copy
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf
from keras_fastloop import _fit_run

keras_tuner = pytest.importorskip("keras_tuner", reason="in the test extra: pip install '.[test]'")
optuna = pytest.importorskip("optuna", reason="in the test extra: pip install '.[test]'")

BATCH = 64
STEPS_PER_EPOCH = 23  # ceil(1438 training images / 64)
# A clipping threshold far above any gradient norm here: the clipping stage runs, never acts.
NEVER_CLIPS = 1e6


@pytest.fixture(scope="module")
def digits():
    (x, y), (x_val, y_val) = kf.datasets.load_digits_data(image_size=8)
    assert -(-len(x) // BATCH) == STEPS_PER_EPOCH
    return x, y, x_val, y_val


def _build(model_class, learning_rate, units=16, use_ema=False, **options):
    """The user's model: seeded, so every trial starts from the same weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Dense(units, activation="relu")(keras.layers.Flatten()(inputs))
    model = model_class(inputs, keras.layers.Dense(10)(hidden))
    model.compile(
        keras.optimizers.Adam(learning_rate, use_ema=use_ema),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **options,
    )
    return model


# -- KerasTuner ----------------------------------------------------------------------------


def _hypermodel(model_class, **options):
    def build(hp):
        learning_rate = hp.Float("learning_rate", 1e-3, 1e-2, sampling="log")
        return _build(model_class, learning_rate, units=hp.Choice("units", [16, 32]), **options)

    return build


def _search(model_class, directory, search_kwargs, tuner_kwargs=None, **options):
    tuner = keras_tuner.RandomSearch(
        _hypermodel(model_class, **options),
        **{
            "objective": "val_loss",
            "max_trials": 2,
            "seed": 1,
            "directory": str(directory),
            "project_name": model_class.__name__,
            **(tuner_kwargs or {}),
        },
    )
    x, y = search_kwargs.pop("data")
    tuner.search(x, y, batch_size=BATCH, epochs=2, verbose=0, **search_kwargs)
    return tuner


def _trials(tuner):
    trials = sorted(tuner.oracle.trials.values(), key=lambda trial: trial.trial_id)
    return [(trial.hyperparameters.values, trial.score) for trial in trials]


@pytest.fixture(scope="module")
def keras_search(digits, tmp_path_factory):
    """The reference: the search with `keras.Model` and `validation_data`."""
    x, y, x_val, y_val = digits
    return _search(
        keras.Model,
        tmp_path_factory.mktemp("keras_tuner"),
        {"data": (x, y), "validation_data": (x_val, y_val)},
    )


def _assert_same_trials(tuner, reference):
    got, expected = _trials(tuner), _trials(reference)
    assert [hp for hp, _ in got] == [hp for hp, _ in expected]
    assert len({hp["learning_rate"] for hp, _ in got}) == 2  # two different trials
    np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=1e-6)


def test_keras_tuner_search_scores_equal_keras_model(digits, keras_search, tmp_path):
    """RandomSearch over learning rate and width: the same trials, the same `val_loss` scores;
    `get_best_models` rebuilds an `OptimizedModel` through the hypermodel and loads KerasTuner's
    checkpoint, whose weights are those of `keras.Model`'s best trial and score its value."""
    x, y, x_val, y_val = digits
    options = {
        "micro_batch_size": 16,
        "gradient_clipping": NEVER_CLIPS,
        "steps_per_execution": "auto",
    }
    tuner = _search(
        kf.OptimizedModel, tmp_path, {"data": (x, y), "validation_data": (x_val, y_val)}, **options
    )
    _assert_same_trials(tuner, keras_search)

    best = tuner.get_best_models(1)[0]
    reference = keras_search.get_best_models(1)[0]
    assert isinstance(best, kf.OptimizedModel)
    config = best.get_compile_config()
    for name, value in options.items():
        given = config[name]["config"]["clipnorm"] if name == "gradient_clipping" else config[name]
        assert given == value
    for got, expected in zip(best.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    best_score = tuner.oracle.get_best_trials(1)[0].score
    np.testing.assert_allclose(
        best.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)["loss"],
        best_score,
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "validation",
    [
        pytest.param({"every_n_epochs": 1, "dataset": True}, id="epochs_dataset"),
        pytest.param(
            {"every_n_steps": STEPS_PER_EPOCH, "dataset": False},
            id="steps_arrays",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_keras_tuner_reads_periodic_validation(digits, keras_search, tmp_path, validation):
    """`PeriodicValidation` as the objective's source instead of `validation_data`: its
    `val_loss` enters the epoch logs KerasTuner reads. Validating at each epoch's last step gives
    the scores of `validation_data`. KerasTuner deep-copies the callbacks for every trial: a
    `tf.data` validation set is shared by the copies (a dataset cannot be deep-copied)."""
    x, y, x_val, y_val = digits
    validation = dict(validation)
    data = (x_val, y_val)
    if validation.pop("dataset"):
        data = tf.data.Dataset.from_tensor_slices(data).batch(BATCH)
    periodic = kf.callbacks.PeriodicValidation(data, batch_size=BATCH, **validation)
    tuner = _search(
        kf.OptimizedModel,
        tmp_path,
        {"data": (x, y), "callbacks": [periodic]},
        steps_per_execution="auto",
    )
    _assert_same_trials(tuner, keras_search)
    assert periodic.history == []  # the trials ran KerasTuner's copies


def test_periodic_validation_deep_copy_shares_the_data_only():
    """A deep copy shares the validation sets and copies the rest (driven callbacks, history)."""
    x_val = np.zeros((4, 3), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x_val, np.zeros(4))).batch(2)
    stopping = keras.callbacks.EarlyStopping(patience=2)
    periodic = kf.callbacks.PeriodicValidation(
        {"easy": dataset, "hard": (x_val, np.ones(4))}, every_n_steps=3, callbacks=[stopping]
    )
    periodic.history.append({"step": 3})
    copied = copy.deepcopy(periodic)
    assert copied.validation_data["easy"] is dataset
    assert copied._sets["hard"][0] is x_val
    assert copied.callbacks[0] is not stopping and copied.callbacks[0].patience == 2
    assert copied.history == [{"step": 3}] and copied.history is not periodic.history
    assert copied.every_n_steps == 3


def test_keras_tuner_compile_override_drops_compile_options(digits, tmp_path):
    """Tuner-level `metrics=` (or `optimizer=`, `loss=`) makes KerasTuner compile each model
    again with only optimizer, loss and metrics: options given to `compile` in the hypermodel
    are dropped, ours (`log_metrics`) as Keras' own (`steps_per_execution`). Pinned so that
    docs/guide.md's advice (compile in the hypermodel) stays true."""
    x, y, x_val, y_val = digits
    search = {"data": (x[:256], y[:256]), "validation_data": (x_val, y_val)}
    options = {"log_metrics": ["grad_norm"], "steps_per_execution": 4}
    one_trial = {"max_trials": 1}
    kept = _search(kf.OptimizedModel, tmp_path / "kept", dict(search), one_trial, **options)
    dropped = _search(
        kf.OptimizedModel,
        tmp_path / "dropped",
        dict(search),
        {**one_trial, "metrics": ["accuracy"]},
        **options,
    )
    for trial in kept.oracle.trials.values():
        assert "grad_norm" in trial.metrics.metrics
    for trial in dropped.oracle.trials.values():
        assert "grad_norm" not in trial.metrics.metrics
    rebuilt = dropped._try_build(dropped.oracle.get_best_trials(1)[0].hyperparameters)
    assert rebuilt.get_compile_config()["steps_per_execution"] == 1
    assert "log_metrics" not in rebuilt.get_compile_config()


@pytest.mark.slow
def test_keras_tuner_hyperband_continues_trials_as_keras_model(digits, tmp_path):
    """Hyperband trains a promoted trial on from the checkpoint of an earlier one
    (`load_weights`, then `fit(initial_epoch=...)`): the same brackets and scores as with
    `keras.Model`."""
    x, y, x_val, y_val = digits

    def hyperband(model_class, **options):
        tuner = keras_tuner.Hyperband(
            _hypermodel(model_class, **options),
            objective="val_loss",
            max_epochs=3,
            factor=3,
            hyperband_iterations=1,
            seed=1,
            directory=str(tmp_path),
            project_name=model_class.__name__,
        )
        tuner.search(x, y, batch_size=BATCH, verbose=0, validation_data=(x_val, y_val))
        return tuner

    expected = hyperband(keras.Model)
    got = hyperband(kf.OptimizedModel, micro_batch_size=32, steps_per_execution="auto")
    assert any("tuner/trial_id" in hp for hp, _ in _trials(got))  # a trial continued
    assert [hp for hp, _ in _trials(got)] == [hp for hp, _ in _trials(expected)]
    np.testing.assert_allclose(
        [s for _, s in _trials(got)], [s for _, s in _trials(expected)], rtol=1e-6
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_keras_tuner_distribution_strategy_scores_equal_keras_model(
    digits, tmp_path, mirrored_strategy
):
    """`distribution_strategy=` (two replicas): KerasTuner builds and reloads each model in the
    strategy's scope; the scores and the reloaded best model are `keras.Model`'s."""
    x, y, x_val, y_val = digits
    search = {"data": (x, y), "validation_data": (x_val, y_val)}
    tuner_kwargs = {"distribution_strategy": mirrored_strategy}
    expected = _search(keras.Model, tmp_path, dict(search), tuner_kwargs)
    got = _search(
        kf.OptimizedModel,
        tmp_path,
        dict(search),
        tuner_kwargs,
        gradient_clipping=NEVER_CLIPS,
        micro_batch_size=16,
    )
    _assert_same_trials(got, expected)
    best = got.get_best_models(1)[0]
    assert isinstance(best, kf.OptimizedModel)
    for a, b in zip(best.get_weights(), expected.get_best_models(1)[0].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- Optuna --------------------------------------------------------------------------------


class PruneOnValidation(keras.callbacks.Callback):
    """Reports `val_loss` to the trial at each `on_epoch_end` (of `fit`, or of a
    `PeriodicValidation` round) and raises `optuna.TrialPruned` when the pruner says so."""

    def __init__(self, trial):
        super().__init__()
        self.trial = trial
        self.reports = 0

    def on_epoch_end(self, epoch, logs=None):
        self.trial.report(float(logs["val_loss"]), self.reports)
        self.reports += 1
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"val_loss {logs['val_loss']:.4f} at report {self.reports}")


def _study(model_class, digits, **options):
    x, y, x_val, y_val = digits
    models = []

    def objective(trial):
        model = _build(model_class, trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True))
        models.append(model)
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            validation_data=(x_val, y_val),
            verbose=0,
            callbacks=[PruneOnValidation(trial)],
        )
        return history.history["val_loss"][-1]

    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    study.optimize(objective, n_trials=4)
    trials = [
        (trial.state, trial.params, trial.value, trial.intermediate_values)
        for trial in study.trials
    ]
    return trials, models


def test_optuna_study_values_equal_keras_model(digits):
    """TPE + median pruning: the same suggestions, values, reports and pruned trials; no `fit`
    of an `OptimizedModel` is left running after a `TrialPruned` escaped it."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    expected, _ = _study(keras.Model, digits)
    got, models = _study(
        kf.OptimizedModel,
        digits,
        steps_per_execution="auto",
        gradient_clipping=NEVER_CLIPS,
        micro_batch_size=32,
    )
    states = [state for state, *_ in got]
    assert states == [state for state, *_ in expected]
    assert optuna.trial.TrialState.PRUNED in states and optuna.trial.TrialState.COMPLETE in states
    assert [params for _, params, *_ in got] == [params for _, params, *_ in expected]
    for (_, _, value, reports), (_, _, ref_value, ref_reports) in zip(got, expected):
        np.testing.assert_allclose(value, ref_value, rtol=1e-6)
        assert list(reports) == list(ref_reports)
        np.testing.assert_allclose(list(reports.values()), list(ref_reports.values()), rtol=1e-6)
    assert all(_fit_run.current_run(model) is None for model in models)


def _pruned_then_trained(model_class, digits, ema, **options):
    """A trial pruned at the first mid-epoch validation (step 5), then the same model trained
    one more epoch, as a user who keeps the pruned model would."""
    x, y, x_val, y_val = digits
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=1.0))
    trial = study.ask()
    model = _build(model_class, 3e-3, use_ema=ema, **options)
    periodic = kf.callbacks.PeriodicValidation(
        (x_val, y_val),
        every_n_steps=5,
        batch_size=BATCH,
        callbacks=[PruneOnValidation(trial)],
        ema=ema,
    )
    with pytest.raises(optuna.TrialPruned, match="at report 1"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[periodic])
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    pruned_at = int(model.optimizer.iterations)
    weights_at_prune = model.get_weights()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x_val, y_val)
    ).history
    return model, pruned_at, weights_at_prune, history, model.get_weights()


@pytest.mark.parametrize("ema", [False, True], ids=["raw", "ema"])
def test_trial_pruned_mid_epoch_leaves_the_model_usable(digits, ema):
    """`TrialPruned` raised from a callback driven by `PeriodicValidation` in the middle of an
    `"auto"` execution: training stops after step 5 with the raw weights in place (`ema=True`
    swaps them back), no run of ours is left, and a later `fit` of the same model gives
    `keras.Model`'s logs and weights."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    expected = _pruned_then_trained(keras.Model, digits, ema)
    model, *got = _pruned_then_trained(
        kf.OptimizedModel, digits, ema, steps_per_execution="auto", micro_batch_size=32
    )
    assert got[0] == expected[1] == 5
    for a, b in zip(got[1], expected[2]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert _fit_run.current_run(model) is None
    assert list(got[2]) == list(expected[3])
    for key in expected[3]:
        np.testing.assert_allclose(got[2][key], expected[3][key], rtol=1e-6)
    for a, b in zip(got[3], expected[4]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_trial_pruned_after_a_skipped_step_is_not_reported_as_the_next_fits(digits):
    """A step skipped for a non-finite loss, then `TrialPruned` before the epoch end (where
    skips are reported): the next `fit` of the model says the skip once, before its epochs,
    as an earlier fit's, not as a skip of its own first epoch (its data are finite)."""
    x, y = digits[0][: 4 * BATCH], digits[1][: 4 * BATCH]  # an epoch of 4 batches
    poisoned = x.copy()
    poisoned[BATCH] = np.nan  # batch 1: a non-finite loss, the step is skipped

    class PruneAtBatch3(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:  # the epoch's last batch, before its end
                raise optuna.TrialPruned("pruned at batch 3")

    model = _build(kf.OptimizedModel, 1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(optuna.TrialPruned):
            model.fit(
                poisoned, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[PruneAtBatch3()]
            )
        assert int(model.skipped_steps) == 1
        assert not [w for w in caught if issubclass(w.category, kf.FastloopWarning)]
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if issubclass(w.category, kf.FastloopWarning)]
    assert len(said) == 1, said
    assert "at optimizer step 1," in said[0] and "an earlier fit" in said[0]
    assert "in epoch 1" not in said[0]
    assert int(model.skipped_steps) == 1


def test_fit_resumed_by_backup_after_an_exception_reports_a_skip_once(digits, tmp_path):
    """The counterpart: a `fit` ended by an exception and resumed in the same process by
    `BackupAndRestore(save_freq=3)` continues the interrupted epoch, step state included; its
    skip (before the backup) is said once, as a skip of that epoch."""
    x, y = digits[0][: 8 * BATCH], digits[1][: 8 * BATCH]
    poisoned = x.copy()
    poisoned[BATCH] = np.nan

    class FailAtBatch5(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise optuna.TrialPruned("pruned at batch 5")

    model = _build(kf.OptimizedModel, 1e-3)
    backup = str(tmp_path / "backup")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(optuna.TrialPruned):
            model.fit(
                poisoned,
                y,
                batch_size=BATCH,
                shuffle=False,
                verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3), FailAtBatch5()],
            )
        model.fit(
            poisoned,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3)],
        )
    said = [str(w.message) for w in caught if issubclass(w.category, kf.FastloopWarning)]
    assert len(said) == 1, said
    assert "in epoch 1 " in said[0] and "at optimizer step 1," in said[0]
    assert int(model.skipped_steps) == 1 and int(model.optimizer.iterations) == 7
