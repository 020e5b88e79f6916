"""Every ```python block of README.md runs, in order, in one fresh process (as a reader would).

A block that cannot run here starts with `# readme-test: not run (<why>)`; at most two may.
The blocks are joined into one script run by a subprocess, so the README's global settings (the
dtype policy of the recommended setup, a `MirroredStrategy`) cannot leak into other tests.
"""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = "# readme-test: not run"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(text):
    return BLOCK.findall(text)


def test_block_pattern_finds_blocks():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]


def test_readme_has_examples_and_few_unrun():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 8, "the README shows one example per feature"
    unrun = [b for b in blocks if b.startswith(NOT_RUN)]
    assert len(unrun) <= 2, unrun
    assert all(re.match(r"# readme-test: not run \(.+\)", b) for b in unrun)


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.slow  # a fresh process runs every block: the slow job
def test_readme_python_blocks_run(tmp_path):
    blocks = [b for b in python_blocks(README.read_text()) if not b.startswith(NOT_RUN)]
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(blocks)))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    if done.returncode:
        pytest.fail(f"README blocks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
