"""The warning category of keras_fastloop's own warnings.

`FastloopWarning` subclasses `UserWarning`, so `pytest.warns(UserWarning)` and
`warnings.filterwarnings("ignore", category=UserWarning)` keep matching it; the test suite
turns it into an error (pyproject `filterwarnings`) so that no test triggers one unnoticed.
"""


class FastloopWarning(UserWarning):
    """A warning raised by keras_fastloop itself (misconfiguration, skipped steps, ...)."""
