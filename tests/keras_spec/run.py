"""Runs Keras' own tests with the swap (`swap_plugin`) and checks that the swap happened.

The tests are those of the installed Keras wheel (`keras/src/.../*_test.py`, the version
installed, so they change with it): `models/`, `trainers/trainer_test.py`,
`saving/saving_lib_test.py`, `saving/saving_api_test.py` and `callbacks/`. Exit status 0 when
pytest passes (the README's deviations are strict xfails) and every file group's tests built
our classes, with no Keras module left holding one of them.

Usage: `python tests/keras_spec/run.py [pytest options, e.g. -n 2]`
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = {
    "models": ["models/*_test.py"],
    "trainer": ["trainers/trainer_test.py"],
    "saving": ["saving/saving_lib_test.py", "saving/saving_api_test.py"],
    "callbacks": ["callbacks/*_test.py"],
}
# Tests that must build at least this many of our models per group (a silent swap failure
# builds none).
MIN_TESTS_WITH_OURS = {"models": 100, "trainer": 20, "saving": 50, "callbacks": 40}


def keras_src():
    import keras

    return Path(keras.__file__).parent / "src"


def keras_tests():
    root = keras_src()
    files = {
        group: sorted(f for p in patterns for f in glob.glob(str(root / p)))
        for group, patterns in GROUPS.items()
    }
    empty = [group for group, found in files.items() if not found]
    if empty:
        raise SystemExit(f"The installed Keras ships no test files for {empty} under {root}")
    return files


def main(argv):
    files = keras_tests()
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
            str(keras_src()),  # node ids: models/model_test.py::ModelTest::test_...
            "-p",
            "no:cacheprovider",
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
    for group, paths in files.items():
        names = {"/".join(Path(p).parts[-2:]) for p in paths}
        ours = sum(1 for test, r in records.items() if test.split("::")[0] in names and r["ours"])
        print(f"{group}: {ours} tests built keras_fastloop models")
        if ours < MIN_TESTS_WITH_OURS[group]:
            problems.append(f"{group}: only {ours} tests built our models (the swap failed?)")
    for problem in problems:
        print("keras_spec:", problem, file=sys.stderr)
    return status or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
