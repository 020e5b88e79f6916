"""Runs Keras' own tests with the swap (`swap_plugin`) and checks that the swap happened.

The tests are those of the installed Keras wheel (`keras/src/.../*_test.py`, the version
installed, so they change with it): `models/`, `trainers/trainer_test.py`,
`saving/saving_lib_test.py`, `saving/saving_api_test.py` and `callbacks/`. Exit status 0 when
pytest passes (the README's deviations are strict xfails) and every file group's tests built
our classes, with no Keras module left holding one of them.

Usage: `python tests/keras_spec/run.py [pytest options, e.g. -n 2]`. With a selection
(`-k`, `-m`, `--deselect`, node ids) the per-group minimums give way to "some test built ours".
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from deviations import DEVIATIONS

HERE = Path(__file__).resolve().parent
GROUPS = {
    "models": ["models/*_test.py"],
    "trainer": ["trainers/trainer_test.py"],
    "saving": ["saving/saving_lib_test.py", "saving/saving_api_test.py"],
    "callbacks": ["callbacks/*_test.py"],
}
# In a whole run (no -k, -m, --deselect or node ids), how many tests of each group must build
# at least one of our models: about 90 % of the 147 / 30 / 125 / 57 that do with Keras 3.15.1
# (a swap of `Sequential` that silently failed left 123 / 21 / 41 / 2).
MIN_TESTS_WITH_OURS = {"models": 130, "trainer": 27, "saving": 110, "callbacks": 50}
_SELECTING = re.compile(r"^(-k|-m|--deselect)|::")


def keras_src():
    import keras

    return Path(keras.__file__).parent / "src"


def keras_tests(root):
    """The test files of each group under Keras' `src/`, by group name."""
    files = {
        group: sorted(f for p in patterns for f in glob.glob(str(root / p)))
        for group, patterns in GROUPS.items()
    }
    empty = [group for group, found in files.items() if not found]
    if empty:
        raise SystemExit(f"The installed Keras ships no test files for {empty} under {root}")
    return files


def missing_deviations(root):
    """The deviation node ids whose test the installed Keras no longer defines (renamed)."""
    missing = []
    for node in DEVIATIONS:
        path, *_, test = node.split("::")
        source = (root / path).read_text() if (root / path).exists() else ""
        if not re.search(rf"def {re.escape(test)}\(", source):
            missing.append(node)
    return missing


def main(argv):
    root = keras_src()
    files = keras_tests(root)
    missing = missing_deviations(root)
    if missing:
        print(f"keras_spec: deviation tests not found in this Keras: {missing}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as log_dir:
        env = dict(
            os.environ,
            KERAS_SPEC_LOG=log_dir,
            KERAS_BACKEND="tensorflow",
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "swap_plugin",
            "-c",
            str(HERE / "pytest.ini"),
            "--rootdir",
            str(root),  # node ids: models/model_test.py::ModelTest::test_...
            "-p",
            "no:cacheprovider",
            # Keras' tests do not use hypothesis; its plugin imports it at the run's end, and
            # rewriting its modules then crashed single-process runs (CPython 3.11.7's "AST
            # constructor recursion depth mismatch" after TensorFlow ran in the process)
            "-p",
            "no:hypothesispytest",
            "-q",
            "-rfEX",
            *argv,
            *(f for group in files.values() for f in group),
        ]
        status = subprocess.run(command, env=env, cwd=HERE).returncode
        records, leaks = {}, []
        for path in glob.glob(os.path.join(log_dir, "records-*.json")):
            with open(path) as handle:
                data = json.load(handle)
            records.update(data["records"])
            leaks += data["leaks"]
    problems = []
    if leaks:
        problems.append(f"Keras modules left holding our classes: {sorted(set(leaks))}")
    whole_run = not any(_SELECTING.search(arg) for arg in argv)
    for group, paths in files.items():
        names = {"/".join(Path(p).parts[-2:]) for p in paths}
        ran = [r for test, r in records.items() if test.split("::")[0] in names]
        ours = sum(1 for r in ran if r["ours"])
        print(f"{group}: {ours} of {len(ran)} tests built keras_fastloop models")
        if whole_run and ours < MIN_TESTS_WITH_OURS[group]:
            problems.append(f"{group}: only {ours} tests built our models (the swap failed?)")
        elif ran and any(r["theirs"] for r in ran) and not ours:
            problems.append(f"{group}: no test built our models (the swap failed?)")
    for problem in problems:
        print("keras_spec:", problem, file=sys.stderr)
    return status or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
