"""The public API, pinned: a change here is a deliberate, reviewed change."""

import pytest

import keras_fastloop as kf


def test_top_level_all():
    assert sorted(kf.__all__) == sorted(
        [
            "OptimizedModel",
            "OptimizedSequential",
            "__version__",
            "callbacks",
            "clipping",
            "data",
            "mixed_precision",
            "schedules",
            "tuning",
            "weighting",
        ]
    )
    for name in kf.__all__:
        assert getattr(kf, name) is not None


def test_submodule_exports():
    assert set(kf.clipping.__all__) == {
        "AdaptiveGradientClipping",
        "AutoClip",
        "ClipByGlobalNorm",
        "ClipByNorm",
        "ClipByValue",
        "GradientClipping",
        "deduplicate",
        "get",
    }
    assert set(kf.callbacks.__all__) == {
        "LearningRateLogger",
        "MemoryMonitor",
        "PeriodicValidation",
        "ProfilerWindow",
        "ThroughputMonitor",
    }
    assert {"bucket_by_length", "padding_stats", "load_stdlib_code", "load_digits_data"} <= set(
        kf.data.__all__
    )
    assert {"WarmupCosineDecayRestarts"} <= set(kf.schedules.__all__)
    assert {"recommended_policy", "set_recommended_policy", "check_output_dtypes"} <= set(
        kf.mixed_precision.__all__
    )
    assert {"LossWeighting", "get", "METHODS"} <= set(kf.weighting.__all__)
    assert {"recommended_setup", "StepsPerExecutionTuner", "optimize_pipeline"} <= set(
        kf.tuning.__all__
    )
    for module in (
        kf.clipping,
        kf.callbacks,
        kf.data,
        kf.schedules,
        kf.mixed_precision,
        kf.weighting,
    ):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_version_matches_package_metadata():
    from importlib.metadata import version

    assert kf.__version__ == version("keras-fastloop")


def test_own_warnings_are_errors_in_tests():
    """pyproject's filterwarnings turns keras_fastloop's own warnings into errors."""
    import warnings

    from keras_fastloop._warnings import FastloopWarning

    assert issubclass(FastloopWarning, UserWarning)
    with pytest.raises(FastloopWarning):
        warnings.warn("a keras_fastloop warning", FastloopWarning, stacklevel=1)


def test_ships_py_typed():
    from pathlib import Path

    assert (Path(kf.__file__).parent / "py.typed").is_file()
