"""Keras' private attributes are read only through `keras_fastloop/_keras_internals/`."""

import pathlib
import re

import keras
import numpy as np

from keras_fastloop import _keras_internals as internals

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_fastloop"

# Underscore attributes that Keras defines (on `keras.Model`/`Trainer`, its optimizers and
# `CompileLoss`) and the package reads or writes.
KERAS_PRIVATE = (
    "_compile_loss",
    "_compile_metrics",
    "_compile_config",
    "_loss_tracker",
    "_call_has_training_arg",
    "_compute_loss",
    "_distribute_strategy",
    "_flatten_layers",
    "_user_loss",
    "_tracker",
    "_steps_per_execution",
    "_jit_compile",
    "_initial_epoch",
    "_learning_rate",
    "_autoconvert_optionals",
    "_all_reduce_sum_gradients",
    "_trainable_variables",
    "_model_variables_moving_average",
    "_update_model_variables_moving_average",
)


def private_accesses(root=PACKAGE):
    """`{path: [(line number, line)]}` of Keras private attribute accesses in code (not in
    comments or docstrings), outside `_keras_internals/`."""
    # `model._x`, and `getattr(model, "_x")` / `hasattr(model, "_x")`.
    pattern = re.compile(r"(\.|[\"'])(" + "|".join(KERAS_PRIVATE) + r")\b")
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("_keras_internals/"):
            continue
        in_docstring = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r'""".*?"""', "", line).split("#", 1)[0]  # one-line docstrings out
            if code.count('"""') % 2:
                in_docstring = not in_docstring
                continue
            if in_docstring or code.lstrip().startswith(("def ", "super()")):
                continue
            if pattern.search(code) or "keras.src" in code:
                found.setdefault(rel, []).append((number, line.strip()))
    return found


def test_keras_private_attributes_are_read_only_through_keras_internals():
    found = private_accesses()
    assert not found, "Keras private access outside _keras_internals/:\n" + "\n".join(
        f"keras_fastloop/{path}:{n}: {line}" for path, hits in found.items() for n, line in hits
    )


def test_the_check_sees_an_access_in_code_only(tmp_path):
    (tmp_path / "m.py").write_text(
        '"""Reads `model._compile_loss` (a docstring)."""\n'
        "# model._loss_tracker in a comment\n"
        "names = model._compile_loss.names\n"
        "self._learning_rate_schedule = None\n"
        'loss = getattr(model, "_compile_loss", None)\n'
    )
    assert private_accesses(tmp_path) == {
        "m.py": [
            (3, "names = model._compile_loss.names"),
            (5, 'loss = getattr(model, "_compile_loss", None)'),
        ]
    }


def test_keras_still_defines_the_attributes_read_through_internals():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0)
    assert internals.compile_loss(model) is not None
    assert internals.compile_metrics(model) is not None
    assert isinstance(internals.loss_tracker(model), keras.metrics.Mean)
    assert internals.call_has_training_arg(model) in (True, False)
    assert internals.distribute_strategy(model) is None
    assert model in internals.flatten_layers(model)
    assert internals.user_loss(internals.compile_loss(model)) == "mse"
    total = internals.compute_loss_hook(
        model, x=None, y=np.zeros((4, 1)), y_pred=np.ones((4, 1)), sample_weight=None
    )
    np.testing.assert_allclose(float(total), 1.0)
