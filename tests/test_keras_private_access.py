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
    "_enumerate_iterator",
    "_batches_seen_since_last_saving",
    "_num_workers",  # TensorFlow's (multi-worker strategies), read through _tf_internals.py
)


_INTERNALS = ("_keras_internals/", "_tf_internals.py")
# `x._name` and `getattr(x, "_name")` / `hasattr` / `setattr`, on anything but `self` / `cls`.
_ACCESS = re.compile(
    r"(?<![\w.])(\w+(?:\.\w+)*)\.(_[A-Za-z]\w*)\b"
    r"|\b(?:getattr|hasattr|setattr)\(\s*(?:[^,()]|\([^()]*\))+,\s*[\"'](_[A-Za-z]\w*)[\"']"
)
# `_name`s the package defines itself: attributes it sets, functions, classes, module names.
_DEFINES = re.compile(
    r"\bself\.(_[A-Za-z]\w*)\s*(?::[^=]*)?=(?!=)|\bdef (_\w+)|\bclass (_\w+)"
    r"|^\s*(_[A-Za-z]\w*)\s*(?::[^=]*)?=(?!=)|__setattr__\(\w+, [\"'](_\w+)"
    r"|\b(_\w+)\.py\b|import (_\w+)|\bas (_\w+)|\.(_\w+) import"
)


# Public despite the underscore: a namedtuple's API.
_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


_STRING = re.compile(r"f?\"[^\"]*\"|f?'[^']*'")


def _blank_messages(match):
    """A string literal kept if it is an attribute name (`"_x"`), else emptied."""
    return match.group(0) if re.fullmatch(r"[\"']_\w+[\"']", match.group(0)) else '""'


def _code_lines(path):
    """`(number, line, code)`: the code of each line, without comments and docstrings."""
    in_docstring = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = re.sub(r'""".*?"""', "", line).split("#", 1)[0]  # one-line docstrings out
        if code.count('"""') % 2:
            in_docstring = not in_docstring
            continue
        if not in_docstring:
            yield number, line, code


def _own_names(root):
    names = set()
    for path in root.rglob("*.py"):
        if path.relative_to(root).as_posix().startswith(_INTERNALS):
            continue
        for _, _, code in _code_lines(path):
            for match in _DEFINES.finditer(code):
                names.update(group for group in match.groups() if group)
    return names - set(KERAS_PRIVATE)


def private_accesses(root=PACKAGE):
    """`{path: [(line number, line)]}` of accesses, outside `_keras_internals/` and
    `_tf_internals.py`, to an underscore attribute the package does not define itself (so
    Keras' or TensorFlow's), or to one of `KERAS_PRIVATE` (in code, not in comments or
    docstrings; strings other than the attribute names of `getattr` and the like are left
    out). A `def` or `super()` line is an override, not an access."""
    own = _own_names(root)
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(_INTERNALS):
            continue
        for number, line, code in _code_lines(path):
            if code.lstrip().startswith(("def ", "super()")) or "keras.src" in code:
                if "keras.src" in code:
                    found.setdefault(rel, []).append((number, line.strip()))
                continue
            code = _STRING.sub(_blank_messages, code)
            for match in _ACCESS.finditer(code):
                if match.group(1) in ("self", "cls"):
                    continue  # an object's own attribute
                name = match.group(2) or match.group(3)
                if name.startswith(("__", "_fastloop")) or name in _NAMEDTUPLE_API:
                    continue  # the package's marks (`_fastloop_*`) on objects it makes
                if name in own and name not in KERAS_PRIVATE:
                    continue
                found.setdefault(rel, []).append((number, line.strip()))
                break
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
        "backup._weights_path\n"  # no list names it: the package does not define it
        "run._own = 1\n"
        "self._own = 0\n"  # defined here: the package's own
        'print("see backup._weights_path")\n'  # a message
        "super()._maybe_symbolic_build(data)\n"
        "path = self.backup._training_metadata_path\n"
        'n = getattr(getattr(strategy, "extended", None), "_num_workers", 1)\n'
    )
    assert private_accesses(tmp_path) == {
        "m.py": [
            (3, "names = model._compile_loss.names"),
            (5, 'loss = getattr(model, "_compile_loss", None)'),
            (6, "backup._weights_path"),
            (11, "path = self.backup._training_metadata_path"),
            (12, 'n = getattr(getattr(strategy, "extended", None), "_num_workers", 1)'),
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
