"""steps_per_execution="auto": the tuner on a fake clock, its glue into fit, the recommended setup."""

import inspect
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop import tuning
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation
from keras_fastloop.mixed_precision import HardwareInfo
from keras_fastloop.model import OptimizedModel
from keras_fastloop.tuning import StepsPerExecutionTuner
from keras_fastloop.tuning._glue import AUTO_MAX_SECONDS_PER_STEP


def drive(tuner, seconds_for, executions, limit=None):
    """Runs the tuner for `executions` executions; `seconds_for(k, i)` is the fake clock."""
    proposals = []
    for i in range(executions):
        k = tuner.propose(limit)
        proposals.append(k)
        tuner.observe(k, seconds_for(k, i))
    return proposals


# ------------------------------------------------------------------------------ state machine


def scripted(**kwargs):
    """A tuner for scripted timings: windows of one execution, no time bound, no warm-up."""
    return StepsPerExecutionTuner(window=1, min_window_seconds=0, warmup_executions=0, **kwargs)


def test_grows_while_it_pays_then_settles_at_the_cap():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, max_steps=16, window=2, min_window_seconds=0, overhead_tolerance=None
    )
    # Fixed 10 ms per execution overhead + 1 ms per step: larger k always pays by > 5%.
    proposals = drive(tuner, lambda k, i: 0.010 + 0.001 * k, 40)
    # the warm-up, then each candidate in turn with the best so far; a count's first execution
    # is dropped (the first call of a count may trace), the best's too (1 at 2, 3)
    assert proposals[:21] == [2] + [2, 1, 1, 2, 1] + [4, 4, 2, 4, 2] + [8, 8, 4, 8, 4] + [
        16,
        16,
        8,
        16,
        8,
    ]
    assert tuner.phase == "settled"
    assert tuner.steps == 16
    assert max(proposals) == 16


def test_the_cost_model_settles_where_the_overhead_share_is_within_tolerance():
    """T(k) = a + b k with a = 2**-8 s, b = 2**-10 s (exact in binary). 4 against 1 pays
    (rates 512 against 204.8 steps/s); the fitted a / T(k) <= 1/4 first at k = 3 a / b = 12."""
    a, b = 2.0**-8, 2.0**-10
    tuner = StepsPerExecutionTuner(
        window=1, min_window_seconds=0, warmup_executions=0, overhead_tolerance=0.25
    )
    proposals = drive(tuner, lambda k, i: a + b * k, 4)
    assert proposals == [4, 1, 12, 12]
    assert tuner.phase == "settled" and tuner.steps == 12
    assert tuner.history[:2] == [("probing", 4, pytest.approx(512.0)), ("settle", 12, "cost model")]
    assert tuner.best_rate is None  # 12 was not measured: its first window is the reference
    drive(tuner, lambda k, i: a + b * k, 1)
    assert tuner.reference_rate == pytest.approx(12 / (a + 12 * b))


def test_the_cost_model_keeps_an_execution_within_max_seconds():
    """The same costs; T(k) <= 10 * 2**-10 s holds up to k = 6."""
    a, b = 2.0**-8, 2.0**-10
    tuner = StepsPerExecutionTuner(
        window=1,
        min_window_seconds=0,
        warmup_executions=0,
        overhead_tolerance=0.25,
        max_seconds_per_execution=10 * b,
    )
    drive(tuner, lambda k, i: a + b * k, 2)
    assert tuner.phase == "settled" and tuner.steps == 6


def test_the_cost_model_takes_the_cap_when_time_does_not_grow_with_steps():
    tuner = StepsPerExecutionTuner(
        max_steps=32, window=1, min_window_seconds=0, warmup_executions=0
    )
    drive(tuner, lambda k, i: 0.01, 2)  # 4 steps take what 1 takes: b = 0
    assert ("settle", 32, "cost model") in tuner.history and tuner.steps == 32


def test_timings_beyond_the_float_range_do_not_break_the_cost_model():
    """Found by a review: the median of two executions of 1e308 s is inf, and the fitted
    per-step time NaN (`math.ceil(nan)` raised inside `fit`). Without a finite fit the
    candidate that paid becomes the best; executions that long stop the growth."""
    tuner = StepsPerExecutionTuner(window=2, min_window_seconds=0, warmup_executions=0)
    drive(tuner, lambda k, i: 1.5e308 if k == 4 else 1e308, 4)  # each pair: 4 pays 2.7x
    assert tuner.history[-1] == ("settle", 4, "max seconds")


def test_a_cap_at_the_first_count_settles_at_once():
    assert StepsPerExecutionTuner(initial=4, max_steps=4).phase == "settled"
    tuner = StepsPerExecutionTuner()
    tuner.set_horizon(1)  # e.g. an event after every step
    assert tuner.phase == "settled" and tuner.propose() == 1
    assert tuner.history == [("settle", 1, "cap")]


def test_a_count_the_cap_chose_is_revisited_when_the_cap_rises():
    """Found by a review: a first `fit` with one batch per epoch settled the tuner at 1 for
    every later `fit`."""
    tuner = StepsPerExecutionTuner(window=1, min_window_seconds=0, warmup_executions=0)
    tuner.set_horizon(1)
    tuner.set_horizon(None)  # the next fit: 50 batches per epoch
    assert tuner.phase == "probing" and (tuner.best_steps, tuner.steps) == (1, 4)
    # a cost model capped at 8 computes its count again for the new cap, without measuring
    a, b = 2.0**-8, 2.0**-10
    tuner = StepsPerExecutionTuner(
        window=1, min_window_seconds=0, warmup_executions=0, overhead_tolerance=0.25
    )
    tuner.set_horizon(8)
    drive(tuner, lambda k, i: a + b * k, 2)
    assert tuner.phase == "settled" and tuner.steps == 8  # the model wanted 12
    tuner.set_horizon(None)
    assert tuner.phase == "settled" and tuner.steps == 12
    assert tuner.history[-1] == ("settle", 12, "cost model")
    tuner.set_horizon(5)  # lower: capped as before, and raised again
    assert tuner.propose() == 5
    tuner.set_horizon(100)
    assert tuner.propose() == 12


def test_without_a_per_step_cost_the_count_still_respects_max_seconds():
    """Found by a review: 4 steps in 0.5 s, 1 step in 0.51 s settled at 64 (32 s executions).
    The candidate's 0.125 s per step bounds the count at 1 s / 0.125 s = 8."""
    tuner = StepsPerExecutionTuner(window=1, min_window_seconds=0, warmup_executions=0)
    drive(tuner, lambda k, i: 0.5 if k == 4 else 0.51, 2)
    assert tuner.history[-1] == ("settle", 8, "cost model")


def test_ties_cannot_stack_into_a_loss():
    """Found by a review: each candidate 4 % slower than the one before ties with it; growing
    on every tie settled at 64, 11.5 % slower than 1. The product of the tie ratios since the
    probe's start is the best's rate relative to 1: below `1 - min_gain` it is a miss."""
    rate = {1: 100.0, 4: 96.0, 16: 92.16, 64: 88.47}
    tuner = scripted()
    proposals = drive(tuner, lambda k, i: k / rate[k], 10)
    assert proposals[:6] == [4, 1, 16, 4, 64, 4]  # 16 ties with 4 but is 7.8 % below 1: a miss
    assert tuner.history[3] == ("settle", 4, "slower") and tuner.propose() == 4


def test_growth_stays_within_max_seconds_per_execution():
    """Found by a review: 0.2 s per step ties at every count; growing by 4 after a tie at 4
    (0.8 s) settled at 16, 3.2 s per execution against a 1 s bound. The next candidate is
    bounded by the candidate's measured time per step."""
    tuner = scripted()
    proposals = drive(tuner, lambda k, i: 0.2 * k, 6)
    assert max(proposals) == 5  # 1 s / 0.2 s
    assert tuner.phase == "settled" and tuner.steps == 5
    tuner = scripted(overhead_tolerance=None)
    drive(tuner, lambda k, i: 0.001 + 0.3 * k, 6)  # 4 ties; at 1.2 s no larger count fits
    assert ("settle", 4, "max seconds") in tuner.history


def test_equal_timings_tie_with_min_gain_zero():
    """Found by a review: with `min_gain=0` equal timings gave a ratio of 1 - 1e-16, which
    counted as slower."""
    tuner = scripted(growth_factor=3, patience=1, min_gain=0.0)
    drive(tuner, lambda k, i: 0.001 * k, 8)
    assert not any(h[2] == "slower" for h in tuner.history if h[0] == "settle")
    assert tuner.best_steps >= 9


def test_settles_on_the_best_when_larger_counts_are_slower():
    tuner = StepsPerExecutionTuner(
        growth_factor=2,
        window=1,
        min_window_seconds=0,
        warmup_executions=0,
        patience=2,
        overhead_tolerance=None,
    )
    # Throughput improves up to k=4, then drops: 4 is the best; 8 and 16 are slower.
    rate = {1: 100.0, 2: 180.0, 4: 300.0, 8: 250.0, 16: 240.0}
    proposals = drive(tuner, lambda k, i: k / rate[k], 12)
    assert proposals[:8] == [2, 1, 4, 2, 8, 4, 16, 4]
    assert tuner.phase == "settled"
    assert proposals[8:] == [4, 4, 4, 4]
    assert ("settle", 4, "slower") in tuner.history


def test_a_tie_within_min_gain_grows():
    """Found on the bench CNN (Zen 4 EPYC): 4 against 1 gains 5-20 %, and the median of about
    ten paired ratios scatters by about 9 %, so a rule that grows only on a gain above
    `min_gain` settled at 1 in 2 of 10 runs. Grouping adds no work per step: a count within
    `min_gain` of the best ties, becomes the best, and the probe goes on."""
    tuner = scripted(growth_factor=2, max_steps=8)
    rate = {1: 100.0, 2: 98.0, 4: 101.0, 8: 100.0}
    proposals = drive(tuner, lambda k, i: k / rate[k], 7)
    assert proposals[:6] == [2, 1, 4, 2, 8, 4]
    assert [h[:2] for h in tuner.history[:3]] == [("probing", 2), ("probing", 4), ("probing", 8)]
    assert tuner.history[3] == ("settle", 8, "cap") and tuner.propose() == 8


def test_falls_back_to_one_when_larger_counts_are_slower():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=1, min_window_seconds=0, warmup_executions=0
    )
    rate = {1: 100.0, 2: 90.0, 4: 80.0}
    proposals = drive(tuner, lambda k, i: k / rate[k], 7)
    assert proposals == [2, 1, 4, 1, 1, 1, 1]
    assert tuner.steps == 1


def test_a_machine_that_speeds_up_during_the_probe_does_not_make_growth_look_paying():
    """Larger counts cost 10 % more per step; the machine gets 3 % faster every execution.

    Measured one after the other, each larger candidate would look as fast as the count
    measured before it (a tie, which grows); measured in alternation with it, it is slower.
    """
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=3, min_window_seconds=0, warmup_executions=0
    )
    proposals = drive(tuner, lambda k, i: 0.01 * k * (1.1 if k > 1 else 1.0) * 0.97**i, 16)
    assert tuner.phase == "settled" and tuner.steps == 1
    assert ("settle", 1, "slower") in tuner.history
    assert proposals[:6] == [2, 1, 2, 1, 2, 1]


def test_one_disturbed_window_of_the_best_does_not_make_growth_look_paying():
    """A slow first window (another process) used to be the yardstick for the next candidate."""
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=2, min_window_seconds=0, warmup_executions=0, min_gain=0.05
    )
    # larger counts 10 % slower per step; the first two executions twice as slow
    proposals = drive(
        tuner, lambda k, i: 0.01 * k * (1.1 if k > 1 else 1.0) * (2.0 if i < 2 else 1.0), 14
    )
    assert tuner.steps == 1 and tuner.phase == "settled"
    assert max(proposals) == 4 and proposals[-1] == 1


def test_warmup_observation_is_dropped():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=1, min_window_seconds=0, warmup_executions=1
    )
    assert tuner.propose() == 2
    tuner.observe(2, 100.0)  # tracing: absurdly slow, must not count
    assert tuner.propose() == 2
    tuner.observe(2, 0.01)
    assert tuner.propose() == 1
    tuner.observe(1, 100.0)  # the first call of a new count: dropped as well
    assert tuner.history == []
    tuner.observe(1, 0.01)
    assert tuner.history[0] == ("probing", 2, pytest.approx(200.0))


def test_retunes_when_throughput_drifts():
    tuner = StepsPerExecutionTuner(
        growth_factor=2,
        max_steps=4,
        window=1,
        min_window_seconds=0,
        warmup_executions=0,
        drift_windows=2,
    )
    drive(tuner, lambda k, i: 0.01 + 0.001 * k, 6)
    assert tuner.phase == "settled" and tuner.steps == 4
    assert ("settle", 4, "cost model") in tuner.history  # 2 paid: the cost model picks the cap
    # The machine gets 3x slower: two drifting windows in a row trigger a new probe.
    drive(tuner, lambda k, i: 3 * (0.01 + 0.001 * k), 2)
    assert tuner.phase == "probing"
    assert any(entry[0] == "retune" for entry in tuner.history)
    assert (tuner.best_steps, tuner.steps) == (2, 4)  # probes again from chosen // growth
    drive(tuner, lambda k, i: 3 * (0.01 + 0.001 * k), 6)
    assert tuner.phase == "settled" and tuner.steps == 4


def test_no_retune_within_tolerance():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, max_steps=2, window=1, min_window_seconds=0, warmup_executions=0
    )
    drive(tuner, lambda k, i: 0.01 + 0.001 * k, 4)
    assert tuner.phase == "settled"
    drive(tuner, lambda k, i: (1.1 if i % 2 else 0.9) * (0.01 + 0.001 * k), 10)
    assert tuner.phase == "settled"
    assert not any(entry[0] == "retune" for entry in tuner.history)


def test_bounds_limit_horizon_and_max_steps():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, max_steps=8, window=1, min_window_seconds=0, warmup_executions=0
    )
    proposals = drive(tuner, lambda k, i: 0.01, 12)  # constant time: every growth pays
    assert max(proposals) == 8
    assert tuner.propose(limit=3) == 3
    tuner.set_horizon(5)
    assert tuner.propose() == 5
    assert tuner.propose(limit=2) == 2
    tuner.set_horizon(None)
    assert tuner.propose() == 8  # the cap had chosen 5: the cost model's count comes back


def test_does_not_grow_past_max_seconds_per_execution():
    tuner = StepsPerExecutionTuner(
        growth_factor=2,
        window=1,
        min_window_seconds=0,
        warmup_executions=0,
        max_seconds_per_execution=0.5,
    )
    proposals = drive(tuner, lambda k, i: 0.3 * k, 6)  # rate constant; k=2 takes 0.6 s
    assert max(proposals) <= 2
    assert tuner.phase == "settled"


def test_executions_cut_short_are_not_measurements_and_end_the_probe():
    tuner = StepsPerExecutionTuner(
        growth_factor=2,
        window=1,
        min_window_seconds=0,
        warmup_executions=0,
        overhead_tolerance=None,
    )
    drive(tuner, lambda k, i: 0.01, 2)  # k=2 against k=1: pays
    assert tuner.steps == 4
    drive(tuner, lambda k, i: 0.01, 4, limit=3)  # 4 never runs in full
    assert tuner.phase == "settled"
    assert tuner.steps == 2


def test_a_window_spans_min_window_seconds_of_executions():
    """On a fast step a window of `window` executions is too short to outlast jitter."""
    step = 1 / 64  # seconds per step, exact in binary
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=2, min_window_seconds=1 / 8, warmup_executions=0
    )
    # strict alternation until the candidate's window holds 1/8 s: 4 executions of 2 steps,
    # each paired with one of 1 step (the best's window needs `window` executions, not time)
    proposals = drive(tuner, lambda k, i: step * k, 7)
    assert tuner.history == []  # 2 pairs would fill `window`; 3 candidates hold 3/32 s < 1/8 s
    proposals += drive(tuner, lambda k, i: step * k, 1)
    assert proposals == [2, 1] * 4
    assert tuner.history == [("probing", 2, pytest.approx(64.0))]
    assert tuner.phase == "probing" and tuner.steps == 4  # equal rates: a miss, patience left


def test_the_time_bound_of_a_paired_window_is_on_the_candidate():
    """1 ms steps, a 0.25 s window: pairing 4 with 1 takes 63 pairs (0.25 s of 4-step
    executions), not the 250 pairs (1.25 s) that 0.25 s of 1-step executions would take."""
    tuner = StepsPerExecutionTuner(window=3, min_window_seconds=0.25, warmup_executions=0)
    proposals = drive(tuner, lambda k, i: 0.001 * k, 2 * 63)
    assert proposals == [4, 1] * 63
    assert tuner.history == [("probing", 4, pytest.approx(1000.0))]


def test_one_slow_execution_does_not_decide_a_window():
    """A retrace of 0.5 s fills the candidate's 0.25 s of window time by itself; the window
    still holds `window` pairs, and the median of their ratios outvotes the slow one."""
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=3, min_window_seconds=0.25, warmup_executions=0
    )
    tuner.observe(2, 0.5)  # the candidate's first execution: slow
    proposals = drive(tuner, lambda k, i: 0.001 * k, 5)
    assert proposals == [1, 2, 1, 2, 1]  # three pairs
    assert tuner.history == [("probing", 2, pytest.approx(1000.0))]
    assert tuner.best_steps == 2 and tuner._misses == 0  # equal rates on the median: a tie
    drive(tuner, lambda k, i: 0.001 * k, 1500)
    assert ("settle", 64, "cap") in tuner.history  # 1 ms per step at every count


def test_open_windows_carry_over_to_the_next_fit():
    """`fit` called once per epoch, each call shorter than a window: the probe still ends."""
    tuner = StepsPerExecutionTuner(
        growth_factor=2,
        window=3,
        min_window_seconds=0,
        warmup_executions=1,
        overhead_tolerance=None,
    )
    rate = {1: 100.0, 2: 180.0, 4: 300.0, 8: 250.0, 16: 240.0}
    for _ in range(40):  # 40 `fit` calls of 3 executions each (the first is the warm-up)
        tuner.begin()
        drive(tuner, lambda k, i: k / rate[k], 3)
    assert tuner.phase == "settled" and tuner.steps == 4
    assert ("settle", 4, "slower") in tuner.history


def test_a_new_fit_on_other_data_does_not_make_growth_look_paying():
    """Windows carried over to a 10x slower `fit`: every pair is measured within one `fit`."""
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=3, min_window_seconds=0, warmup_executions=0
    )
    # larger counts 10 % slower per step. fit A, 1000 steps/s at 1: 2, 1, 2, 1, 2, 1 (2 is
    # slower), then 4, whose paired execution of 1 step runs in fit B (a ratio of 9): the median
    # of the pairs outvotes it
    slower = {1: 1.0, 2: 1.1, 4: 1.1, 8: 1.1}
    drive(tuner, lambda k, i: 0.001 * k * slower[k], 7)
    tuner.begin()
    drive(tuner, lambda k, i: 0.01 * k * slower[k], 40)  # fit B: 100 steps/s at 1
    assert tuner.phase == "settled" and tuner.steps == 1


def test_a_cap_that_changes_the_choice_is_measured_afresh():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, max_steps=8, window=1, min_window_seconds=0, warmup_executions=0
    )
    drive(tuner, lambda k, i: 0.01, 20)  # constant time per execution: settles at 8
    assert tuner.phase == "settled" and tuner.steps == 8
    tuner.set_horizon(2)
    drive(tuner, lambda k, i: 0.01, 6)  # 200 steps/s now, 800 before: not a drift
    assert not any(entry[0] == "retune" for entry in tuner.history)
    with pytest.raises(ValueError, match="horizon"):
        tuner.set_horizon(0)


def test_a_retune_stays_within_the_cap():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, initial=4, window=1, min_window_seconds=0, warmup_executions=0
    )
    tuner.set_horizon(2)
    drive(tuner, lambda k, i: 0.01, 3)
    assert tuner.phase == "settled" and tuner.steps == 2
    drive(tuner, lambda k, i: 0.1, 4)  # 10x slower: drift, retune
    assert any(entry[0] == "retune" for entry in tuner.history)
    assert tuner.steps <= tuner.cap == 2


def test_cut_short_and_non_finite_executions_are_not_measurements():
    tuner = StepsPerExecutionTuner(
        growth_factor=2, window=1, min_window_seconds=0, warmup_executions=0
    )
    assert tuner.phase == "probing" and tuner._due() == 2  # k=2 is the first candidate
    tuner.observe(1, float("inf"))
    tuner.observe(1, float("nan"))
    # the candidate cut to the best's count by a limit, over several fits
    for _ in range(2):  # 2 + 2 in a row across fits: 4 * window
        tuner.begin()
        drive(tuner, lambda k, i: 0.01, 1, limit=1)
    assert tuner.phase == "settled" and tuner.steps == 1
    assert ("settle", 1, "candidate cannot run in full") in tuner.history
    assert tuner._best_rates == [] and tuner._rates == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": 0},
        {"min_window_seconds": -1},
        {"max_steps": 0},
        {"initial": 4, "max_steps": 2},
        {"growth_factor": 1},
        {"window": 0},
        {"min_gain": -1},
        {"min_gain": 1.0},  # nothing could be slower
        {"drift_tolerance": 0},
        {"max_seconds_per_execution": 0},
    ],
)
def test_tuner_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        StepsPerExecutionTuner(**kwargs)


def test_steps_until_next_event():
    class Every(keras.callbacks.Callback):
        def __init__(self, n):
            super().__init__()
            self.every_n_steps = n

    class Custom(keras.callbacks.Callback):
        def steps_until_next_event(self, step):
            return 3

    assert tuning.steps_until_next_event([Every(10)], 23) == 7
    assert tuning.steps_until_next_event([Every(10)], 20) == 10
    assert tuning.steps_until_next_event([Every(10), Custom()], 20) == 3
    assert tuning.steps_until_next_event([keras.callbacks.History()], 5) is None


# ------------------------------------------------------------------------------ compile / fit


def _model(seed=0, cls=OptimizedModel):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3, activation="softmax")(h))


def _data(n=200, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.integers(0, 3, size=n).astype("int32")
    return x, y


def iterations(model):
    return int(model.optimizer.iterations.numpy())


def _dataset(x, y, batch_size=8):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "fast", None])
def test_compile_rejects_bad_steps_per_execution(value):
    with pytest.raises(ValueError, match="steps_per_execution"):
        _model().compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=value)


def test_compile_accepts_auto_and_keeps_it_in_the_config():
    model = _model()
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution="auto")
    assert model.steps_per_execution == 1  # what Keras' own loop sees
    assert model.get_compile_config()["steps_per_execution"] == "auto"


class _FakeClock:
    """Each call advances 10 ms: every execution 'takes' 10 ms, so larger k always pays."""

    def __init__(self):
        self.counter = itertools.count()

    def __call__(self):
        return 0.01 * next(self.counter)


def _auto_model(tuner, cls=OptimizedModel):
    model = _model(cls=cls)
    model.compile(
        keras.optimizers.SGD(0.05),
        "sparse_categorical_crossentropy",
        steps_per_execution="auto",
    )
    state = model.fastloop_step.auto_steps
    state.tuner = tuner
    state.clock = _FakeClock()
    return model, state


def test_periodic_validation_fires_at_exact_steps_with_auto():
    x, y = _data(200)  # 25 batches per epoch
    x_val, y_val = _data(32, seed=2)
    model, state = _auto_model(
        StepsPerExecutionTuner(growth_factor=2, window=1, min_window_seconds=0)
    )
    validation = PeriodicValidation((x_val, y_val), every_n_steps=7)
    model.fit(_dataset(x, y), epochs=3, callbacks=[validation], verbose=0)
    steps = [entry["step"] for entry in validation.history]
    assert steps == list(range(7, 75 + 1, 7))
    sizes = [k for _, k in state.executions]
    assert max(sizes) > 1  # the tuner did group steps
    assert sum(sizes) == 75  # every batch ran once
    done = 0  # optimizer steps before the execution
    for begin, k in state.executions:  # no execution crosses a multiple of 7 or an epoch end
        assert begin + k <= 25
        assert not any(m % 7 == 0 for m in range(done + 1, done + k))
        done += k


def test_the_per_batch_work_of_callbacks_counts_as_execution_overhead():
    """A callback's `on_train_batch_end` costs 10 ms per execution, a step 1 ms (fake time):
    grouping saves the callback's calls, so it pays. Timed only to the first
    `on_train_batch_end`, every count cost 1 ms per step and the probe settled at 1."""

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    x, y = _data(200)  # 25 batches per epoch
    model, state = _auto_model(StepsPerExecutionTuner(window=2, min_window_seconds=0))
    clock = state.clock = Clock()

    class Costs(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            clock.t += 0.001 * state.executions[-1][1]  # the steps

        def on_train_batch_end(self, batch, logs=None):
            clock.t += 0.010  # e.g. a progress bar's or a logger's work

    model.fit(_dataset(x, y), epochs=4, callbacks=[Costs()], verbose=0)
    assert ("settle", 25, "cost model") in state.tuner.history  # 25: the epoch, the cap


def test_auto_trains_exactly_like_one_step_per_execution():
    x, y = _data(200)
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    history_1 = reference.fit(_dataset(x, y), epochs=2, verbose=0).history
    model, state = _auto_model(
        StepsPerExecutionTuner(growth_factor=2, window=1, min_window_seconds=0)
    )
    history_auto = model.fit(_dataset(x, y), epochs=2, verbose=0).history
    assert max(k for _, k in state.executions) > 1
    np.testing.assert_allclose(history_auto["loss"], history_1["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _compiled(model):
    """`{name: traces}` of the variable-count train function's two iterator functions."""
    functions = inspect.getclosurevars(model.train_function).nonlocals
    return {
        name: functions[name].experimental_get_tracing_count()
        for name in ("multi_step_on_iterator", "one_step_on_iterator")
    }


def test_a_fit_that_groups_compiles_the_loop_alone():
    """One function compiles per fit: the loop runs every execution, one step included (the
    probe's, the screening's), so Keras' one-step function is never traced; `train_step` is
    traced once and the numbers are those of one step per execution."""

    class Counting(OptimizedModel):
        traces = 0

        def train_step(self, data):
            Counting.traces += 1
            return super().train_step(data)

    x, y = _data(400)  # 50 batches per epoch
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    history_1 = reference.fit(_dataset(x, y), epochs=4, verbose=0).history
    model, state = _auto_model(
        StepsPerExecutionTuner(
            window=1,
            min_window_seconds=0,
            warmup_executions=0,
            max_seconds_per_step=0.05,
            largest_first=True,
        ),
        Counting,
    )
    history = model.fit(_dataset(x, y), epochs=2, verbose=0).history
    sizes = [k for _, k in state.executions]
    assert sizes[0] == 1 and 48 in sizes  # the screening's step, then 50 - 1 - 1
    assert _compiled(model) == {"multi_step_on_iterator": 1, "one_step_on_iterator": 0}
    history_2 = model.fit(_dataset(x, y), epochs=2, verbose=0).history
    assert _compiled(model) == {"multi_step_on_iterator": 1, "one_step_on_iterator": 0}
    assert Counting.traces == 1
    assert iterations(model) == iterations(reference) == 200
    np.testing.assert_allclose(history["loss"] + history_2["loss"], history_1["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_fit_that_cannot_group_compiles_keras_one_step_function_alone():
    x, y = _data(80)
    # unknown length: one step per execution, Keras' own function (no loop overhead)
    model, state = _auto_model(StepsPerExecutionTuner(window=1, min_window_seconds=0))
    unknown = _dataset(x, y).filter(lambda a, b: True)
    model.fit(unknown, epochs=1, verbose=0)
    assert _compiled(model) == {"multi_step_on_iterator": 0, "one_step_on_iterator": 1}
    # settled at one step (a long step) by an earlier fit: the one-step function again
    model, state = _auto_model(
        StepsPerExecutionTuner(window=1, min_window_seconds=0, max_seconds_per_step=1e-9)
    )
    # the loop at one step, then "long step" in the first epoch: the later epochs stay on the
    # loop (a second function would compile mid-fit)
    model.fit(_dataset(x, y), epochs=3, verbose=0)
    assert ("settle", 1, "long step") in state.tuner.history
    assert _compiled(model) == {"multi_step_on_iterator": 1, "one_step_on_iterator": 0}
    model.fit(_dataset(x, y), epochs=1, verbose=0)
    assert _compiled(model) == {"multi_step_on_iterator": 1, "one_step_on_iterator": 1}
    assert {k for _, k in state.executions} == {1}


def _fit_twice(model, x, y, eager_first):
    for eager in (True, False) if eager_first else (False, True, False):
        model.run_eagerly = eager
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)


@pytest.mark.parametrize("eager_first", [True, False])
def test_run_eagerly_switched_between_fits_trains_like_one_step(eager_first):
    """Found by a review: after a fit with `run_eagerly=True` Keras keeps the train function it
    built then; with `run_eagerly=False` "auto" grouped steps that function ran one at a time
    (113 optimizer steps instead of 200) and, with the background compile, crashed."""
    x, y = _data(400)
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    _fit_twice(reference, x, y, eager_first)
    model, state = _auto_model(
        StepsPerExecutionTuner(window=1, min_window_seconds=0, warmup_executions=0)
    )
    _fit_twice(model, x, y, eager_first)
    assert iterations(model) == iterations(reference) == (200 if eager_first else 300)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_keeps_one_step_with_several_replicas():
    """Keras 3.15's multi-step loop fails under MirroredStrategy (`keras.Model` with
    `steps_per_execution=4` too; tests/test_interplay.py): "auto" is not tuned there."""
    from _helpers import two_replica_strategy

    strategy = two_replica_strategy()
    x, y = _data(200)
    with strategy.scope():
        reference = _model()
        reference.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
        model, state = _auto_model(
            StepsPerExecutionTuner(window=1, min_window_seconds=0, warmup_executions=0)
        )
    assert not tuning._glue.tunable(model)
    history_1 = reference.fit(_dataset(x, y), epochs=2, verbose=0).history
    history = model.fit(_dataset(x, y), epochs=2, verbose=0).history
    assert state.executions == [] and state.tuner.history == []  # never grouped nor measured
    np.testing.assert_allclose(history["loss"], history_1["loss"], rtol=1e-6)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("horizon", ["epoch", "event"])
def test_a_candidate_at_the_horizon_is_measured_and_the_probe_settles(horizon):
    """Executions that end at the epoch end or at a step event are measured too: before, a
    candidate equal to the horizon was never measured and the probe never ended."""
    x, y = _data(32)  # 4 batches per epoch
    model, state = _auto_model(
        StepsPerExecutionTuner(growth_factor=2, window=2, min_window_seconds=0, warmup_executions=1)
    )
    callbacks = []
    if horizon == "event":  # an event every 2 steps, besides the epoch end
        callbacks = [keras.callbacks.ModelCheckpoint("unused.keras", save_freq=10**9)]
        callbacks[0].steps_until_next_event = lambda step: 2 - step % 2
    model.fit(_dataset(x, y), epochs=30, callbacks=callbacks, verbose=0)
    assert state.tuner.phase == "settled"
    # the fake clock: every execution takes 10 ms, so the cost model chooses the cap (4, the
    # epoch); the events cut each execution to 2 steps
    assert state.tuner.steps == 4
    assert [k for _, k in state.executions[-10:]] == [4 if horizon == "epoch" else 2] * 10


def test_a_loop_of_short_fits_finishes_the_probe():
    x, y = _data(32)  # 4 batches per epoch
    model, state = _auto_model(
        StepsPerExecutionTuner(growth_factor=2, window=2, min_window_seconds=0, warmup_executions=1)
    )
    for _ in range(40):
        model.fit(_dataset(x, y), epochs=1, verbose=0)
    assert state.tuner.phase == "settled" and state.tuner.steps == 4


def test_the_tuner_of_a_model_is_public_and_outlives_fit():
    x, y = _data(200)
    model, state = _auto_model(
        StepsPerExecutionTuner(growth_factor=2, window=1, min_window_seconds=0)
    )
    assert tuning.steps_per_execution_tuner(model) is state.tuner
    model.fit(_dataset(x, y), epochs=1, verbose=0)
    tuner = tuning.steps_per_execution_tuner(model)
    assert tuner.steps > 1 and tuner.history  # what the first fit learned
    learned = tuner.steps
    model.fit(_dataset(x, y), epochs=1, verbose=0)
    assert tuning.steps_per_execution_tuner(model) is tuner
    assert state.executions[0][1] == learned  # the second fit starts from the learned count
    fixed = _model()
    fixed.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=4)
    assert tuning.steps_per_execution_tuner(fixed) is None
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert tuning.steps_per_execution_tuner(plain) is None


def test_batch_callbacks_see_exact_batch_indices():
    x, y = _data(200)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    model, state = _auto_model(StepsPerExecutionTuner(window=1, min_window_seconds=0))
    model.fit(_dataset(x, y), epochs=1, callbacks=[Record()], verbose=0)
    ends = list(itertools.accumulate(k for _, k in state.executions))
    assert seen == [e - 1 for e in ends]
    assert seen[-1] == 24


def test_train_on_batch_still_works_under_auto():
    x, y = _data(16)
    model, _ = _auto_model(StepsPerExecutionTuner())
    logs = model.train_on_batch(x, y, return_dict=True)
    assert np.isfinite(logs["loss"])


def test_keras_internals_used_by_auto_exist():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, reduce_per_replica
    from keras.src.trainers.epoch_iterator import EpochIterator

    assert callable(reduce_per_replica)
    assert hasattr(EpochIterator, "_enumerate_iterator")
    assert hasattr(TensorFlowTrainer, "_autoconvert_optionals")


# ------------------------------------------------------------------------------ recommended setup


def _model_fn():
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32")(
        keras.layers.Dense(8)(inputs)
    )
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "sparse_categorical_crossentropy")
    return model


@pytest.fixture
def restore_policy():
    yield
    keras.config.set_dtype_policy("float32")


def _script(*values):
    values = iter(values)
    return lambda: next(values)


@pytest.mark.parametrize(
    "float32_seconds, mixed_seconds, expected",
    [(1.0, 2.0, "float32"), (2.0, 1.0, "mixed_bfloat16")],
    ids=["keeps_float32_when_mixed_is_slower", "takes_mixed_when_it_pays"],
)
def test_recommended_setup_policy_follows_the_timing(
    restore_policy, float32_seconds, mixed_seconds, expected
):
    bf16_cpu = HardwareInfo(cpu_flags=frozenset({"avx512_bf16"}))
    # One round: the timer is called twice per candidate, float32 first.
    setup = tuning.recommended_setup(
        _model_fn,
        _data(16),
        hardware=bf16_cpu,
        steps=1,
        rounds=1,
        timer=_script(0.0, float32_seconds, 0.0, mixed_seconds),
    )
    assert setup.policy == expected
    assert keras.config.dtype_policy().name == expected
    assert setup.compile_kwargs == {"steps_per_execution": "auto"}


def test_recommended_setup_needs_model_fn_and_data_together(restore_policy):
    with pytest.raises(ValueError, match="Received"):
        tuning.recommended_setup(_model_fn)


@pytest.mark.parametrize(
    "onednn, machine, advised",
    [(False, "x86_64", True), (True, "x86_64", False), (False, "aarch64", False)],
    ids=["off_on_x86", "already_on", "not_x86"],
)
def test_recommended_setup_advises_onednn_only_where_tensorflow_left_it_off_on_x86(
    restore_policy, monkeypatch, capsys, onednn, machine, advised
):
    from keras_fastloop import _keras_internals
    from keras_fastloop.mixed_precision import GPUInfo
    from keras_fastloop.tuning import recommended

    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.setattr(_keras_internals, "onednn_enabled", lambda: onednn)
    monkeypatch.setattr(recommended.platform, "machine", lambda: machine)
    assert tuning.onednn_off_on_x86() is advised
    setup = tuning.recommended_setup(hardware=HardwareInfo())
    assert setup.onednn_off_on_x86 is advised
    line = capsys.readouterr().out
    assert ("TF_ENABLE_ONEDNN_OPTS=1 before Python imports TensorFlow" in line) is advised
    assert line.strip() == setup.summary()
    # Training on a GPU: no CPU-kernel advice.
    gpu = HardwareInfo(gpus=(GPUInfo("A100", (8, 0)),))
    assert not tuning.recommended_setup(hardware=gpu, verbose=False).onednn_off_on_x86
    # The user set the variable (to anything): their choice, no advice.
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    assert tuning.onednn_off_on_x86() is False


def test_pipeline_keeps_order_and_rejects_non_datasets():
    ds = tf.data.Dataset.range(10).batch(3)
    got = [b.numpy().tolist() for b in tuning.optimize_pipeline(ds)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(TypeError, match="Received"):
        tuning.optimize_pipeline([1, 2, 3])
    with pytest.raises(TypeError, match="autotune=1"):
        tuning.optimize_pipeline(ds, autotune=1)
    with pytest.raises(TypeError, match="cache='yes'"):
        tuning.optimize_pipeline(ds, cache="yes")


@pytest.mark.parametrize("autotune", [False, True])
def test_pipeline_sets_autotuning_as_asked_over_the_datasets_own(autotune):
    own = tf.data.Options()
    own.autotune.enabled = not autotune
    ds = tf.data.Dataset.range(10).batch(3).with_options(own)
    setup = tuning.RecommendedSetup(policy="float32", policy_choice=None)
    for optimized in (
        tuning.optimize_pipeline(ds, autotune=autotune),
        setup.pipeline(ds, autotune=autotune),
    ):
        options = optimized.options()
        assert options.autotune.enabled is autotune
        assert options.experimental_optimization.map_parallelization is True
        assert [b.numpy().tolist() for b in optimized] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert tuning.optimize_pipeline(ds).options().autotune.enabled is False  # the default


def test_step_events_in_batches():
    """Every declaration of a step event, in batches from the next batch."""
    from keras_fastloop.callbacks import events

    class Every(keras.callbacks.Callback):
        every_n_steps = 10

    class Window(keras.callbacks.Callback):
        def batches_until_next_event(self, batch):
            return 5 - batch if batch < 5 else None

    checkpoint = keras.callbacks.ModelCheckpoint("/tmp/unused.weights.h5", save_freq=6)
    checkpoint._batches_seen_since_last_saving = 4
    assert events.batches_until_next_event([Every()], step=23, batch=0) == 7
    assert events.batches_until_next_event([Every()], step=23, batch=0, accumulation=2) == 14
    assert events.batches_until_next_event([Window()], step=0, batch=3) == 2
    assert events.batches_until_next_event([Window()], step=0, batch=7) is None
    assert events.batches_until_next_event([checkpoint], step=0, batch=0) == 2
    assert events.batches_until_next_event([Every(), Window(), checkpoint], 23, 0) == 2
    epoch_checkpoint = keras.callbacks.ModelCheckpoint("/tmp/unused.weights.h5")
    assert events.batches_until_next_event([epoch_checkpoint], 0, 0) is None
    assert sorted(events.event_periods([Every(), checkpoint], accumulation=3)) == [6, 30]
    assert events.reads_optimizer_step([Every()]) and not events.reads_optimizer_step([checkpoint])


# -- max_seconds_per_step: a long step never gets the multi-step loop -------------


def test_a_long_first_step_settles_at_the_initial_count_before_any_larger_one():
    tuner = StepsPerExecutionTuner(
        warmup_executions=0, window=1, min_window_seconds=0, max_seconds_per_step=0.05
    )
    assert tuner.propose() == 1  # screening: the initial count alone, nothing compiled
    tuner.observe(1, 0.08)  # 80 ms a step > 50 ms
    assert (tuner.phase, tuner.propose()) == ("settled", 1)
    assert tuner.history[-1] == ("settle", 1, "long step")
    for _ in range(20):  # settled for good: never a larger count
        assert tuner.propose() == 1
        tuner.observe(1, 0.08)


def test_a_short_first_step_then_probes_as_without_screening():
    screened = StepsPerExecutionTuner(
        warmup_executions=0, window=1, min_window_seconds=0, max_seconds_per_step=0.05
    )
    plain = StepsPerExecutionTuner(warmup_executions=0, window=1, min_window_seconds=0)
    assert screened.propose() == 1
    screened.observe(1, 0.01)  # 10 ms a step: not long; this is no paired measurement
    assert screened.phase == "probing" and screened.history == []
    # from here on, the same decisions as the tuner without screening (the docstring example)
    for tuner in (screened, plain):
        assert tuner.propose() == 4
        tuner.observe(4, 0.020)
        assert tuner.propose() == 1
        tuner.observe(1, 0.010)
    assert (
        (screened.phase, screened.propose())
        == (plain.phase, plain.propose())
        == (
            "settled",
            64,
        )
    )


def test_screening_waits_for_the_warmup_and_compares_the_time_per_step():
    tuner = StepsPerExecutionTuner(initial=2, warmup_executions=1, max_seconds_per_step=0.05)
    assert tuner.propose() == 2
    tuner.observe(2, 5.0)  # warm-up (may include tracing): dropped, however long
    assert tuner.phase == "probing" and tuner.propose() == 2
    tuner.observe(2, 0.09)  # 45 ms a step: under 50 ms
    assert tuner.phase == "probing" and tuner.propose() == 8


def test_max_seconds_per_step_is_validated_and_in_the_config():
    with pytest.raises(ValueError, match="max_seconds_per_step"):
        StepsPerExecutionTuner(max_seconds_per_step=0)
    assert StepsPerExecutionTuner().get_config()["max_seconds_per_step"] is None
    config = StepsPerExecutionTuner(max_seconds_per_step=0.05).get_config()
    assert StepsPerExecutionTuner(**config).get_config() == config


def test_auto_creates_a_tuner_that_screens_long_steps():
    from keras_fastloop.tuning import _glue

    _, state = _glue.resolve_steps_per_execution("auto")
    assert state.tuner.max_seconds_per_step == AUTO_MAX_SECONDS_PER_STEP == 0.05


def test_a_retune_after_drift_screens_again_and_never_runs_a_larger_count():
    # On a loaded machine a long step's rate drifts; the retune must not compile the loop.
    tuner = StepsPerExecutionTuner(
        warmup_executions=0, window=1, min_window_seconds=0, max_seconds_per_step=0.05
    )
    proposals = []
    for seconds in (0.08, 0.08, 0.2, 0.2, 0.2):  # long, reference, two drifts, long again
        proposals.append(tuner.propose())
        tuner.observe(proposals[-1], seconds)
    assert set(proposals) == {1}
    assert ("retune", 1, 5.0) in tuner.history
    assert tuner.history[-1] == ("settle", 1, "long step") and tuner.phase == "settled"


# -- largest_first: after a short screened step, the largest count is the first candidate ----


def largest_first(**kwargs):
    return StepsPerExecutionTuner(
        warmup_executions=0,
        window=1,
        min_window_seconds=0,
        max_seconds_per_step=0.05,
        largest_first=True,
        **kwargs,
    )


def test_largest_first_pairs_the_largest_count_that_fits_the_epoch_with_the_best():
    tuner = largest_first()
    tuner.set_horizon(23)  # an epoch of 23 batches, the last one maybe partial
    assert tuner.propose() == 1
    tuner.observe(1, 0.005)  # screening: 5 ms a step, short
    # a pair (21, 1) fits the epoch with one step to spare (the partial last batch)
    assert tuner.history == [("largest", 21, 200.0)]
    assert [tuner.propose(), tuner.propose()] == [21, 21]  # proposing changes nothing
    tuner.observe(21, 21 * 0.004 + 0.001)  # T(k) = 1 ms + 4 ms k
    assert tuner.propose() == 1
    tuner.observe(1, 0.005)
    # 21 pays (1.19x); T(k) = 1 ms + 4 ms k asks for k >= 50 at 0.5 % overhead: the cap
    assert tuner.phase == "settled" and tuner.propose() == 23
    assert tuner.history[-1] == ("settle", 23, "cost model")


def test_largest_first_stays_within_max_seconds_per_execution_and_max_steps():
    tuner = largest_first(max_seconds_per_execution=0.1)
    tuner.observe(1, 0.008)  # 8 ms a step: 12 steps fit in 0.1 s
    assert tuner.propose() == 12
    tuner = largest_first(max_steps=16)
    tuner.observe(1, 0.001)  # no horizon: max_steps, not max_steps - 2
    assert tuner.propose() == 16


def test_largest_first_settles_at_the_cap_on_a_tie():
    # no measurable gain: grouping adds no work per step, so the ladder would grow to the cap
    tuner = largest_first()
    tuner.set_horizon(23)
    tuner.observe(1, 0.004)
    tuner.observe(21, 21 * 0.004)
    tuner.observe(1, 0.004)
    assert (tuner.phase, tuner.propose()) == ("settled", 23)
    assert tuner.history[-1] == ("settle", 23, "tie at the largest")


def test_largest_first_falls_back_to_the_ladder_when_the_largest_is_slower():
    tuner = largest_first()
    tuner.set_horizon(23)
    tuner.observe(1, 0.004)
    tuner.observe(21, 21 * 0.005)  # 20 % slower per step than one at a time
    tuner.observe(1, 0.004)
    assert tuner.phase == "probing"
    assert [tuner.propose(), tuner.best_steps] == [4, 1]  # the ladder, not screened again
    tuner.observe(4, 4 * 0.005)
    tuner.observe(1, 0.004)
    # a miss, patience left: the ladder goes on as without largest_first
    assert tuner.phase == "probing" and tuner.propose() == 16


def test_largest_first_keeps_a_long_step_at_one():
    tuner = largest_first()
    tuner.set_horizon(23)
    tuner.observe(1, 0.08)
    assert (tuner.phase, tuner.propose()) == ("settled", 1)
    assert ("largest", 21, 12.5) not in tuner.history


def test_largest_first_never_goes_below_the_ladder():
    tuner = largest_first()
    tuner.set_horizon(5)  # 5 - 1 - 1 = 3 < 4: the ladder's candidate stays
    tuner.observe(1, 0.004)
    assert tuner.propose() == 4 and not any(h[0] == "largest" for h in tuner.history)


def test_largest_first_is_validated_and_in_the_config():
    with pytest.raises(ValueError, match="largest_first.*Received"):
        StepsPerExecutionTuner(max_seconds_per_step=0.05, largest_first=1)
    with pytest.raises(ValueError, match="needs `max_seconds_per_step`.*Received"):
        StepsPerExecutionTuner(largest_first=True)
    config = largest_first().get_config()
    assert config["largest_first"] is True
    assert StepsPerExecutionTuner(**config).get_config() == config


def test_auto_creates_a_tuner_that_probes_the_largest_count_first():
    from keras_fastloop.tuning import _glue

    _, state = _glue.resolve_steps_per_execution("auto")
    assert state.tuner.largest_first is True


def test_a_tie_at_the_largest_stays_within_max_seconds_per_execution():
    """Found by a review: a tie settled at the cap (64 steps of 40 ms: 2.56 s an execution)."""
    tuner = largest_first()
    tuner.set_horizon(200)
    tuner.observe(1, 0.040)  # 40 ms a step: short; 25 steps fit in 1 s
    assert tuner.propose() == 25
    tuner.observe(25, 25 * 0.040)
    tuner.observe(1, 0.040)
    assert tuner.history[-1] == ("settle", 25, "tie at the largest")


def test_a_largest_count_cut_short_by_unknown_events_gives_way_to_the_ladder():
    """Found by a review: events declared by a method are not in the horizon, so 64 was cut
    to 10 steps every time and, after 4 * window such executions, the probe settled at 1."""
    tuner = largest_first()  # window=1
    tuner.observe(1, 0.001)
    assert tuner.propose() == 64
    for _ in range(2):  # 2 * window executions cut short by an event every 10 steps
        k = tuner.propose(limit=10)
        tuner.observe(k, 0.001 * k)
    assert tuner.phase == "probing" and (tuner.best_steps, tuner.propose()) == (1, 4)
    assert not any(entry[0] == "settle" for entry in tuner.history)
    # the ladder's own count of cut-short executions starts anew: 3 < 4 * window
    for _ in range(3):
        k = tuner.propose(limit=3)
        tuner.observe(k, 0.001 * k)
    assert tuner.phase == "probing"


def test_largest_first_takes_a_time_too_small_to_divide_by():
    """Found by a review: `math.floor(inf)` raised OverflowError."""
    for kwargs, seconds in (({"max_seconds_per_execution": 1e308}, 0.001), ({}, 1e-310)):
        tuner = largest_first(**kwargs)
        tuner.observe(1, seconds)
        assert tuner.propose() == 64
