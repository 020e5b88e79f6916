"""Every `>>>` example in the package's docstrings runs and shows what it claims (doctest).

An example that sketches a call on a model (`model.compile(..., loss_weighting="uw")`) runs on
a small real two-task model given as `model`, with `losses` for its two outputs and a batch
`x`, `y`, so the method ids and arguments the docs show are the ones `compile` accepts.
Examples that cannot run here say `# doctest: +SKIP`.
"""

import doctest
import importlib
import pkgutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf

MODULES = sorted(  # `__main__` modules run a command when imported
    info.name
    for info in pkgutil.walk_packages(kf.__path__, prefix=f"{kf.__name__}.")
    if not info.name.endswith(".__main__")
)


def _examples(name):
    tests = doctest.DocTestFinder().find(importlib.import_module(name), name)
    return [test for test in tests if test.examples]


WITH_EXAMPLES = [name for name in MODULES if _examples(name)]


def _namespace():
    """What the examples may use without defining it (fresh for every docstring)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = kf.OptimizedModel(
        inputs,
        {
            "cls": keras.layers.Dense(3, activation="softmax", name="cls")(hidden),
            "seg": keras.layers.Dense(1, activation="sigmoid", name="seg")(hidden),
        },
    )
    rng = np.random.default_rng(0)
    return {
        "keras": keras,
        "np": np,
        "tf": tf,
        "kf": kf,
        "model": model,
        "losses": {"cls": "sparse_categorical_crossentropy", "seg": "binary_crossentropy"},
        "x": rng.normal(size=(32, 4)).astype("float32"),
        "y": {
            "cls": rng.integers(0, 3, size=(32,)),
            "seg": rng.integers(0, 2, size=(32, 1)).astype("float32"),
        },
    }


def test_every_module_is_searched():
    # The walk must see the subpackages' modules, or examples would go unchecked silently.
    assert "keras_fastloop.weighting.mgda" in MODULES
    assert "keras_fastloop.data.bucketing" in MODULES
    assert len(MODULES) > 40
    assert len(WITH_EXAMPLES) > 15


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    for test in _examples(name):
        test.globs = {**_namespace(), **test.globs}
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)
