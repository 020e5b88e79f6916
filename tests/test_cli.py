"""The `keras-fastloop` command line answers --help and --version without TensorFlow."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*code_or_args, module=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, *(("-m", "keras_fastloop_cli") if module else ()), *code_or_args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_help_lists_the_commands_and_does_not_import_tensorflow():
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert "bench" in result.stdout and "launch" in result.stdout and "--version" in result.stdout
    assert result.stderr == ""  # no TensorFlow log lines


def test_version_is_the_package_version_written_once():
    import keras_fastloop

    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"keras-fastloop {keras_fastloop.__version__}"
    # pyproject.toml does not repeat it: setuptools reads keras_fastloop.__version__.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "keras_fastloop.__version__" }' in pyproject
    assert "\nversion = " not in pyproject.split("[tool.setuptools.dynamic]")[0]


def test_importing_the_cli_and_parsing_help_leaves_tensorflow_unimported():
    code = (
        "import sys\n"
        "import keras_fastloop_cli as cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "try:\n"
        "    cli.build_parser().parse_args(['bench', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('tensorflow', 'keras', 'numpy', 'keras_fastloop') "
        "if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    result = _run("-c", code, module=False)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_bad_command_exits_with_usage():
    result = _run("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_the_unreleased_shims_are_gone():
    """The command line lives in `keras_fastloop_cli` only (no re-export modules)."""
    import importlib.util

    assert importlib.util.find_spec("keras_fastloop.cli") is None
    assert importlib.util.find_spec("keras_fastloop.launch") is None


def test_launch_is_a_subcommand_of_the_one_parser(monkeypatch):
    import keras_fastloop_cli as cli

    calls = []
    monkeypatch.setattr(cli.launch, "launch", lambda script, **kw: calls.append((script, kw)) or 0)
    assert cli.main(["launch", "--workers", "3", "--", "train.py", "--lr", "1"]) == 0
    assert calls == [(["train.py", "--lr", "1"], {"workers": 3, "timeout": 3600.0, "python": None})]
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--workers", "0", "--", "train.py"])
    assert e.value.code == 2


def test_bench_methods_only_for_the_multitask_suite():
    import keras_fastloop_cli as cli

    args = cli.build_parser().parse_args(["bench", "--suite", "default", "--methods", "all"])
    with pytest.raises(ValueError, match="only acts on the multitask suite. Received: --suite"):
        cli._bench(args)
    args = cli.build_parser().parse_args(["bench", "--suite", "multitask", "--methods", "gls,rgw"])
    assert args.methods == "gls,rgw"
