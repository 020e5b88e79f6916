"""``keras-fastloop`` command line: ``bench`` (the main job) and ``launch`` (multi-worker)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

# Suite name -> module under keras_fastloop.bench exposing run(out_dir, quick=False) -> dict.
SUITES = {
    "default": "default",
    "multitask": "multitask",
    "bucketing": "bucketing",
    "micro-batching": "micro_batching",
    "distributed": "distributed",
    "seed-table": "seed_table",
}


def _bench(args):
    out_dir = Path(args.out)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    for name in names:
        module = importlib.import_module(f"keras_fastloop.bench.{SUITES[name]}")
        t0 = time.perf_counter()
        kwargs = {"quick": args.quick}
        if args.profile and name == "seed-table":
            kwargs["profile"] = args.profile
        result = module.run(out_dir, **kwargs)
        print(result["markdown"])
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s; report in {out_dir}/")
    return 0


def main(argv=None):
    """Entry point of the ``keras-fastloop`` console command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from keras_fastloop import launch

        return launch.main(argv[1:])
    parser = argparse.ArgumentParser(prog="keras-fastloop")
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
    sub.add_parser("launch", help="start N local workers: launch --workers N -- script.py ...")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
