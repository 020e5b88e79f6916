"""The `keras-fastloop` command line, importable without TensorFlow.

Importing a submodule of `keras_fastloop` runs `keras_fastloop/__init__.py`, which imports
TensorFlow and Keras (seconds of start-up and TensorFlow's log lines). The command line lives in
this separate top-level package so that `keras-fastloop --help`, `--version` and `launch`
(which only starts worker processes) never import TensorFlow; `bench` imports it when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from keras_fastloop_cli import launch

__all__ = ["SUITES", "main", "version"]

# Suite name -> module under keras_fastloop_bench exposing run(out_dir, quick=False) -> dict.
SUITES = {
    "default": "default",
    "multitask": "multitask",
    "bucketing": "bucketing",
    "micro-batching": "micro_batching",
    "memory": "memory",
    "distributed": "distributed",
    "seed-table": "seed_table",
    "resnet": "resnet",
    "text": "text",
    "sam": "sam",
}


def version():
    """`keras_fastloop.__version__`, read from the source without importing the package.

    The version is written once, in `keras_fastloop/__init__.py` (`pyproject.toml` reads
    it from there too); importing `keras_fastloop` would import TensorFlow, so the file is
    located with `importlib.util.find_spec` and its `__version__ = "..."` assignment read
    with `ast`.

    Returns:
        str, e.g. `"0.1.0"`.

    Raises:
        RuntimeError: if `keras_fastloop` cannot be found or sets no literal `__version__`.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("keras_fastloop")
    if spec is None or not spec.origin:
        raise RuntimeError("The `keras_fastloop` package cannot be found on sys.path.")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise RuntimeError(f'{spec.origin} sets no literal `__version__ = "..."`.')


def _bench(args):
    out_dir = Path(args.out)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    if getattr(args, "methods", None) and "multitask" not in names:
        raise ValueError(
            "`--methods` only acts on the multitask suite. "
            f"Received: --suite={args.suite} --methods={args.methods}"
        )
    for name in names:
        module = importlib.import_module(f"keras_fastloop_bench.{SUITES[name]}")  # TF from here
        if name == names[0]:  # every figure below is this CPU's
            from keras_fastloop_bench.harness import machine_description

            print(f"Machine: {machine_description()}", flush=True)
        t0 = time.perf_counter()
        kwargs = {"quick": args.quick}
        if args.profile and name == "seed-table":
            kwargs["profile"] = args.profile
        if getattr(args, "methods", None) and name == "multitask":
            kwargs["methods"] = "all" if args.methods == "all" else tuple(args.methods.split(","))
        result = module.run(out_dir, **kwargs)
        print(result["markdown"])
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s; report in {out_dir}/")
    return 0


def build_parser():
    """The argument parser of `keras-fastloop` (no TensorFlow import).

    Returns:
        An `argparse.ArgumentParser` with the `bench` and `launch` commands and
        `--version`.
    """
    parser = argparse.ArgumentParser(
        prog="keras-fastloop",
        description="keras-fastloop: an expert training step for Keras 3 on TensorFlow.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure the framework against plain fit on real data")
    bench.add_argument("--suite", default="default", choices=[*SUITES, "all"])
    bench.add_argument("--out", default="bench_results", help="folder for .md/.json/.png reports")
    bench.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    bench.add_argument(
        "--profile",
        choices=["cpu", "gpu"],
        default=None,
        help="seed-table suite: cpu (digits ResNet) or gpu (ResNet-50, synthetic)",
    )
    bench.add_argument(
        "--methods",
        default=None,
        help="multitask suite: 'all' (every registered weighting method) or comma-separated "
        "ids (default: a subset of 15 that runs within 10 minutes)",
    )
    launch_parser = sub.add_parser(
        "launch",
        help="start N local workers: launch --workers N -- script.py ...",
        description=launch.DESCRIPTION,
    )
    launch.add_arguments(launch_parser)
    launch_parser.set_defaults(parser=launch_parser)
    return parser


def main(argv=None):
    """Entry point of the `keras-fastloop` console command.

    Args:
        argv: list of strings (default `sys.argv[1:]`).

    Returns:
        int exit code.

    Raises:
        SystemExit: for `--help`, `--version` (code 0) and bad arguments (code 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        return launch.run_parsed(args, args.parser)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before the bench imports TensorFlow
    return _bench(args)
