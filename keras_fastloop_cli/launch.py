"""Start N local workers for `MultiWorkerMirroredStrategy` (`keras-fastloop launch`).

`keras-fastloop launch --workers 2 -- train.py --epochs 3` runs `python train.py --epochs 3`
twice, each with its own `TF_CONFIG` naming every worker on a free loopback port, prefixes
every line a worker prints with `[worker i]`, and exits non-zero if any worker fails or the
timeout passes (then every worker still running is terminated). The script itself only creates
`tf.distribute.MultiWorkerMirroredStrategy()` — it reads `TF_CONFIG` — before anything else
touches TensorFlow's devices.

On a cluster, the scheduler starts one process per worker (`srun`, a Kubernetes indexed Job or
StatefulSet); there `keras-fastloop launch --cluster -- train.py` builds this process's
`TF_CONFIG` from the scheduler's environment (`keras_fastloop.cluster`), checks it, says which
worker this is and runs the script once. See docs/guide.md, "Running on a cluster".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

DEFAULT_TIMEOUT = 3600.0


def free_ports(n, host="127.0.0.1"):
    """`n` distinct TCP ports free on `host` right now (the OS picks them: bind to port 0).

    Args:
        n: positive int, how many ports.
        host: string, default `"127.0.0.1"`.

    Returns:
        A list of `n` ints.

    Raises:
        ValueError: if `n` is not a positive integer.

    Example:
        >>> len(free_ports(2))
        2
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be a positive integer. Received: n={n!r}")
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(index, ports, host="127.0.0.1"):
    """The `TF_CONFIG` dict of worker `index` in a cluster of local workers.

    Args:
        index: int, this worker's index (worker 0 is the chief).
        ports: list of ints, one port per worker.
        host: string, default `"127.0.0.1"`.

    Returns:
        `{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}`.

    Raises:
        ValueError: if `index` is not a valid worker index.

    Example:
        >>> tf_config(0, [2222, 2223])["cluster"]["worker"]
        ['127.0.0.1:2222', '127.0.0.1:2223']
    """
    if not 0 <= index < len(ports):
        raise ValueError(
            f"`index` must be in [0, {len(ports)}). Received: index={index!r}, ports={ports}"
        )
    return {
        "cluster": {"worker": [f"{host}:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    }


def _stream(pipe, prefix, out, lock):
    for line in iter(pipe.readline, ""):
        with lock:
            out.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
            out.flush()
    pipe.close()


def launch(
    script_args,
    workers=2,
    timeout=DEFAULT_TIMEOUT,
    python=None,
    env=None,
    stdout=None,
    host="127.0.0.1",
):
    """Run `python script_args...` as `workers` local workers and wait for all of them.

    Every worker gets `TF_CONFIG` (cluster of all workers on free loopback ports, its own
    index) and `KERAS_FASTLOOP_WORKER` (its index); its stdout and stderr are streamed to
    `stdout` line by line, prefixed `[worker i] `. If a worker fails, the others are given
    a moment to finish and are then terminated (a collective would wait for the dead worker
    forever).

    Args:
        script_args: list of strings, the script and its arguments (`["train.py", "--x", "1"]`).
        workers: positive int, number of worker processes. Default 2.
        timeout: positive float, seconds before all workers are terminated. Default 3600.
        python: string, the interpreter; default `sys.executable`.
        env: dict of environment variables for the workers; default a copy of `os.environ`.
        stdout: text stream for the prefixed output; default `sys.stdout`.
        host: string, the address workers listen on. Default `"127.0.0.1"`.

    Returns:
        An int exit code: 0 if every worker exited with 0, else the first non-zero worker exit
        code (124 on timeout).

    Raises:
        ValueError: empty `script_args`, a non-positive `workers` or `timeout`.

    Example:
        >>> launch(["train.py", "--epochs", "1"], workers=2, timeout=600)  # doctest: +SKIP
        0
    """
    if not script_args:
        raise ValueError(f"`script_args` must name a script. Received: script_args={script_args!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be a positive integer. Received: workers={workers!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"`timeout` must be a positive number. Received: timeout={timeout!r}")
    out = stdout or sys.stdout
    ports = free_ports(workers, host)
    base_env = dict(os.environ if env is None else env)
    lock = threading.Lock()
    procs, threads = [], []
    for i in range(workers):
        worker_env = dict(base_env)
        worker_env["TF_CONFIG"] = json.dumps(tf_config(i, ports, host))
        worker_env["KERAS_FASTLOOP_WORKER"] = str(i)
        worker_env.setdefault("PYTHONUNBUFFERED", "1")
        proc = subprocess.Popen(
            [python or sys.executable, *script_args],
            env=worker_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        procs.append(proc)
        thread = threading.Thread(
            target=_stream, args=(proc.stdout, f"[worker {i}] ", out, lock), daemon=True
        )
        thread.start()
        threads.append(thread)

    deadline = time.monotonic() + timeout
    failed_at = None
    first_failure = None
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                code = 124
                with lock:
                    out.write(f"[launch] timeout after {timeout:g} s; terminating workers\n")
                break
            if failed_at is None:
                failures = [(i, p.returncode) for i, p in enumerate(procs) if p.poll()]
                if failures:
                    failed_at, first_failure = now, failures[0]
            if failed_at is not None and now - failed_at > 5.0:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in threads:
            t.join(timeout=5)
    if code:
        return code
    for i, p in enumerate(procs):
        if p.returncode != 0:
            with lock:
                out.write(f"[launch] worker {i} exited with code {p.returncode}\n")
    if first_failure is None:
        first_failure = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if first_failure is None:
        return 0
    return first_failure[1] if first_failure[1] > 0 else 1


def launch_cluster(script_args, env=None, port=None, python=None, stdout=None):
    """Run `python script_args...` once as this process's worker of a scheduled cluster.

    `TF_CONFIG` comes from `env` through `keras_fastloop.cluster` (an existing `TF_CONFIG` is
    checked and kept); one line names the worker before the script starts.

    Args:
        script_args: list of strings, the script and its arguments.
        env: dict of environment variables; default a copy of `os.environ`.
        port: int, base port; default `KERAS_FASTLOOP_PORT` or 12345.
        python: string, the interpreter; default `sys.executable`.
        stdout: text stream for the line; default `sys.stdout`.

    Returns:
        The script's exit code.

    Raises:
        ValueError: empty `script_args`; from `keras_fastloop.cluster`: no cluster found, a
            malformed or contradictory environment, this worker's port in use.
    """
    from keras_fastloop import cluster

    if not script_args:
        raise ValueError(f"`script_args` must name a script. Received: script_args={script_args!r}")
    env = dict(os.environ if env is None else env)
    if "TF_CONFIG" in env:
        config = cluster.check_tf_config(env["TF_CONFIG"])
    else:
        config = cluster.tf_config_from_env(env, port)
        cluster.check_tf_config(config)
    env["TF_CONFIG"] = json.dumps(config)
    index, workers = config["task"]["index"], config["cluster"]["worker"]
    env["KERAS_FASTLOOP_WORKER"] = str(index)
    out = stdout or sys.stdout
    out.write(f"[launch] worker {index} of {len(workers)} at {workers[index]}\n")
    out.flush()
    return subprocess.call([python or sys.executable, *script_args], env=env)


def add_arguments(parser):
    """Adds `launch`'s arguments to `parser` (the `launch` sub-command or its own parser).

    Args:
        parser: an `argparse.ArgumentParser`.

    Returns:
        `parser`.
    """
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds (default 3600)"
    )
    parser.add_argument("--python", default=None, help="interpreter (default: this one)")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run once as this process's worker: TF_CONFIG from Slurm, Kubernetes or "
        "KERAS_FASTLOOP_HOSTS/KERAS_FASTLOOP_INDEX",
    )
    parser.add_argument("--hosts", default=None, help="with --cluster: host:port,host:port,...")
    parser.add_argument("--index", type=int, default=None, help="with --hosts: this worker")
    parser.add_argument("--port", type=int, default=None, help="with --cluster: base port")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    return parser


def run_parsed(args, parser):
    """Checks parsed `launch` arguments and runs `launch`; returns its exit code.

    Raises:
        SystemExit: through `parser.error` (code 2) for a missing script, `--workers < 1` or
            `--timeout <= 0`.
    """
    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        parser.error("a script is required: keras-fastloop launch --workers N -- script.py")
    if args.cluster or args.hosts is not None:
        env = dict(os.environ)
        if args.hosts is not None:
            if args.index is None:
                parser.error("--hosts needs --index (this worker's position in the list)")
            env["KERAS_FASTLOOP_HOSTS"], env["KERAS_FASTLOOP_INDEX"] = args.hosts, str(args.index)
        try:
            return launch_cluster(script, env=env, port=args.port, python=args.python)
        except ValueError as e:
            parser.error(str(e))
    if args.workers < 1:
        parser.error(f"--workers must be a positive integer. Received: workers={args.workers}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive. Received: timeout={args.timeout}")
    return launch(script, workers=args.workers, timeout=args.timeout, python=args.python)


DESCRIPTION = "Run a training script as N local MultiWorkerMirroredStrategy workers."


def main(argv=None):
    """Command line: `keras-fastloop launch --workers N [--timeout S] -- script.py [args]`.

    Args:
        argv: list of strings after `launch` (default `sys.argv[1:]`).

    Returns:
        The exit code of `launch` (0 when every worker succeeded).

    Raises:
        SystemExit: on bad arguments (argparse), with code 2.

    Example:
        >>> main(["--workers", "2", "--", "train.py"])  # doctest: +SKIP
        0
    """
    parser = add_arguments(
        argparse.ArgumentParser(prog="keras-fastloop launch", description=DESCRIPTION)
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return run_parsed(args, parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
