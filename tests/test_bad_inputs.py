"""Malformed configurations and inputs: each must fail early with a clear Keras-style message.

Every entry of `BAD_INPUTS` is `(id, call, exception type, message regex)`. The call fails at
construction or in `compile()` (before any training step), and the message says what must hold
and ends with `Received: ...`. The regex is the message it gets (abridged):

======================  ==========  =============================================================
id                      raises      message
======================  ==========  =============================================================
clip_unknown_id         ValueError  Unknown `gradient_clipping` id. Expected one of [...]
clip_bool               TypeError   `gradient_clipping` must be None, a positive float ...
clip_zero               ValueError  names gradient_clipping=0.0 (what the user passed)
clip_negative           ValueError  `clipnorm` must be a positive, finite number
clip_inf (fixed)        ValueError  `clipnorm` must be a positive, finite number
clip_by_norm_nan        ValueError  `clipnorm` must be a positive, finite number
clip_by_value_zero      ValueError  `clipvalue` must be a positive, finite number
agc_factor_zero         ValueError  `clip_factor` must be a positive, finite number
agc_eps_negative        ValueError  `eps` must be a positive, finite number
autoclip_percentile_0   ValueError  `percentile` must be a number in (0, 100]
autoclip_percentile_101 ValueError  `percentile` must be a number in (0, 100]
autoclip_history_0      ValueError  `history_size` must be a positive integer
autoclip_history_float  ValueError  `history_size` must be a positive integer
clip_twice_clipnorm     ValueError  Gradient clipping is set twice: on the optimizer (clipnorm=1.0)
clip_twice_global       ValueError  Gradient clipping is set twice ... (global_clipnorm=1.0)
clip_twice_clipvalue    ValueError  Gradient clipping is set twice ... (clipvalue=0.5)
weighting_unknown_id    ValueError  Unknown `loss_weighting` id. Expected one of [...]
weighting_wrong_type    TypeError   `loss_weighting` must be None, a method id string or ...
weighting_single_task   ValueError  Loss weighting 'uw' needs a model with at least two outputs
weighting_single_dwa    ValueError  Loss weighting 'dwa' needs a model with at least two outputs
loss_unknown_output     ValueError  `loss` names outputs the model does not have
loss_list_length        ValueError  `loss` must have one entry per output
loss_none_weighting     ValueError  `loss_weighting` needs the per-task losses of a compiled `loss`
loss_weights_unknown    ValueError  `loss_weights` names outputs the model does not have
loss_weights_length     ValueError  `loss_weights` must have one entry per output
loss_weights_negative   ValueError  Every entry of `loss_weights` must be a finite, non-negative number
loss_weights_string     ValueError  Every entry of `loss_weights` must be a finite, non-negative number
loss_weights_float_2out ValueError  A single float `loss_weights` is only valid for a single-...
gradient_weighting_mb   ValueError  Gradient-based loss weighting cannot be combined with ...
uw_initial_string       ValueError  `initial_log_variance` must be a finite float
dwa_temperature_zero    ValueError  `temperature` must be a finite positive number
nonfinite_unknown       ValueError  `nonfinite` must be one of ('skip', 'raise', 'terminate')
micro_batch_zero        ValueError  `micro_batch_size` must be None or a positive integer
micro_batch_negative    ValueError  `micro_batch_size` must be None or a positive integer
micro_batch_float       ValueError  `micro_batch_size` must be None or a positive integer
micro_batch_bool        ValueError  `micro_batch_size` must be None or a positive integer
spe_zero                ValueError  `steps_per_execution` must be "auto" or a positive integer
spe_negative            ValueError  `steps_per_execution` must be "auto" or a positive integer
bucket_empty            ValueError  `bucket_boundaries` must be a non-empty list of positive ints
bucket_unsorted         ValueError  `bucket_boundaries` must be sorted in strictly increasing ...
bucket_duplicate        ValueError  `bucket_boundaries` must be sorted in strictly increasing ...
bucket_non_positive     ValueError  `bucket_boundaries` must contain only positive integers
bucket_float            ValueError  `bucket_boundaries` must contain only integers
bucket_both_batchings   ValueError  Exactly one of `batch_size` and `tokens_per_batch` ...
bucket_no_batching      ValueError  Exactly one of `batch_size` and `tokens_per_batch` ...
bucket_on_overflow      ValueError  `on_overflow` must be "extend" or "error"
bucket_num_buckets_0    ValueError  `num_buckets` must be a positive integer
pv_both_frequencies     ValueError  Exactly one of `every_n_steps` and `every_n_epochs` must be set
pv_no_frequency         ValueError  Exactly one of `every_n_steps` and `every_n_epochs` must be set
pv_steps_zero           ValueError  `every_n_steps` must be None or an integer > 0
pv_epochs_negative      ValueError  `every_n_epochs` must be None or an integer > 0
pv_validation_steps_0   ValueError  `validation_steps` must be None or an integer > 0
pv_no_data              ValueError  `validation_data` must be a dataset or a tuple
pv_string_data (fixed)  ValueError  `validation_data` must be a dataset or a tuple
pv_bad_callback         ValueError  `callbacks` must be a list of other `keras.callbacks.Callback`
pv_empty_backup_dir     ValueError  `backup_dir` must be None or a non-empty path
sched_decay_steps_0     ValueError  `first_decay_steps` must be an integer > 0
sched_warmup_negative   ValueError  `warmup_steps` must be an integer >= 0
sched_t_mul_below_1     ValueError  `t_mul` must be a finite number >= 1
sched_m_mul_negative    ValueError  `m_mul` must be a finite number >= 0
sched_alpha_above_1     ValueError  `alpha` must be a number in [0, 1]
sched_target_inf        ValueError  `warmup_target` must be a finite number >= 0
sched_decreasing_warmup ValueError  `warmup_target` must be >= `initial_learning_rate`
sched_accumulation_0    ValueError  `gradient_accumulation_steps` must be None or an integer >= 1
======================  ==========  =============================================================

Fixed since the first version of this file (`test_former_gaps_raise_before_training`):
`loss_weights` with NaN, an unknown loss id (now rejected at `compile`), and
`UncertaintyWeighting(initial_log_variance=nan)`. A `micro_batch_size` larger than the
batch is not an error but a warning, once (the step runs the batch as one micro-batch: exact,
but no memory is saved; `test_micro_batch_larger_than_batch_warns_once`). A
`micro_batch_size` that does not divide the batch is *not* an error: the last micro-batch is
smaller and count-weighted, which micro_batching.py documents as exact.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras_fastloop as kf
from keras_fastloop.data import bucket_by_length

LOSSES = {"a": "mse", "b": "mse"}


def one_output():
    inputs = keras.Input((4,))
    return kf.OptimizedModel(inputs, keras.layers.Dense(1, name="out")(inputs))


def two_outputs():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3)(inputs)
    return kf.OptimizedModel(
        inputs,
        {
            "a": keras.layers.Dense(1, name="a")(hidden),
            "b": keras.layers.Dense(1, name="b")(hidden),
        },
    )


def sequences():
    return tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [1, 2], [1, 2, 3]]))


def schedule(**overrides):
    arguments = dict(
        initial_learning_rate=0.0, warmup_target=1e-3, warmup_steps=10, first_decay_steps=100
    )
    return kf.schedules.WarmupCosineDecayRestarts(**{**arguments, **overrides})


def validation(**overrides):
    arguments = dict(validation_data=(np.zeros((2, 4)), np.zeros((2, 1))), every_n_steps=5)
    return kf.callbacks.PeriodicValidation(**{**arguments, **overrides})


def compile_one(**kwargs):
    kwargs.setdefault("optimizer", "sgd")
    kwargs.setdefault("loss", "mse")
    one_output().compile(**kwargs)


def compile_two(**kwargs):
    kwargs.setdefault("optimizer", "sgd")
    kwargs.setdefault("loss", LOSSES)
    two_outputs().compile(**kwargs)


clipping = kf.clipping
POSITIVE = r"must be a positive, finite number\. Received: "
CLIP_TYPE = r"`gradient_clipping` must be None, a positive float .*Received: gradient_clipping="
TWICE = r"Gradient clipping is set twice: on the optimizer \({}=.*Received: gradient_clipping="
MB = r"`micro_batch_size` must be None or a positive integer\. Received: micro_batch_size="
SPE = r'`steps_per_execution` must be "auto" or a positive integer\. Received: '
BOUNDS = r"`bucket_boundaries` must "
EXACTLY_ONE_BATCHING = (
    r"Exactly one of `batch_size` and `tokens_per_batch` must be given\. Received"
)
FREQUENCY = r"Exactly one of `every_n_steps` and `every_n_epochs` must be set\. Received"

BAD_INPUTS = [
    (
        "clip_unknown_id",
        lambda: compile_one(gradient_clipping="hard_clip"),
        ValueError,
        r"Unknown `gradient_clipping` id\. .*Received: gradient_clipping='hard_clip'",
    ),
    ("clip_bool", lambda: compile_one(gradient_clipping=True), TypeError, CLIP_TYPE),
    (
        "clip_zero",
        lambda: compile_one(gradient_clipping=0.0),
        ValueError,
        "Received: gradient_clipping=0.0",
    ),
    ("clip_negative", lambda: clipping.ClipByGlobalNorm(-1), ValueError, "`clipnorm` " + POSITIVE),
    ("clip_inf", lambda: clipping.ClipByGlobalNorm(float("inf")), ValueError, POSITIVE),
    ("clip_by_norm_nan", lambda: clipping.ClipByNorm(float("nan")), ValueError, POSITIVE),
    ("clip_by_value_zero", lambda: clipping.ClipByValue(0), ValueError, "`clipvalue` " + POSITIVE),
    (
        "agc_factor_zero",
        lambda: clipping.AdaptiveGradientClipping(clip_factor=0.0),
        ValueError,
        "`clip_factor` " + POSITIVE,
    ),
    (
        "agc_eps_negative",
        lambda: clipping.AdaptiveGradientClipping(eps=-1e-3),
        ValueError,
        "`eps` " + POSITIVE,
    ),
    (
        "autoclip_percentile_0",
        lambda: clipping.AutoClip(percentile=0),
        ValueError,
        r"`percentile` must be a number in \(0, 100\]\. Received: percentile=0",
    ),
    (
        "autoclip_percentile_101",
        lambda: clipping.AutoClip(percentile=101),
        ValueError,
        r"`percentile` must be a number in \(0, 100\]\. Received: percentile=101",
    ),
    (
        "autoclip_history_0",
        lambda: clipping.AutoClip(history_size=0),
        ValueError,
        r"`history_size` must be a positive integer\. Received: history_size=0",
    ),
    (
        "autoclip_history_float",
        lambda: clipping.AutoClip(history_size=2.5),
        ValueError,
        r"`history_size` must be a positive integer\. Received: history_size=2.5",
    ),
    (
        "clip_twice_clipnorm",
        lambda: compile_one(optimizer=keras.optimizers.SGD(clipnorm=1.0), gradient_clipping=1.0),
        ValueError,
        TWICE.format("clipnorm"),
    ),
    (
        "clip_twice_global",
        lambda: compile_one(
            optimizer=keras.optimizers.Adam(global_clipnorm=1.0),
            gradient_clipping=clipping.AutoClip(),
        ),
        ValueError,
        TWICE.format("global_clipnorm"),
    ),
    (
        "clip_twice_clipvalue",
        lambda: compile_one(
            optimizer=keras.optimizers.SGD(clipvalue=0.5),
            gradient_clipping=clipping.ClipByValue(1.0),
        ),
        ValueError,
        TWICE.format("clipvalue"),
    ),
    (
        "weighting_unknown_id",
        lambda: compile_two(loss_weighting="uncertainty"),
        ValueError,
        r"Unknown `loss_weighting` id\. Expected one of \[.*Received: loss_weighting='uncertainty'",
    ),
    (
        "weighting_wrong_type",
        lambda: compile_two(loss_weighting=3),
        TypeError,
        r"`loss_weighting` must be None, a method id string .*Received: loss_weighting=3",
    ),
    (
        "weighting_single_task",
        lambda: compile_one(loss_weighting="uw"),
        ValueError,
        r"Loss weighting 'uw' needs a model with at least two outputs .*Received: 1 task",
    ),
    (
        "weighting_single_dwa",
        lambda: compile_one(loss_weighting="dwa"),
        ValueError,
        r"Loss weighting 'dwa' needs a model with at least two outputs .*Received: 1 task",
    ),
    (
        "loss_unknown_output",
        lambda: compile_two(loss={"a": "mse", "c": "mse"}, loss_weighting="uw"),
        ValueError,
        r"`loss` names outputs the model does not have: \['c'\]\. The model's outputs are "
        r"\['a', 'b'\]\. Received: loss=",
    ),
    (
        "loss_list_length",
        lambda: compile_two(loss=["mse"]),
        ValueError,
        r"`loss` must have one entry per output \(2: \['a', 'b'\]\)\. Received: loss=",
    ),
    (
        "loss_none_weighting",
        lambda: one_output().compile("sgd", None, loss_weighting="ew"),
        ValueError,
        r"`loss_weighting` needs the per-task losses of a compiled `loss`\. Received: loss=None",
    ),
    (
        "loss_weights_unknown",
        lambda: compile_two(loss_weights={"a": 1.0, "c": 1.0}, loss_weighting="static"),
        ValueError,
        r"`loss_weights` names outputs the model does not have: .*Received: loss_weights=",
    ),
    (
        "loss_weights_length",
        lambda: compile_two(loss_weights=[1.0], loss_weighting="ew"),
        ValueError,
        r"`loss_weights` must have one entry per output .*Received: loss_weights=\[1.0\]",
    ),
    (
        "loss_weights_negative",
        lambda: compile_two(loss_weights={"a": -1.0, "b": 1.0}),
        ValueError,
        r"Every entry of `loss_weights` must be a finite, non-negative number\. Received: loss_weights=",
    ),
    (
        "loss_weights_string",
        lambda: compile_two(loss_weights={"a": "x", "b": 1.0}),
        ValueError,
        r"Every entry of `loss_weights` must be a finite, non-negative number\. Received: loss_weights=",
    ),
    (
        "loss_weights_float_2out",
        lambda: compile_two(loss_weights=0.5),
        ValueError,
        r"A single float `loss_weights` is only valid for a single-output model\. Received: ",
    ),
    (
        "gradient_weighting_mb",
        lambda: compile_two(loss_weighting="pcgrad", micro_batch_size=2),
        ValueError,
        r"Gradient-based loss weighting cannot be combined with `micro_batch_size` .*Received: ",
    ),
    (
        "uw_initial_string",
        lambda: kf.weighting.UncertaintyWeighting(initial_log_variance="x"),
        ValueError,
        r"`initial_log_variance` must be a finite float\. Received: initial_log_variance='x'",
    ),
    (
        "dwa_temperature_zero",
        lambda: kf.weighting.DWA(temperature=0),
        ValueError,
        r"`temperature` must be a finite positive number\. Received: temperature=0",
    ),
    (
        "nonfinite_unknown",
        lambda: compile_one(nonfinite="ignore"),
        ValueError,
        r"`nonfinite` must be one of \('skip', 'raise', 'terminate'\)\. Received: nonfinite=",
    ),
    ("micro_batch_zero", lambda: compile_one(micro_batch_size=0), ValueError, MB + "0"),
    ("micro_batch_negative", lambda: compile_one(micro_batch_size=-4), ValueError, MB + "-4"),
    ("micro_batch_float", lambda: compile_one(micro_batch_size=2.5), ValueError, MB + "2.5"),
    ("micro_batch_bool", lambda: compile_one(micro_batch_size=True), ValueError, MB + "True"),
    ("spe_zero", lambda: compile_one(steps_per_execution=0), ValueError, SPE),
    ("spe_negative", lambda: compile_one(steps_per_execution=-2), ValueError, SPE),
    (
        "bucket_empty",
        lambda: bucket_by_length(sequences(), [], batch_size=2),
        ValueError,
        BOUNDS + r"be a non-empty list of positive integers\. Received: bucket_boundaries=\[\]",
    ),
    (
        "bucket_unsorted",
        lambda: bucket_by_length(sequences(), [8, 4], batch_size=2),
        ValueError,
        BOUNDS + r"be sorted in strictly increasing order .*Received: bucket_boundaries=\[8, 4\]",
    ),
    (
        "bucket_duplicate",
        lambda: bucket_by_length(sequences(), [4, 4], batch_size=2),
        ValueError,
        BOUNDS + r"be sorted in strictly increasing order .*Received: bucket_boundaries=\[4, 4\]",
    ),
    (
        "bucket_non_positive",
        lambda: bucket_by_length(sequences(), [0, 4], batch_size=2),
        ValueError,
        BOUNDS + r"contain only positive integers\. Received: ",
    ),
    (
        "bucket_float",
        lambda: bucket_by_length(sequences(), [2.5, 4], batch_size=2),
        ValueError,
        BOUNDS + r"contain only integers\. Received: ",
    ),
    (
        "bucket_both_batchings",
        lambda: bucket_by_length(sequences(), [4], batch_size=2, tokens_per_batch=8),
        ValueError,
        EXACTLY_ONE_BATCHING,
    ),
    (
        "bucket_no_batching",
        lambda: bucket_by_length(sequences(), [4]),
        ValueError,
        EXACTLY_ONE_BATCHING,
    ),
    (
        "bucket_on_overflow",
        lambda: bucket_by_length(sequences(), [4], batch_size=2, on_overflow="drop"),
        ValueError,
        r'`on_overflow` must be "extend" or "error"\. Received: on_overflow=',
    ),
    (
        "bucket_num_buckets_0",
        lambda: bucket_by_length(sequences(), batch_size=2, num_buckets=0),
        ValueError,
        r"`num_buckets` must be a positive integer\. Received: num_buckets=0",
    ),
    (
        "pv_both_frequencies",
        lambda: validation(every_n_epochs=1),
        ValueError,
        FREQUENCY,
    ),
    ("pv_no_frequency", lambda: validation(every_n_steps=None), ValueError, FREQUENCY),
    (
        "pv_steps_zero",
        lambda: validation(every_n_steps=0),
        ValueError,
        r"`every_n_steps` must be None or an integer > 0\. Received: every_n_steps=0",
    ),
    (
        "pv_epochs_negative",
        lambda: validation(every_n_steps=None, every_n_epochs=-1),
        ValueError,
        r"`every_n_epochs` must be None or an integer > 0\. Received: every_n_epochs=-1",
    ),
    (
        "pv_validation_steps_0",
        lambda: validation(validation_steps=0),
        ValueError,
        r"`validation_steps` must be None or an integer > 0\. Received: validation_steps=0",
    ),
    (
        "pv_no_data",
        lambda: validation(validation_data=None),
        ValueError,
        r"`validation_data` must be a dataset or a tuple .*Received: validation_data=None",
    ),
    (
        "pv_string_data",
        lambda: validation(validation_data="val.csv"),
        ValueError,
        r"`validation_data` must be a dataset or a tuple .*Received: validation_data='val.csv'",
    ),
    (
        "pv_bad_callback",
        lambda: validation(callbacks=["early_stopping"]),
        ValueError,
        r"`callbacks` must be a list of other `keras.callbacks.Callback` .*Received: callbacks=",
    ),
    (
        "pv_empty_backup_dir",
        lambda: validation(backup_dir=""),
        ValueError,
        r"`backup_dir` must be None or a non-empty path .*Received: backup_dir=''",
    ),
    (
        "sched_decay_steps_0",
        lambda: schedule(first_decay_steps=0),
        ValueError,
        r"`first_decay_steps` must be an integer > 0\. Received: first_decay_steps=0",
    ),
    (
        "sched_warmup_negative",
        lambda: schedule(warmup_steps=-1),
        ValueError,
        r"`warmup_steps` must be an integer >= 0\. Received: warmup_steps=-1",
    ),
    (
        "sched_t_mul_below_1",
        lambda: schedule(t_mul=0.5),
        ValueError,
        r"`t_mul` must be a finite number >= 1\. Received: t_mul=0.5",
    ),
    (
        "sched_m_mul_negative",
        lambda: schedule(m_mul=-0.1),
        ValueError,
        r"`m_mul` must be a finite number >= 0\. Received: m_mul=-0.1",
    ),
    (
        "sched_alpha_above_1",
        lambda: schedule(alpha=1.5),
        ValueError,
        r"`alpha` must be a number in \[0, 1\]\. Received: alpha=1.5",
    ),
    (
        "sched_target_inf",
        lambda: schedule(warmup_target=float("inf")),
        ValueError,
        r"`warmup_target` must be None or a finite number >= 0\. Received: warmup_target=inf",
    ),
    (
        "sched_decreasing_warmup",
        lambda: schedule(initial_learning_rate=1e-2),
        ValueError,
        r"`warmup_target` must be >= `initial_learning_rate` .*Received: initial_learning_rate=",
    ),
    (
        "sched_accumulation_0",
        lambda: schedule(gradient_accumulation_steps=0),
        ValueError,
        r"`gradient_accumulation_steps` must be None or an integer >= 1\. Received: ",
    ),
]


def test_at_least_thirty_bad_inputs_with_unique_ids():
    ids = [entry[0] for entry in BAD_INPUTS]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    "call, error, message", [entry[1:] for entry in BAD_INPUTS], ids=[e[0] for e in BAD_INPUTS]
)
def test_bad_input_raises_clear_error(call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    assert type(info.value) is error
    assert "Received" in str(info.value)


def _compile_nan_loss_weight():
    compile_two(loss_weights={"a": float("nan"), "b": 1.0})


def _compile_unknown_loss_id():
    compile_two(loss={"a": "mean_squared_eror", "b": "mse"})


def _uw_nan_initial_log_variance():
    kf.weighting.UncertaintyWeighting(initial_log_variance=float("nan"))


def _fit_with_warnings(samples, micro_batch_size, batch_size=4, epochs=2):
    model = one_output()
    model.compile(keras.optimizers.SGD(0.1), "mse", micro_batch_size=micro_batch_size)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 4)).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    model.set_weights([np.full((4, 1), 0.5, "float32"), np.zeros((1,), "float32")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if "micro_batch_size" in str(w.message)]
    return messages, model.get_weights()


@pytest.mark.parametrize(
    "samples", [8, 10], ids=["static_batch_size", "batch_size_known_only_at_run_time"]
)
def test_micro_batch_larger_than_batch_warns_once(samples):
    """Not an error: the batch runs as one micro-batch (exact), but no memory is saved.

    With 8 samples and `batch_size=4` every batch's size is static: the warning comes when the
    step is traced. With 10 the last batch is smaller, the batch dimension is unknown while
    tracing, and the warning comes at the end of the first epoch.
    """
    messages, weights = _fit_with_warnings(samples, micro_batch_size=8)
    assert len(messages) == 1, messages
    assert "fewer samples (4) than `micro_batch_size` (8)" in messages[0]
    assert "Received: micro_batch_size=8" in messages[0]
    _, reference = _fit_with_warnings(samples, micro_batch_size=None)
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_smaller_last_batch_does_not_warn():
    """10 samples, batch 4, micro-batches of 3: the last batch (2 samples) is routine."""
    messages, _ = _fit_with_warnings(10, micro_batch_size=3)
    assert messages == []


def test_micro_batch_not_dividing_the_batch_is_allowed():
    """Not an error by design: the last micro-batch is smaller and count-weighted (exact)."""
    model = one_output()
    model.compile("sgd", "mse", micro_batch_size=3)
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2


# ------------------------------------------------------------------------ property-based test

CLIPPING = st.sampled_from(
    [
        lambda: None,
        lambda: 1.0,
        lambda: 0.0,
        lambda: -1.0,
        lambda: "autoclip",
        lambda: True,
        lambda: clipping.ClipByNorm(0.5),
        lambda: clipping.AutoClip(50.0, history_size=4),
        lambda: clipping.AdaptiveGradientClipping(),
    ]
)
WEIGHTING = st.sampled_from([None, "ew", "uw", "dwa", "rlw", "pcgrad", "unknown", 3])
MICRO = st.sampled_from([None, 1, 2, 4, 0, -1, 2.5, True])
NONFINITE = st.sampled_from(["skip", "raise", "terminate", "bogus"])
SPE = st.sampled_from([1, 2, 0, -1])
WEIGHTS = st.sampled_from(
    [None, {"a": 1.0, "b": 0.5}, {"a": -1.0, "b": 1.0}, [1.0], 0.5, {"a": 1.0, "zzz": 1.0}]
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    two=st.booleans(),
    clip=CLIPPING,
    weighting=WEIGHTING,
    micro=MICRO,
    nonfinite=NONFINITE,
    spe=SPE,
    loss_weights=WEIGHTS,
)
@pytest.mark.slow  # a property-based sweep: the slow job
def test_config_space_fails_only_with_clear_errors(
    two, clip, weighting, micro, nonfinite, spe, loss_weights
):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = two_outputs() if two else one_output()
    loss = LOSSES if two else "mse"
    if not two and isinstance(loss_weights, dict):
        loss_weights = {"out": 1.0}
    try:
        model.compile(
            "adam",
            loss,
            loss_weights=loss_weights,
            steps_per_execution=spe,
            gradient_clipping=clip(),
            loss_weighting=weighting,
            micro_batch_size=micro,
            nonfinite=nonfinite,
        )
    except (ValueError, TypeError) as error:
        assert "Received" in str(error), repr(error)
        return
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = {"a": x[:, :1], "b": x[:, 1:2]} if two else x[:, :1]
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    for weight in model.weights:
        assert np.all(np.isfinite(weight.numpy())), weight.path


@pytest.mark.parametrize(
    "call, message",
    [
        (_compile_nan_loss_weight, r"loss_weights.*finite.*Received"),
        (_compile_unknown_loss_id, r"Unknown loss identifier.*Received: loss='mean_squared_eror'"),
        (_uw_nan_initial_log_variance, r"initial_log_variance.*finite.*Received"),
    ],
    ids=["compile_nan_loss_weight", "compile_unknown_loss_id", "uw_nan_initial_log_variance"],
)
def test_former_gaps_raise_before_training(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------- a refused compile leaves the compiled model as it was (review)

REFUSED_RECOMPILES = {
    "uw_on_one_output": dict(loss_weighting="uw"),
    "log_metrics_unknown": dict(log_metrics=["grad"]),
    "log_metrics_not_a_list": dict(log_metrics=5),
    "log_metrics_twice": dict(log_metrics=["grad_norm", "grad_norm"]),
    "shared_variables_without_gradient_method": dict(shared_variables=[1, "not a variable"]),
    "shared_variables_not_of_the_model": dict(
        loss_weighting="pcgrad", shared_variables=[keras.Variable(1.0)]
    ),
}


@pytest.mark.parametrize("bad", REFUSED_RECOMPILES.values(), ids=REFUSED_RECOMPILES)
def test_refused_recompile_keeps_optimizer_clipping_and_training(bad):
    """A compile that fails validation used to replace the optimizer (iterations back to 0)
    and the clipping before raising; the model must train on exactly as if never asked."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = x[:, :1] * 2.0
    runs = []
    for recompile in (False, True):
        keras.utils.set_random_seed(0)
        model = two_outputs() if "pcgrad" in str(bad) else one_output()
        loss = LOSSES if "pcgrad" in str(bad) else "mse"
        targets = {"a": y, "b": y} if "pcgrad" in str(bad) else y
        model.compile(keras.optimizers.SGD(0.1), loss, gradient_clipping=1.0)
        model.fit(x, targets, batch_size=4, verbose=0)
        if recompile:
            with pytest.raises(ValueError, match="Received"):
                model.compile(keras.optimizers.Adam(), loss, **bad)
            assert int(model.optimizer.iterations) == 4
            assert model.gradient_clipping is not None
        history = model.fit(x, targets, batch_size=4, verbose=0).history
        runs.append((history, model.get_weights()))
    (h_ref, w_ref), (h, w) = runs
    assert h == h_ref
    for a, b in zip(w_ref, w):
        np.testing.assert_array_equal(b, a)
