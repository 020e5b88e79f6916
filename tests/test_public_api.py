"""The public API, pinned: a change here is a deliberate, reviewed change."""

import pytest

import keras_fastloop as kf


def test_top_level_all():
    assert sorted(kf.__all__) == sorted(
        [
            "FastloopWarning",
            "NonFiniteError",
            "OptimizedModel",
            "OptimizedSequential",
            "OptimizedTrainer",
            "TrainingStep",
            "__version__",
            "callbacks",
            "clipping",
            "cluster",
            "data",
            "datasets",
            "mixed_precision",
            "optimized",
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
        "EMAValidation",
        "LearningRateLogger",
        "MemoryMonitor",
        "PREEMPTED_EXIT_CODE",
        "SaveOnPreemption",
        "PeriodicValidation",
        "ProfilerWindow",
        "ThroughputMonitor",
        "ema_weights",
        "use_ema_warmup",
    }
    assert set(kf.data.__all__) == {
        "BucketPlan",
        "PaddingStats",
        "apply_bucket_plan",
        "bucket_by_length",
        "geometric_boundaries",
        "padding_stats",
        "plan_buckets",
        "quantile_boundaries",
        "sequences_to_dataset",
        "token_budget_batch_sizes",
    }
    assert set(kf.datasets.__all__) == {
        "DEFAULT_STDLIB_GROUPS",
        "OOV_ID",
        "PAD_ID",
        "StdlibCode",
        "load_digits_data",
        "load_stdlib_code",
        "tokenize_source",
    }
    assert {"WarmupCosineDecayRestarts"} <= set(kf.schedules.__all__)
    assert {"recommended_policy", "set_recommended_policy", "check_output_dtypes"} <= set(
        kf.mixed_precision.__all__
    )
    assert {"LossWeighting", "get", "METHODS"} <= set(kf.weighting.__all__)
    assert {
        "recommended_setup",
        "StepsPerExecutionTuner",
        "steps_per_execution_tuner",
        "optimize_pipeline",
    } <= set(kf.tuning.__all__)
    for module in (
        kf.clipping,
        kf.callbacks,
        kf.cluster,
        kf.data,
        kf.datasets,
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


def test_public_callables_are_annotated():
    """Every public function and constructor carries PEP 484 annotations (py.typed promises it).

    Functions: every parameter but `self`/`cls`/`*args`/`**kwargs`, and the return. Classes:
    their `__init__`, the same way (a dataclass' generated `__init__` carries its fields'
    annotations). Plus `OptimizedModel.compile`, the entry point of every feature.
    """
    import inspect

    empty = inspect.Parameter.empty
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)

    def unannotated(function, where):
        signature = inspect.signature(function)
        missing = [
            f"{where}: parameter {p.name!r}"
            for p in signature.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in variadic and p.annotation is empty
        ]
        if signature.return_annotation is empty:
            missing.append(f"{where}: return")
        return missing

    missing = unannotated(kf.OptimizedModel.compile, "keras_fastloop.OptimizedModel.compile")
    for module in (
        kf,
        kf.clipping,
        kf.schedules,
        kf.callbacks,
        kf.data,
        kf.datasets,
        kf.mixed_precision,
        kf.weighting,
        kf.tuning,
    ):
        for name in module.__all__:
            obj = getattr(module, name)
            where = f"{module.__name__}.{name}"
            if inspect.isclass(obj):
                init = obj.__init__
                # An `__init__` inherited from outside the package is not ours to annotate:
                # `object`'s (GradientClipping), Keras' (LearningRateLogger's `Callback`,
                # OptimizedSequential's `Sequential`), the builtin's (NonFiniteError).
                if not (getattr(init, "__module__", None) or "").startswith("keras_fastloop"):
                    continue
                missing += unannotated(init, f"{where}.__init__")
            elif inspect.isfunction(obj):
                missing += unannotated(obj, where)
            # Anything else is no callable: a constant (`METHODS`, `PAD_ID`, `OOV_ID`,
            # `DEFAULT_STDLIB_GROUPS`, `__version__`) or a submodule (checked on its own above).
    assert not missing, missing


# What a user imports. Everything else under keras_fastloop has a private (underscore) name,
# so a new module is either added here on purpose or named as an internal.
PUBLIC_MODULES = {
    "keras_fastloop.callbacks",
    "keras_fastloop.clipping",
    "keras_fastloop.cluster",
    "keras_fastloop.data",
    "keras_fastloop.datasets",
    "keras_fastloop.mixed_precision",
    "keras_fastloop.model",
    "keras_fastloop.schedules",
    "keras_fastloop.step",
    "keras_fastloop.tuning",
    "keras_fastloop.weighting",
}


def test_every_module_is_public_on_purpose_or_private_by_name():
    import pkgutil

    top_level = {info.name for info in pkgutil.iter_modules(kf.__path__, "keras_fastloop.")}
    public = {name for name in top_level if not name.rsplit(".", 1)[1].startswith("_")}
    assert public == PUBLIC_MODULES
    for step_internal in ("distributed", "guards", "scaling", "losses", "state", "micro_batching"):
        assert f"keras_fastloop.{step_internal}" not in top_level
        assert f"keras_fastloop._step.{step_internal}" in {
            info.name for info in pkgutil.iter_modules(kf._step.__path__, "keras_fastloop._step.")
        }


def test_one_docstring_markup():
    """Keras' markup: single backticks, no reST roles or double backticks (code fences aside)."""
    import pathlib
    import re

    root = pathlib.Path(kf.__file__).parent
    files = sorted(root.rglob("*.py")) + sorted((root.parent / "keras_fastloop_cli").rglob("*.py"))
    offending = [
        f"{path.name}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r":(class|func|mod|meth|attr):`|(?<!`)``(?!`)", line)
    ]
    assert not offending


def test_public_docstrings_stay_within_60_lines():
    """Docstrings say what (summary, arguments, errors, reference); docs/ says why."""
    import ast
    import pathlib

    package = pathlib.Path(kf.__file__).parent
    long = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node, clean=False) or ""
                if len(doc.splitlines()) > 60:
                    long.append(f"{path.relative_to(package)}:{node.name}")
    assert long == []
