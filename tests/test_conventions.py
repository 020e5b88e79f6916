"""Conventions of the test suite itself."""

import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent
# Built from parts, so that this file does not match itself.
TRACKER = re.compile("[Ii]ssue" + r" \d+|" + r"\bC" + r"\d{1,2}\b")


def test_tests_never_refer_to_the_tracker_or_case_ids():
    """A test says what it checks; an issue number or a case id means nothing without the
    tracker."""
    found = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        if "keras_spec" not in path.parts and path.name != "test_conventions.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if TRACKER.search(line)
    ]
    assert found == []


def test_the_tracker_pattern_finds_what_it_should():
    assert TRACKER.search("(issue" + " 14)") and TRACKER.search("case C" + "5")
    assert TRACKER.search("C16 shapes") is not None  # two digits count too
    assert not TRACKER.search("CPU C-state")
