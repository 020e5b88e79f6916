"""TensorFlow's private knobs for a multi-worker start-up, in one place.

`keras_fastloop.cluster.multi_worker_strategy` bounds how long a worker waits for its peers.
TensorFlow exposes neither knob publicly: the coordination service's register timeout is set
on the eager context before it starts, and the strategy's first health check (worker 0 waits
there for its peers) reads a class attribute whose default, 0, means forever.
`tests/test_keras_internals.py` fails loudly if a TensorFlow upgrade moves them.
"""

import contextlib


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


__all__ = ["configure_worker_coordination", "eager_context_started", "first_health_check_timeout"]
