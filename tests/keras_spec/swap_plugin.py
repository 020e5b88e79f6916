"""pytest plugin: Keras' own tests with `keras.Model`/`Sequential`/`Functional` swapped for ours.

Loaded by `tests/keras_spec/run.py` (`-p swap_plugin`) into a pytest run over the test files
that ship in the installed Keras wheel; nothing of Keras is copied into this repository.

- The public names (`keras.Model`, `keras.models.Sequential`, ...) point to ours for the
  whole run. The names in Keras' defining modules point to ours only while a test module is
  imported (so `from keras.src.models import Model` and `class X(keras.Model)` bind ours) and
  are restored afterwards, so Keras' own internals keep building their own classes (the
  `Functional` inside every `Sequential`, `clone_model`'s `Sequential`).
- `Functional` as the tests see it constructs and subclasses ours, but `isinstance` and `==`
  answer for Keras' `Functional`, which Keras builds internally.
- Every test records the class of each model it built, and the session checks that no
  module of Keras kept one of our classes (`KERAS_SPEC_LOG`, read by `run.py`).
- The deliberate deviations the README lists are strict `xfail`s; tests that need a package
  or a data file the wheel does not ship are skipped, saying which.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import types

import pytest

try:  # as Keras' own conftest: PyTorch before TensorFlow (the other order can crash)
    import torch  # noqa: F401
except ImportError:
    torch = None

import keras  # noqa: I001 - Keras before its internals
import keras.src
import keras.src.models
import keras.src.models.functional as functional_module
import keras.src.models.model as model_module
import keras.src.models.sequential as sequential_module
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

from deviations import DEVIATIONS, NOT_STRICT, REASONS
from keras_fastloop.model import OptimizedModel, OptimizedSequential, _functional_variant

# Import every Keras module the tests import before any name is swapped: a module first
# imported while a name points to ours would keep it.
for _name in (
    "keras.src.applications.efficientnet",
    "keras.src.backend.tensorflow.trainer",
    "keras.src.callbacks",
    "keras.src.distribution",
    "keras.src.layers.core.input_layer",
    "keras.src.legacy.saving.legacy_h5_format",
    "keras.src.models.cloning",
    "keras.src.models.variable_mapping",
    "keras.src.saving.saving_api",
    "keras.src.saving.saving_lib",
    "keras.src.testing.test_case",
    "keras.src.testing.test_utils",
    "keras.src.trainers.data_adapters.py_dataset_adapter",
    "keras.src.trainers.trainer",
    "keras.src.utils.summary_utils",
):
    importlib.import_module(_name)

KerasFunctional = functional_module.Functional
OurFunctional = _functional_variant(OptimizedModel)
OURS = (OptimizedModel, OptimizedSequential)


class _FunctionalName:
    """`Functional` as the test modules see it (see the module docstring)."""

    def __call__(self, *args, **kwargs):
        return OurFunctional(*args, **kwargs)

    def __mro_entries__(self, bases):
        return (OurFunctional,)

    def __instancecheck__(self, obj):
        return isinstance(obj, KerasFunctional)

    def __subclasscheck__(self, cls):
        return issubclass(cls, KerasFunctional)

    def __eq__(self, other):
        return other is KerasFunctional or other is OurFunctional or other is self

    def __hash__(self):
        return hash(KerasFunctional)

    def __getattr__(self, name):
        return getattr(OurFunctional, name)


SWAPPED = {
    "Model": OptimizedModel,
    "Sequential": OptimizedSequential,
    "Functional": _FunctionalName(),
}
_PUBLIC = (
    (keras, "Model"),
    (keras, "Sequential"),
    (keras.models, "Model"),
    (keras.models, "Sequential"),
    (keras.src, "Model"),
    (keras.src, "Sequential"),
    (keras.src, "Functional"),
)
_DEFINING = (
    (keras.src.models, "Model"),
    (keras.src.models, "Sequential"),
    (keras.src.models, "Functional"),
    (model_module, "Model"),
    (sequential_module, "Sequential"),
    (functional_module, "Functional"),
)
for _owner, _attr in _PUBLIC:
    setattr(_owner, _attr, SWAPPED[_attr])

# `keras.src.models` as the test modules see it (`from keras.src import models`).
_models_seen_by_tests = types.ModuleType("keras.src.models")
_models_seen_by_tests.__dict__.update(vars(keras.src.models))
_models_seen_by_tests.__dict__.update(SWAPPED)


@contextlib.contextmanager
def _defining_modules_swapped():
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in _DEFINING]
    for owner, attr in _DEFINING:
        setattr(owner, attr, SWAPPED[attr])
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


def _import_test_module(collector):
    """Imports the module under the swapped names; points its `models` to the swapped view."""
    name = os.path.basename(str(collector.path))
    if name == "variable_mapping_test.py":  # it imports saving_lib_test: under the swap too
        with _defining_modules_swapped():
            importlib.import_module("keras.src.saving.saving_lib_test")
    stub_jax = name == "trainer_test.py" and importlib.util.find_spec("jax") is None
    if stub_jax:  # imported at the top, used only by JAX-backend tests (skipped below)
        sys.modules["jax"] = types.ModuleType("jax")
    try:
        with _defining_modules_swapped():
            module = collector.obj
    finally:
        if stub_jax:
            del sys.modules["jax"]
    for key, value in list(vars(module).items()):
        if value is keras.src.models:
            setattr(module, key, _models_seen_by_tests)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    if isinstance(collector, pytest.Module):
        with contextlib.suppress(Exception):  # an import error is reported by the collection
            _import_test_module(collector)
    yield


def _relative(nodeid):
    """`models/model_test.py::ModelTest::test_x` from any spelling of the node id."""
    path, _, rest = nodeid.partition("::")
    parts = path.replace(os.sep, "/").split("/")
    return "/".join(parts[-2:]) + "::" + rest


def _missing(package):
    return importlib.util.find_spec(package) is None


def pytest_collection_modifyitems(config, items):
    fixture = os.path.join(
        os.path.dirname(keras.__file__),
        "src",
        "saving",
        "test_data",
        "pre_pr22362_nested_container.keras",
    )
    for item in items:
        key = _relative(item.nodeid)
        if key in DEVIATIONS:
            reason = REASONS[DEVIATIONS[key]]
            item.add_marker(pytest.mark.xfail(strict=key not in NOT_STRICT, reason=reason))
        elif key.startswith("callbacks/orbax_checkpoint_test.py::") and _missing("orbax"):
            item.add_marker(pytest.mark.skip(reason="orbax-checkpoint is not installed"))
        elif (
            key.startswith("trainers/trainer_test.py::")
            and "_sparse_jax_" in key
            and _missing("jax")
        ):
            item.add_marker(pytest.mark.skip(reason="JAX is not installed"))
        elif key.startswith(
            "trainers/trainer_test.py::TestTrainer::test_fit_with_data_adapter_grain"
        ) and _missing("grain"):
            item.add_marker(pytest.mark.skip(reason="grain is not installed"))
        elif key.endswith("::test_legacy_load_skips_missing_nested_containers") and not (
            os.path.exists(fixture)
        ):
            item.add_marker(pytest.mark.skip(reason=f"the wheel lacks its fixture {fixture}"))
        if "multi_device" in item.keywords:  # as Keras' own conftest
            item.add_marker(pytest.mark.skip(reason="needs several devices"))


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: a trainable backend only")
    config.addinivalue_line("markers", "multi_device: several devices only")
    # Some test modules import Keras' root conftest (`from conftest import skip_if_backend`),
    # which the wheel does not ship.
    shim = types.ModuleType("conftest")
    shim.skip_if_backend = lambda given_backend, reason: pytest.mark.skipif(
        keras.backend.backend() == given_backend, reason=reason
    )
    sys.modules.setdefault("conftest", shim)


# ---- what each test built, and the leak check ---------------------------------------------

_built = []
_records = {}
_keras_init = TensorFlowTrainer.__init__


def _recording_init(self, *args, **kwargs):
    _built.append(type(self))
    return _keras_init(self, *args, **kwargs)


TensorFlowTrainer.__init__ = _recording_init


@pytest.fixture(autouse=True)
def _record_models(request):
    _built.clear()
    yield
    _records[_relative(request.node.nodeid)] = {
        "ours": sum(issubclass(c, OURS) for c in _built),
        "theirs": sorted({c.__qualname__ for c in _built if not issubclass(c, OURS)}),
    }


def pytest_sessionfinish(session):
    log_dir = os.environ.get("KERAS_SPEC_LOG")
    if not log_dir:
        return
    keras_dir = os.path.dirname(keras.__file__) + os.sep
    ours = (*SWAPPED.values(), OurFunctional)
    leaks = []
    for name, module in sys.modules.copy().items():  # atomic: other threads may import
        # The module's own dict only: `getattr` on a lazy module (TensorFlow has some) imports it.
        namespace = getattr(module, "__dict__", None) or {}
        path = namespace.get("__file__") or ""
        if not name.startswith("keras.") or not path.startswith(keras_dir):
            continue
        if path.endswith("_test.py") or module in (keras.models, keras.src):
            continue  # the test modules, and the public names swapped for the whole run
        # identity: `==` on the swapped `Functional` answers for Keras' own class too
        leaks += [f"{name}.{a}" for a in SWAPPED if any(namespace.get(a) is o for o in ours)]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(log_dir, f"records-{worker}.json"), "w") as handle:
        json.dump({"records": _records, "leaks": leaks}, handle)
