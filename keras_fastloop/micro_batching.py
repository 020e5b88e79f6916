"""In-step micro-batching (being written)."""


def validate_micro_batch_size(micro_batch_size):
    """Return ``micro_batch_size`` if it is ``None`` or a positive int, else raise ValueError."""
    if micro_batch_size is None:
        return None
    if (
        isinstance(micro_batch_size, bool)
        or not isinstance(micro_batch_size, int)
        or micro_batch_size < 1
    ):
        raise ValueError(
            "`micro_batch_size` must be None or a positive integer. "
            f"Received: micro_batch_size={micro_batch_size!r}"
        )
    return micro_batch_size


def accumulate(model, x, y, sample_weight, variables, micro_batch_size):
    raise NotImplementedError
