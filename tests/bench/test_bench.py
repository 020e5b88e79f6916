"""The benchmark suites run end to end at tiny size and write their reports (structure only:
speed is measured by the bench, never asserted in a test)."""

import gc
import json

import keras
import numpy as np
import pytest

import keras_fastloop_cli as cli
from keras_fastloop import tuning
from keras_fastloop_bench import bucketing, default

pytestmark = pytest.mark.slow  # integration: the slow job


@pytest.mark.slow
def test_default_suite_quick(tmp_path):
    result = default.run(tmp_path, quick=True, progress=lambda line: None)
    names = [row["contender"] for row in result["rows"]]
    assert names[0] == default.BASELINE
    assert {
        "seed's GradientTape loop (eager)",
        "OptimizedModel.fit (features off)",
        default.VALIDATE_EVERY_2,
    } <= set(names)
    for row in result["rows"]:
        assert row["throughput_samples_per_s"] > 0
        assert 0.0 <= row["val_accuracy"] <= 1.0
    assert result["rows"][0]["throughput_ratio"] == 1.0
    for suffix in ("md", "json", "png"):
        assert (tmp_path / f"default.{suffix}").stat().st_size > 0
    assert json.loads((tmp_path / "default.json").read_text())["suite"] == "default"
    assert "| contender |" in result["markdown"]
    # The profile of one epoch per profiled contender: the convolutions are there.
    assert set(result["profiles"]) == set(default.PROFILED)
    for profile in result["profiles"].values():
        assert profile["op_ms_per_step"] > 0
        # Eigen's `Conv2DBackpropFilter`/`_FusedConv2D`, or oneDNN's `_MklNative...Conv2D...`
        # where TensorFlow turns oneDNN on (CPUs with AVX512_BF16, ...)
        assert any("Conv2D" in r["op_type"] for r in profile["top"]), profile["top"]
    assert "Where a step's time goes" in result["markdown"]
    assert '`"auto"` at the end of each run' in result["markdown"]
    assert all("steps_per_execution" in extra for extra in result["extra"][default.RECOMMENDED])
    if tuning.onednn_off_on_x86():  # x86 without oneDNN here: the child turns it on
        assert {default.RECOMMENDED_ONEDNN, default.RECOMMENDED_CONTROL} <= set(names)
        assert "(oneDNN on there)" in result["markdown"]
        assert "with `=0` (oneDNN off)" in result["markdown"]


def test_own_process_contender_trains_what_the_in_process_one_trains():
    """The child rebuilds the data and the contender: with this process's settings it gives
    this process's numbers, and it reports the oneDNN switch it ran with."""
    from keras_fastloop import _keras_internals
    from keras_fastloop_bench import harness
    from keras_fastloop_bench.own_process import own_process_contender

    data = default.Data(quick=True)
    keras.utils.set_random_seed(default.SEED)
    initial = default.build_cnn().get_weights()
    here = harness.Run("here", epochs=2, initial_weights=initial)
    default.contenders(data, "float32", extras=False)[default.RECOMMENDED](here)
    onednn = "1" if _keras_internals.onednn_enabled() else "0"
    child = harness.Run("child", epochs=2, initial_weights=initial)
    own_process_contender(
        default.RECOMMENDED, {"TF_ENABLE_ONEDNN_OPTS": onednn}, True, policy="float32"
    )(child)
    assert child.extra["onednn"] == _keras_internals.onednn_enabled()
    assert child.extra["steps_per_execution"].endswith(("(probing)", "(settled)"))
    assert here.extra["steps_per_execution"].endswith(("(probing)", "(settled)"))
    assert child.samples == here.samples == [len(data.x)] * 2
    np.testing.assert_allclose([p[1] for p in child.curve], [p[1] for p in here.curve], rtol=1e-6)
    assert child.val_accuracy == pytest.approx(here.val_accuracy)
    assert len(child.train_seconds) == 2 and child.total_seconds > 0
    with pytest.raises(RuntimeError, match="no-such-contender"):
        own_process_contender("no-such-contender", {}, True)(
            harness.Run("bad", epochs=1, initial_weights=initial)
        )


@pytest.mark.slow
def test_bucketing_suite_quick(tmp_path):
    result = bucketing.run(tmp_path, quick=True, progress=lambda line: None)
    padding = {row["contender"]: row for row in result["rows"]}
    bucketed = padding["(c) bucket_by_length"]
    longest = padding["(a) pad to longest in data set"]
    # Deterministic properties of the pipelines (not timings): bucketing wastes far less.
    assert bucketed["padding_share"] <= 0.10 < longest["padding_share"]
    assert bucketed["distinct_shapes"] <= 2 * len(result["boundaries"])
    assert (tmp_path / "bucketing.md").exists()


def test_cli_lists_every_suite_module():
    import importlib

    for module in cli.SUITES.values():
        assert hasattr(importlib.import_module(f"keras_fastloop_bench.{module}"), "run")


def _fake_run(name, curve, samples_per_epoch=100, seconds_per_epoch=1.0):
    from keras_fastloop_bench import harness

    run = harness.Run(name=name, epochs=len(curve), initial_weights=[])
    run.curve = list(curve)
    run.train_seconds = [seconds_per_epoch] * len(curve)
    run.samples = [samples_per_epoch] * len(curve)
    run.total_seconds = curve[-1][0]
    return run


def test_the_table_gives_the_paired_per_round_ratios():
    from keras_fastloop_bench import harness

    row = {
        "contender": "c",
        "throughput_samples_per_s": 1000.0,
        "throughput_ratio": 1.1,
        "per_round_throughput_ratio": [1.3, 0.9, 1.1],
        "first_epoch_s": 1.0,
        "first_epoch_ratio": 1.0,
        "time_to_target_s": 2.0,
        "speedup_to_target": 1.0,
        "val_accuracy": 0.9,
        "peak_rss_growth_mb": 1.0,
    }
    single = dict(row, contender="one round", per_round_throughput_ratio=[1.2])
    table = harness.markdown_table([row, single], "base", 0.05).splitlines()
    assert "| per round: median (range) |" in table[0]
    assert table[2].startswith("| c | 1000 | 1.100× | 1.10 (0.90-1.30) | 1.00 |")
    assert table[3].startswith("| one round | 1000 | 1.100× | – |")
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_median_round_ranks_by_time_to_target():
    from keras_fastloop_bench import harness

    rounds = [
        _fake_run("a", [(1.0, 0.5), (2.0, 0.1)]),  # reaches 0.2 at 2.0 s
        _fake_run("a", [(1.0, 0.1), (2.0, 0.05)]),  # at 1.0 s
        _fake_run("a", [(3.0, 0.5), (6.0, 0.1)]),  # at 6.0 s
    ]
    assert harness.median_round(rounds, target_loss=0.2) == 0
    # A round that never reaches the target: rank by total time instead (2, 2, 6 -> index 1).
    assert harness.median_round(rounds, target_loss=0.01) == 1
    assert harness.median_round(rounds[1:], target_loss=None) == 0  # lower median of two


def test_plot_has_all_rounds_the_target_and_a_throughput_bar_chart(tmp_path):
    from keras_fastloop_bench import harness

    runs = {
        "plain fit": [
            _fake_run("p", [(1.0, 0.5), (2.0, 0.1)], seconds_per_epoch=2.0) for _ in range(3)
        ],
        "OptimizedModel": [_fake_run("o", [(1.0, 0.4), (1.5, 0.05)]) for _ in range(3)],
    }
    path = tmp_path / "plot.png"
    fig = harness.plot_curves(runs, path, "test", target_loss=0.2)
    assert path.stat().st_size > 0
    curves, bars = fig.axes
    assert len(fig.axes) == 2
    lines = curves.get_lines()
    assert len(lines) == 2 * 3 + 1  # every round of both contenders, plus the target line
    assert sum(1 for line in lines if line.get_alpha() is None) == 2 + 1  # 2 bold + target
    target = [line for line in lines if line.get_linestyle() == "--"]
    assert len(target) == 1 and list(target[0].get_ydata()) == [0.2, 0.2]
    assert "median round of 3" in curves.get_title()
    widths = sorted(patch.get_width() for patch in bars.patches)
    assert widths == [50.0, 100.0]  # median samples/s (first epoch excluded): 100/2 and 100/1


def test_one_report_writer_writes_strict_json_for_numpy_nan(tmp_path):
    import numpy as np

    from keras_fastloop_bench import harness

    payload = {
        "a": np.float32("nan"),
        "b": np.array([1.0, np.inf]),
        "c": np.int64(3),
        "d": [float("nan"), -float("inf")],
    }
    harness.write_report(tmp_path, "s", "md", payload)
    text = (tmp_path / "s.json").read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "a": None,
        "b": [1.0, None],
        "c": 3,
        "d": [None, None],
    }


def test_run_alternating_rotates_the_order_each_round():
    from keras_fastloop_bench import harness

    order = []

    def contender(name):
        def train(run):
            assert not gc.isenabled()  # no collection of earlier runs' garbage inside a run
            order.append(name)
            run.epoch_done(0.5, 1.0, 10)
            run.epoch_done(0.25, 1.0, 10)
            run.finish(1.0)

        return train

    runs = harness.run_alternating(
        {n: contender(n) for n in "ABC"}, lambda: [], 2, 4, progress=lambda line: None
    )
    assert order == list("ABCBCACABABC")
    assert {name: len(r) for name, r in runs.items()} == {"A": 4, "B": 4, "C": 4}
    assert runs["B"][0].throughput() == 10.0  # epochs after the first: 10 samples in 1 s
    assert gc.isenabled()

    def failing(run):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        harness.run_alternating({"F": failing}, lambda: [], 1, 1, progress=lambda line: None)
    assert gc.isenabled()


def test_plot_labels_tell_the_stock_candidates_apart():
    from keras_fastloop_bench import harness, stock

    names = [*stock.policy_fit_names(), "OptimizedModel, recommended setup + oneDNN (own process)"]
    labels = harness.plot_labels(names)
    assert len(set(labels)) == len(names)
    assert labels[:3] == ["fit, rec. policy", "fit, rec. policy, spe=8", "fit, rec. policy, spe=32"]
    assert all(len(label) <= 40 for label in labels)


def test_plot_highlights_the_recommended_setup(tmp_path):
    from keras_fastloop_bench import harness

    runs = {
        name: [_fake_run(name, [(1.0, 0.5), (2.0, 0.1)]) for _ in range(2)]
        for name in ("keras.Model.fit, recommended policy", "OptimizedModel, recommended setup")
    }
    fig = harness.plot_curves(
        runs, tmp_path / "p.png", "t", highlight=["OptimizedModel, recommended setup"]
    )
    curves, bars = fig.axes
    widths = [line.get_linewidth() for line in curves.get_lines() if line.get_alpha() is None]
    assert widths == [1.5, 3.0]
    weights = [tick.get_fontweight() for tick in bars.get_yticklabels()]
    assert weights == ["normal", "bold"]  # bars are listed bottom-up: first contender on top


def test_bench_prints_the_cpu_before_any_figure(monkeypatch, capsys, tmp_path):
    import types

    import keras_fastloop_cli as cli
    from keras_fastloop_bench import harness

    fake = types.SimpleNamespace(run=lambda out_dir, quick: {"markdown": "| figure |"})
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: fake)
    cli.main(["bench", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith(f"Machine: {harness.machine_description()}\n")
    assert out.index("Machine:") < out.index("| figure |")
