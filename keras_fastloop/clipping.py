"""Gradient clipping applied once, to the aggregated and unscaled gradient.

`compile(gradient_clipping=...)` takes `None`, a float (global-norm clipping at that value),
or one of the objects below. `OptimizedModel` calls the clipper after the
gradients are summed across replicas and divided by the loss scale, so the update that is applied
obeys the threshold (Keras' own `clipnorm`/`global_clipnorm` act per replica before the sum).

Every clipper is a callable `clipper(grads, variables, global_norm) -> grads` where `grads` and
`variables` are equally long lists and `global_norm` is the float32 scalar global norm of
`grads` (computed once by the step). An `Embedding`'s gradient arrives as a `tf.IndexedSlices`
whose rows are unique (the step passes it through `deduplicate` first), so norms and
element-wise clipping are those of the dense gradient; the clippers keep it sparse.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _validation
from keras_fastloop._replicas import state_variable

if TYPE_CHECKING:
    from typing_extensions import Self

    # A list of per-variable gradients, dense or sparse (an `Embedding`'s `IndexedSlices`).
    Gradients = list[tf.Tensor | tf.IndexedSlices]

_PACKAGE = "keras_fastloop"

__all__ = [
    "AdaptiveGradientClipping",
    "AutoClip",
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "GradientClipping",
    "deduplicate",
    "get",
]


def deduplicate(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor | tf.IndexedSlices:
    """The same gradient with each row of an `IndexedSlices` present once.

    An `Embedding`'s gradient is a `tf.IndexedSlices` with one row per looked-up id, so an id
    that occurs `k` times contributes `k` rows whose sum is the dense gradient's row. Norms
    (and element-wise clipping) of the raw slices are not those of the gradient: this sums the
    duplicate rows (`tf.math.unsorted_segment_sum` over the unique ids), without densifying the
    table. Dense tensors are returned unchanged.

    Args:
        gradient: a tensor or `tf.IndexedSlices`.

    Returns:
        A tensor, or `tf.IndexedSlices` with unique `indices`.
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    unique, position = tf.unique(gradient.indices)
    rows = tf.math.unsorted_segment_sum(gradient.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(rows, unique, gradient.dense_shape)


def deduplicated_norm(grads):
    """`(unique_rows, norm)`: every gradient through `deduplicate`, and their global L2 norm.

    Norms and clipping see each embedding row once (duplicate ids summed); the norm is
    `tf.linalg.global_norm`'s, float32 scalar.
    """
    unique_rows = [deduplicate(g) for g in grads]
    return unique_rows, tf.linalg.global_norm(unique_rows)


def _positive(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"`{name}` must be a positive, finite number. Received: {name}={value!r}")
    return float(value)


class GradientClipping:
    """Base class of the clippers; subclasses implement `__call__`.

    Stateful clippers (`AutoClip`) create their variables in `build(owner)` with
    `owner.add_weight`; the model calls it in `compile()` (under the active distribution
    strategy) with the layer that holds the step's state, so the variables are saved, restored by
    `BackupAndRestore` and identical on every replica.
    """

    def build(self, owner: keras.layers.Layer) -> None:
        """Create state variables on the Keras layer `owner` (no-op for stateless clippers)."""

    @property
    def variables(self) -> list[keras.Variable]:
        return []

    def __call__(
        self,
        grads: Gradients,
        variables: list[keras.Variable],
        global_norm: tf.Tensor,
    ) -> Gradients:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ClipByGlobalNorm(GradientClipping):
    """Scale all gradients together so their global L2 norm is at most `clipnorm`.

    `g_i <- g_i * clipnorm / max(global_norm, clipnorm)`, the same as `tf.clip_by_global_norm`
    and Keras' `global_clipnorm`, but on the gradient that is actually applied.

    Args:
        clipnorm: positive float, the largest global norm allowed.

    Raises:
        ValueError: if `clipnorm` is not a positive number.

    Example:
        >>> clip = ClipByGlobalNorm(1.0)   # or compile(gradient_clipping=1.0)

    Reference:
        Pascanu, Mikolov & Bengio, "On the difficulty of training recurrent neural networks",
        ICML 2013.
    """

    def __init__(self, clipnorm: float) -> None:
        self.clipnorm = _positive("clipnorm", clipnorm)

    def __call__(
        self,
        grads: Gradients,
        variables: list[keras.Variable],
        global_norm: tf.Tensor,
    ) -> Gradients:
        clipped, _ = tf.clip_by_global_norm(grads, self.clipnorm, use_norm=global_norm)
        return clipped

    def get_config(self) -> dict[str, Any]:
        return {"clipnorm": self.clipnorm}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ClipByNorm(GradientClipping):
    """Clip each variable's gradient to an L2 norm of at most `clipnorm` (Keras' `clipnorm`).

    Args:
        clipnorm: positive float, the largest norm allowed per variable.

    Raises:
        ValueError: if `clipnorm` is not a positive number.
    """

    def __init__(self, clipnorm: float) -> None:
        self.clipnorm = _positive("clipnorm", clipnorm)

    def __call__(
        self,
        grads: Gradients,
        variables: list[keras.Variable],
        global_norm: tf.Tensor,
    ) -> Gradients:
        return [tf.clip_by_norm(g, self.clipnorm) for g in grads]

    def get_config(self) -> dict[str, Any]:
        return {"clipnorm": self.clipnorm}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ClipByValue(GradientClipping):
    """Clip every gradient element to `[-clipvalue, clipvalue]` (Keras' `clipvalue`).

    Args:
        clipvalue: positive float.

    Raises:
        ValueError: if `clipvalue` is not a positive number.
    """

    def __init__(self, clipvalue: float) -> None:
        self.clipvalue = _positive("clipvalue", clipvalue)

    def __call__(
        self,
        grads: Gradients,
        variables: list[keras.Variable],
        global_norm: tf.Tensor,
    ) -> Gradients:
        return [
            _map_values(g, lambda t: ops.clip(t, -self.clipvalue, self.clipvalue)) for g in grads
        ]

    def get_config(self) -> dict[str, Any]:
        return {"clipvalue": self.clipvalue}


def _map_values(gradient, fn):
    """`fn` on a dense gradient, or on the rows of an `IndexedSlices` (kept sparse)."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
    return fn(gradient)


def unitwise_norm(x: tf.Tensor) -> tf.Tensor:
    """L2 norm per output unit, broadcastable to `x`.

    Vectors and scalars (biases, gains) count as one unit; for a kernel of shape
    `(..., units)` (Dense `(in, out)`, Conv `(kh, kw, in, out)`) each slice along the last
    axis is a unit, so the norm is taken over all other axes.
    """
    if len(x.shape) <= 1:
        return ops.sqrt(ops.sum(ops.square(x)))
    axes = tuple(range(len(x.shape) - 1))
    return ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=True))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AdaptiveGradientClipping(GradientClipping):
    """Unit-wise adaptive gradient clipping (AGC).

    For every unit `i` of every variable `W` with gradient `G`:
    `G_i <- G_i * clip_factor * max(|W_i|, eps) / |G_i|` when
    `|G_i| / max(|W_i|, eps) > clip_factor` (norms are L2, see `unitwise_norm`).

    Args:
        clip_factor: positive float, the largest allowed ratio of gradient norm to parameter norm.
            Default 0.01 (the paper's value for batch size 4096; larger batches want smaller).
        eps: positive float, floor on the parameter norm so zero-initialised parameters can move.
            Default 1e-3.

    Raises:
        ValueError: if `clip_factor` or `eps` is not a positive number.

    Reference:
        Brock, De, Smith & Simonyan, "High-Performance Large-Scale Image Recognition Without
        Normalization", ICML 2021 (NFNets), section 4.1.
    """

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3) -> None:
        self.clip_factor = _positive("clip_factor", clip_factor)
        self.eps = _positive("eps", eps)

    def __call__(
        self,
        grads: Gradients,
        variables: list[keras.Variable],
        global_norm: tf.Tensor,
    ) -> Gradients:
        clipped = []
        for g, v in zip(grads, variables):
            w = ops.cast(v, g.dtype)
            max_norm = self.clip_factor * ops.maximum(unitwise_norm(w), self.eps)
            # An IndexedSlices' values have the variable's rank and its unique rows: the norm
            # over the rows present is the dense gradient's (absent rows are zero).
            values = g.values if isinstance(g, tf.IndexedSlices) else g
            g_norm = unitwise_norm(values)
            # Divide by a safe norm; where the gradient is under the threshold keep it as is.
            factor = ops.where(g_norm > max_norm, max_norm / ops.maximum(g_norm, 1e-6), 1.0)
            clipped.append(_map_values(g, lambda t, f=factor: t * f))
        return clipped

    def get_config(self) -> dict[str, Any]:
        return {"clip_factor": self.clip_factor, "eps": self.eps}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AutoClip(GradientClipping):
    """Clip at a percentile of the history of gradient norms (AutoClip).

    Every step appends the current global gradient norm to a history kept in variables (so it is
    checkpointed and restored with the model), then clips the global norm at the
    `percentile`-th percentile of the history (linear interpolation, as `numpy.percentile`).
    Non-finite norms are not recorded (those steps are skipped by the step's guard).

    Args:
        percentile: float in (0, 100], the percentile of past norms used as threshold.
            Default 10.0 (the paper's recommendation).
        history_size: positive int, how many recent norms are kept (a ring buffer). Default 10000.

    Raises:
        ValueError: if `percentile` is outside (0, 100] or `history_size` is not a
            positive integer.

    Reference:
        Seetharaman, Wichern, Pardo & Le Roux, "AutoClip: Adaptive Gradient Clipping for Source
        Separation Networks", IEEE MLSP 2020.
    """

    def __init__(self, percentile: float = 10.0, history_size: int = 10000) -> None:
        if not _validation.is_real(percentile) or not 0 < percentile <= 100:
            raise ValueError(
                f"`percentile` must be a number in (0, 100]. Received: percentile={percentile!r}"
            )
        if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
            raise ValueError(
                "`history_size` must be a positive integer. "
                f"Received: history_size={history_size!r}"
            )
        self.percentile = float(percentile)
        self.history_size = history_size
        self.history = None
        self.count = None

    def build(self, owner: keras.layers.Layer) -> None:
        if self.history is not None:
            return
        self.history = state_variable(owner, "autoclip_history", (self.history_size,))
        self.count = state_variable(owner, "autoclip_count", dtype="int64")

    @property
    def variables(self) -> list[keras.Variable]:
        return [] if self.history is None else [self.history, self.count]

    def threshold(self, global_norm: tf.Tensor) -> tf.Tensor:
        """Record `global_norm` (if finite) and return the current clipping threshold."""
        finite = ops.isfinite(global_norm)
        slot = ops.cast(self.count % self.history_size, "int32")
        recorded = ops.where(finite, global_norm, self.history[slot])
        self.history.assign(ops.scatter_update(self.history, [[slot]], ops.reshape(recorded, (1,))))
        self.count.assign_add(ops.cast(finite, "int64"))
        n = ops.cast(ops.minimum(ops.maximum(self.count, 1), self.history_size), "int32")
        values = ops.sort(self.history[:n])
        position = (self.percentile / 100.0) * ops.cast(n - 1, "float32")
        lower = ops.cast(ops.floor(position), "int32")
        upper = ops.minimum(lower + 1, n - 1)
        frac = position - ops.cast(lower, "float32")
        return values[lower] + frac * (values[upper] - values[lower])

    def __call__(
        self,
        grads: Gradients,
        variables: list[keras.Variable],
        global_norm: tf.Tensor,
    ) -> Gradients:
        # A percentile of 0 (e.g. zero-gradient batches so far) would make 0/0: floor it, so a
        # zero gradient stays zero and anything larger is scaled to (almost) nothing.
        threshold = ops.maximum(self.threshold(global_norm), 1e-12)
        clipped, _ = tf.clip_by_global_norm(grads, threshold, use_norm=global_norm)
        return clipped

    def get_config(self) -> dict[str, Any]:
        return {"percentile": self.percentile, "history_size": self.history_size}


# String ids (Keras' snake_case of the class name) of the clippers that have defaults for every
# argument; a threshold-based clipper needs its threshold, so a bare name is refused.
_IDS = {"adaptive_gradient_clipping": AdaptiveGradientClipping, "auto_clip": AutoClip}
_NEED_A_THRESHOLD = {
    "clip_by_global_norm": "ClipByGlobalNorm(clipnorm)",
    "clip_by_norm": "ClipByNorm(clipnorm)",
    "clip_by_value": "ClipByValue(clipvalue)",
}


def _normalized(name):
    """`"AutoClip"`, `"auto_clip"` and `"autoclip"` all read `"autoclip"`."""
    return name.replace("_", "").lower()


_ID_OF = {_normalized(k): k for k in (*_IDS, *_NEED_A_THRESHOLD)}


def get(
    identifier: GradientClipping | float | str | dict[str, Any] | None,
) -> GradientClipping | None:
    """Resolve `compile(gradient_clipping=...)`, as `keras.losses.get` resolves a loss.

    Args:
        identifier: `None` (no clipping); a positive float (global-norm clipping at that
            value, numpy scalars included); a string id, `"auto_clip"` or
            `"adaptive_gradient_clipping"` (the class name and the id without underscores
            also work), built with its defaults; a `GradientClipping` instance; or a config
            dict from `keras.saving`.

    Returns:
        A `GradientClipping` instance, or `None` for `None`.

    Raises:
        ValueError: for a non-positive number, an unknown string id, or the id of a clipper
            that needs a threshold (`"clip_by_global_norm"`: pass the number instead).
        TypeError: for anything else.
    """
    if identifier is None or isinstance(identifier, GradientClipping):
        return identifier
    if _validation.is_real(identifier):
        if not 0 < identifier < float("inf"):  # name what the caller passed, not `clipnorm`
            raise ValueError(
                "`gradient_clipping` as a number is a global-norm threshold and must be "
                f"positive and finite. Received: gradient_clipping={identifier!r}"
            )
        return ClipByGlobalNorm(identifier)
    if isinstance(identifier, str):
        key = _ID_OF.get(_normalized(identifier))
        if key in _IDS:
            return _IDS[key]()
        if key in _NEED_A_THRESHOLD:
            raise ValueError(
                f"`gradient_clipping={identifier!r}` needs its threshold: pass "
                f"`{_NEED_A_THRESHOLD[key]}` (or a float for global-norm clipping). "
                f"Received: gradient_clipping={identifier!r}"
            )
        raise ValueError(
            f"Unknown `gradient_clipping` id. Expected one of {sorted(_IDS)}, a float or a "
            f"keras_fastloop.clipping object. Received: gradient_clipping={identifier!r}"
        )
    if isinstance(identifier, dict):
        obj = keras.saving.deserialize_keras_object(identifier)
        if isinstance(obj, GradientClipping):
            return obj
    raise TypeError(
        "`gradient_clipping` must be None, a positive float (global-norm threshold), a string id "
        f"({', '.join(sorted(_IDS))}) or a keras_fastloop.clipping object (ClipByGlobalNorm, "
        "ClipByNorm, ClipByValue, AdaptiveGradientClipping, AutoClip). "
        f"Received: gradient_clipping={identifier!r}"
    )
