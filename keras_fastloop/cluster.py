"""`TF_CONFIG` for `MultiWorkerMirroredStrategy` from Slurm, Kubernetes or an explicit host list.

`configure()` (or `keras-fastloop launch --cluster auto -- train.py`) reads the environment the
scheduler gives each process, builds `TF_CONFIG` (`{"cluster": {"worker": [...]}, "task":
{"type": "worker", "index": i}}`), checks it and sets it, before the script creates the strategy:

- Slurm (`SLURM_JOB_NODELIST`, `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_TASKS_PER_NODE`, one
  task per worker, block distribution): worker `i` listens on its node at `port + local id`.
- Kubernetes indexed Job or StatefulSet: the index is `JOB_COMPLETION_INDEX` or the ordinal
  suffix of `HOSTNAME` (`<name>-<index>`); worker `i` is `<name>-<i>.<service>:<port>` (the
  headless service, `KERAS_FASTLOOP_SERVICE`); the number of workers is
  `KERAS_FASTLOOP_WORKERS`.
- An explicit list: `KERAS_FASTLOOP_HOSTS="host:port,host:port"` and `KERAS_FASTLOOP_INDEX`.

Bad input (an address named twice, a missing or out-of-range index, this worker's port in use)
raises `ValueError` before any training.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket

__all__ = [
    "DEFAULT_PORT",
    "check_tf_config",
    "configure",
    "expand_slurm_nodelist",
    "multi_worker_strategy",
    "tf_config_from_env",
]

DEFAULT_PORT = 12345


def expand_slurm_nodelist(nodelist: str) -> list:
    """The host names of a Slurm node list, in order (`"node[01-03,07],gpu1"` → 5 names).

    Args:
        nodelist: string, `SLURM_JOB_NODELIST` (comma-separated names, each with optional
            bracketed ranges `[a-b,c]`, zero padding kept).

    Returns:
        A list of strings.

    Raises:
        ValueError: unbalanced brackets, an empty name or a decreasing range.

    Example:
        >>> expand_slurm_nodelist("node[01-03,07],gpu1")
        ['node01', 'node02', 'node03', 'node07', 'gpu1']
    """
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ValueError(f"`nodelist` must be a non-empty string. Received: nodelist={nodelist!r}")
    names, depth, start = [], 0, 0
    for i, c in enumerate(nodelist + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise ValueError(
                f"Unbalanced brackets in the node list. Received: nodelist={nodelist!r}"
            )
        if c == "," and depth == 0:
            names.extend(_expand_name(nodelist[start:i].strip(), nodelist))
            start = i + 1
    if depth:
        raise ValueError(f"Unbalanced brackets in the node list. Received: nodelist={nodelist!r}")
    return names


def _expand_name(name, nodelist):
    if not name:
        raise ValueError(f"The node list holds an empty name. Received: nodelist={nodelist!r}")
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    prefix, rest = name[: match.start()], name[match.end() :]
    values = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(
                f"Bad range {part!r} in the node list. Received: nodelist={nodelist!r}"
            )
        width = len(lo)
        values += [str(v).zfill(width) for v in range(int(lo), int(hi or lo) + 1)]
    return [n for v in values for n in _expand_name(prefix + v + rest, nodelist)]


def _tasks_per_node(spec, nodes):
    """`SLURM_TASKS_PER_NODE` (`"2(x3),1"`) as one count per node."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"Bad SLURM_TASKS_PER_NODE. Received: SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != nodes:
        raise ValueError(
            "SLURM_TASKS_PER_NODE must give one count per node of SLURM_JOB_NODELIST. "
            f"Received: SLURM_TASKS_PER_NODE={spec!r} for {nodes} nodes"
        )
    return counts


def _int(env, name):
    value = env.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be set to an integer. Received: {name}={value!r}")
    return int(value)


def _config(workers, index):
    return {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}


def _from_slurm(env, port):
    nodes = expand_slurm_nodelist(env["SLURM_JOB_NODELIST"])
    distribution = env.get("SLURM_DISTRIBUTION", "block")
    if not distribution.startswith("block"):
        raise ValueError(
            "Only Slurm's block task distribution maps task ids to nodes here. "
            f"Received: SLURM_DISTRIBUTION={distribution!r}"
        )
    ntasks = _int(env, "SLURM_NTASKS")
    per_node = _tasks_per_node(env.get("SLURM_TASKS_PER_NODE", str(ntasks)), len(nodes))
    workers = [f"{node}:{port + local}" for node, n in zip(nodes, per_node) for local in range(n)]
    if len(workers) != ntasks:
        raise ValueError(
            "SLURM_TASKS_PER_NODE must add up to SLURM_NTASKS. "
            f"Received: SLURM_NTASKS={ntasks}, SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')!r}"
        )
    return _config(workers, _int(env, "SLURM_PROCID"))


def _from_kubernetes(env, port):
    hostname = env.get("HOSTNAME", "")
    match = re.fullmatch(r"(.+)-(\d+)", hostname)
    if "JOB_COMPLETION_INDEX" in env:
        index = _int(env, "JOB_COMPLETION_INDEX")
        name = hostname[: -len(f"-{index}")] if hostname.endswith(f"-{index}") else None
    elif match is not None:
        name, index = match.group(1), int(match.group(2))
    else:
        name, index = None, None
    if index is None or not name:
        raise ValueError(
            "A Kubernetes worker needs its index: JOB_COMPLETION_INDEX (indexed Job) or a "
            "HOSTNAME ending in -<ordinal> (StatefulSet, indexed Job pod). "
            f"Received: HOSTNAME={hostname!r}, JOB_COMPLETION_INDEX={env.get('JOB_COMPLETION_INDEX')!r}"
        )
    workers = _int(env, "KERAS_FASTLOOP_WORKERS")
    service = env.get("KERAS_FASTLOOP_SERVICE", "")
    template = env.get(
        "KERAS_FASTLOOP_ADDRESS",
        "{name}-{index}.{service}:{port}" if service else "{name}-{index}:{port}",
    )
    addresses = [
        template.format(name=name, index=i, service=service, port=port, port_index=port + i)
        for i in range(workers)
    ]
    return _config(addresses, index)


def _from_hosts(env):
    hosts = [h.strip() for h in env["KERAS_FASTLOOP_HOSTS"].split(",") if h.strip()]
    return _config(hosts, _int(env, "KERAS_FASTLOOP_INDEX"))


def tf_config_from_env(env: dict | None = None, port: int | None = None) -> dict:
    """The `TF_CONFIG` dict of this process, from the scheduler's environment variables.

    Looks, in order, for `KERAS_FASTLOOP_HOSTS` (explicit list), Slurm (`SLURM_JOB_NODELIST`
    with `SLURM_PROCID`), Kubernetes (`KERAS_FASTLOOP_WORKERS` with `JOB_COMPLETION_INDEX` or
    `HOSTNAME`); see the module docstring for each one's variables.

    Args:
        env: mapping of environment variables; default `os.environ`.
        port: int, the base port (Slurm: plus the task's local id). Default
            `KERAS_FASTLOOP_PORT` or 12345.

    Returns:
        The `TF_CONFIG` dict, checked with `check_tf_config(..., check_port=False)`.

    Raises:
        ValueError: no cluster found in `env`, or one of its variables missing or malformed.

    Example:
        >>> env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
        ...        "SLURM_TASKS_PER_NODE": "1(x2)"}
        >>> tf_config_from_env(env, port=2222)["cluster"]["worker"]
        ['n1:2222', 'n2:2222']
    """
    env = os.environ if env is None else env
    if port is None:
        port = int(env.get("KERAS_FASTLOOP_PORT", DEFAULT_PORT))
    if "KERAS_FASTLOOP_HOSTS" in env:
        config = _from_hosts(env)
    elif "SLURM_JOB_NODELIST" in env and "SLURM_PROCID" in env:
        config = _from_slurm(env, port)
    elif "KERAS_FASTLOOP_WORKERS" in env:
        config = _from_kubernetes(env, port)
    else:
        raise ValueError(
            "No cluster found in the environment: set KERAS_FASTLOOP_HOSTS and "
            "KERAS_FASTLOOP_INDEX, run under Slurm (SLURM_JOB_NODELIST, SLURM_PROCID) or set "
            "KERAS_FASTLOOP_WORKERS on Kubernetes. Received: none of these variables"
        )
    check_tf_config(config, check_port=False)
    return config


def check_tf_config(config: dict | str, check_port: bool = True) -> dict:
    """Checks a `TF_CONFIG` for a worker cluster; raises before any training if it cannot work.

    Args:
        config: dict or JSON string, the `TF_CONFIG`.
        check_port: bool, also check that this worker's port is free here (binding it). Default
            True.

    Returns:
        The config as a dict.

    Raises:
        ValueError: malformed JSON, no workers, an address named twice, a missing or
            out-of-range index, an address without a port, or this worker's port in use.

    Example:
        >>> check_tf_config({"cluster": {"worker": ["a:1", "a:1"]},
        ...                  "task": {"type": "worker", "index": 0}})
        Traceback (most recent call last):
        ...
        ValueError: TF_CONFIG must name each worker address once. Received: 'a:1' twice
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"TF_CONFIG must be JSON. Received: TF_CONFIG={config!r} ({e})"
            ) from None
    workers = (config.get("cluster") or {}).get("worker") or []
    if not workers:
        raise ValueError(f"TF_CONFIG must list the workers in cluster.worker. Received: {config!r}")
    for address in workers:
        if workers.count(address) > 1:
            raise ValueError(
                f"TF_CONFIG must name each worker address once. Received: {address!r} twice"
            )
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Each worker address must be host:port. Received: {address!r}")
    task = config.get("task") or {}
    index = task.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(workers):
        raise ValueError(
            f"TF_CONFIG's task.index must be an integer in [0, {len(workers)}). "
            f"Received: task={task!r}"
        )
    if check_port:
        port = int(str(workers[index]).rpartition(":")[2])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(
                        f"This worker's port is in use on this machine; another process (or "
                        f"another worker of this host) holds it. Received: worker {index} = "
                        f"{workers[index]!r}"
                    ) from None
                raise
    return config


def configure(env: dict | None = None, port: int | None = None) -> dict:
    """Sets `os.environ["TF_CONFIG"]` from the scheduler (`tf_config_from_env`) and checks it.

    An existing `TF_CONFIG` is checked and kept. Call before creating the strategy.

    Args:
        env: mapping of environment variables; default `os.environ`.
        port: int, the base port; see `tf_config_from_env`.

    Returns:
        The `TF_CONFIG` dict.

    Raises:
        ValueError: see `tf_config_from_env` and `check_tf_config`.

    Example:
        >>> configure()  # doctest: +SKIP
    """
    env = os.environ if env is None else env
    if "TF_CONFIG" in env:
        config = check_tf_config(env["TF_CONFIG"])
    else:
        config = tf_config_from_env(env, port)
        check_tf_config(config)
    os.environ["TF_CONFIG"] = json.dumps(config)
    return config


def multi_worker_strategy(connect_timeout: float = 60.0, communication_options=None):
    """`tf.distribute.MultiWorkerMirroredStrategy` that fails when a worker never connects.

    Sets `TF_CONFIG` with `configure()` when it is not set, then configures TensorFlow's
    coordination service to give up after `connect_timeout` seconds if not every worker has
    registered, instead of waiting forever. Call it before anything else touches TensorFlow's
    devices, where the script would create the strategy.

    Args:
        connect_timeout: positive float, seconds to wait for all workers. Default 60.
        communication_options: a `tf.distribute.experimental.CommunicationOptions` or `None`,
            passed to the strategy (e.g. `timeout_seconds` for each collective).

    Returns:
        The strategy.

    Raises:
        ValueError: a non-positive `connect_timeout`; see `configure`.
        RuntimeError: TensorFlow's context was initialized before this call (too late to set
            the timeout).
        tf.errors.DeadlineExceededError / UnavailableError: from TensorFlow, when a worker
            did not connect in time.

    Example:
        >>> strategy = multi_worker_strategy(connect_timeout=60)  # doctest: +SKIP
    """
    import tensorflow as tf

    from keras_fastloop import _tf_internals as internals

    if isinstance(connect_timeout, bool) or not connect_timeout > 0:
        raise ValueError(
            f"`connect_timeout` must be a positive number. Received: connect_timeout={connect_timeout!r}"
        )
    config = configure()
    if internals.eager_context_started():
        raise RuntimeError(
            "multi_worker_strategy must run before TensorFlow's context starts (before any "
            "op, device listing or other strategy). Received: an initialized context"
        )
    internals.configure_worker_coordination(
        len(config["cluster"]["worker"]), register_timeout_ms=connect_timeout * 1000
    )
    # worker 0 hosts the service, then waits for its peers in a first health check
    with internals.first_health_check_timeout(connect_timeout):
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=communication_options
        )
