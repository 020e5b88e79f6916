"""TensorFlow's private pieces we use, in one place: the profiler's op table and the knobs of
a multi-worker start-up.

`keras_fastloop.cluster.multi_worker_strategy` bounds how long a worker waits for its peers.
TensorFlow exposes neither knob publicly: the coordination service's register timeout is set
on the eager context before it starts, and the strategy's first health check (worker 0 waits
there for its peers) reads a class attribute whose default, 0, means forever.
`tests/test_keras_internals.py` fails loudly if a TensorFlow upgrade moves them.
"""

import contextlib
import json


def profiler_op_stats(xplane_paths):
    """TensorFlow's `framework_op_stats` tool (TensorBoard's Profile tab) on `.xplane.pb` traces.

    TensorFlow's profiler plugin (`tensorflow.python.profiler.internal`) has no public Python
    API. Returns the first table as `(column labels, rows of cell values)`.
    """
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    raw, _ = _pywrap_profiler_plugin.xspace_to_tools_data(
        [str(p) for p in xplane_paths], "framework_op_stats", {}
    )
    table = json.loads(raw)
    table = table[0] if isinstance(table, list) else table
    labels = [column.get("label") or column.get("id") for column in table["cols"]]
    rows = [[cell.get("v") if cell else None for cell in row["c"]] for row in table["rows"]]
    return labels, rows


def eager_context_started():
    """Whether TensorFlow's eager context exists (too late to configure coordination)."""
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def configure_worker_coordination(num_workers, register_timeout_ms):
    """Coordination service led by worker 0 that fails when a worker has not registered."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader="/job:worker/replica:0/task:0",
        cluster_register_timeout_in_ms=int(register_timeout_ms),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=int(num_workers))
        ],
    )
    # every worker, the leader too, registers through a barrier bounded by the timeout
    ctx._coordination_service_config.cluster_register_with_barrier = True


@contextlib.contextmanager
def first_health_check_timeout(seconds):
    """`MultiWorkerMirroredStrategy`s created inside give up on absent peers after `seconds`."""
    from tensorflow.python.distribute import collective_all_reduce_strategy

    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    previous = extended._check_health_initial_timeout
    extended._check_health_initial_timeout = max(1, int(seconds))
    try:
        yield
    finally:
        extended._check_health_initial_timeout = previous


__all__ = [
    "configure_worker_coordination",
    "eager_context_started",
    "first_health_check_timeout",
    "profiler_op_stats",
]


def num_workers(strategy):
    """The number of workers of `strategy`: its `extended._num_workers` (TensorFlow's
    multi-worker strategies), 1 for a single-process strategy or none."""
    return int(getattr(getattr(strategy, "extended", None), "_num_workers", 1) or 1)


def set_optional_spec(optional, spec):
    """Sets a `tf.experimental.Optional`'s `_element_spec` (as Keras' own multi-step loop
    does, so that the loop's branches agree on the structure they carry)."""
    optional._element_spec = spec


def dataset_inputs(dataset):
    """The data sets a `tf.data.Dataset` transforms (its private `_inputs()`)."""
    return dataset._inputs()
