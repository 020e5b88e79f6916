"""The checks `compile()` makes before anything changes (the step's own options).

Each raises `ValueError` saying what must hold and `Received: ...`, so a bad argument fails at
`compile`, never in the first step. `keras_fastloop._compile_settings` calls them; the traced
step (`keras_fastloop._step`) never does.
"""

from __future__ import annotations

import math
import numbers

import keras
from keras import tree

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation


def validate_micro_batch_size(micro_batch_size):
    """Check `compile(micro_batch_size=...)`.

    Args:
        micro_batch_size: `None` or a positive Python int (`bool` is rejected).

    Returns:
        `micro_batch_size` unchanged.

    Raises:
        ValueError: for anything else (`0`, negatives, floats, booleans, strings).

    Example:
        >>> validate_micro_batch_size(4)
        4
    """
    return _validation.check_int("micro_batch_size", micro_batch_size, minimum=1, allow_none=True)


def check_loss_identifiers(loss):
    """Fail at `compile()`, not in the first step, for a loss name Keras does not know."""
    for spec in tree.flatten(loss):
        if isinstance(spec, str) and spec.lower() not in ("crossentropy", "ce"):
            try:
                keras.losses.get(spec)
            except (ValueError, TypeError):
                raise ValueError(
                    "Unknown loss identifier: expected a loss name from `keras.losses` (e.g. "
                    "'mse', 'sparse_categorical_crossentropy') or a Loss object. "
                    f"Received: loss={spec!r}"
                ) from None


def check_loss_weights(loss_weights):
    """Every number in `loss_weights` (any structure) must be finite and non-negative.

    Raises:
        ValueError: otherwise, naming the argument as given.
    """
    if loss_weights is None:
        return
    for weight in tree.flatten(loss_weights):
        if weight is None:
            continue
        if not _validation.is_real(weight) or not math.isfinite(weight) or weight < 0:
            raise ValueError(
                "Every entry of `loss_weights` must be a finite, non-negative number. "
                f"Received: loss_weights={loss_weights}"
            )


def unreduced_losses(loss):
    """The compiled loss' entries that return one loss per sample (`reduction=None`/"none")."""
    return [
        spec
        for spec in tree.flatten(loss)
        if isinstance(spec, keras.losses.Loss) and spec.reduction in (None, "none")
    ]


def check_unreduced(loss, micro_batch_size, weighting, num_replicas):
    """Fail at `compile()` for what per-sample losses cannot do here.

    Keras differentiates an unreduced loss' sum and logs its mean; the step does the same on
    one replica with the static weights. Micro-batches, other weighting methods and several
    replicas need one loss value per task and batch.
    """
    unreduced = unreduced_losses(loss)
    if not unreduced:
        return
    needs_scalars = {
        "micro_batch_size": micro_batch_size is not None,
        "loss_weighting": weighting.name != "static",
        "a distribution strategy with several replicas": num_replicas > 1,
    }
    for what, given in needs_scalars.items():
        if given:
            raise ValueError(
                f"{what!s} needs every loss to reduce to one value per batch (reduction "
                "'sum_over_batch_size', 'mean', 'mean_with_sample_weight' or 'sum'). "
                f"Received: loss={unreduced[0]!r} with reduction={unreduced[0].reduction!r}"
            )


def check_keys(argument, value, model):
    """A dict `loss`/`loss_weights` of a functional model may only name its outputs.

    Accepted keys: the output names and, for dict outputs, the dict's keys.

    Raises:
        ValueError: naming the unknown keys and the outputs that exist.
    """
    outputs = internals.outputs_struct(model)
    if not isinstance(value, dict) or outputs is None:
        return
    valid = list(getattr(model, "output_names", None) or [])
    if isinstance(outputs, dict):
        valid += [k for k in outputs if k not in valid]
    unknown = [k for k in value if k not in valid]
    if unknown:
        raise ValueError(
            f"`{argument}` names outputs the model does not have: {unknown}. The model's "
            f"outputs are {valid}. Received: {argument}={value}"
        )


def check_counts(loss, loss_weights, model):
    """A functional model's flat `loss` / `loss_weights` lists need one entry per output.

    Raises:
        ValueError: for a list `loss` or `loss_weights` of the wrong length, or one float
            `loss_weights` for several outputs (Keras would find out only in the first step).
    """
    outputs = internals.outputs_struct(model)
    if outputs is None:
        return
    names = list(getattr(model, "output_names", None) or [])
    count = len(tree.flatten(outputs))
    flat_list = isinstance(loss, (list, tuple)) and not any(tree.is_nested(s) for s in loss)
    if flat_list and len(loss) != count:
        raise ValueError(
            f"`loss` must have one entry per output ({count}: {names}). Received: loss={loss}"
        )
    if _validation.is_real(loss_weights) and count > 1:
        raise ValueError(
            "A single float `loss_weights` is only valid for a single-output model. "
            f"Received: loss_weights={loss_weights}"
        )
    if isinstance(loss_weights, (list, tuple)) and not any(tree.is_nested(w) for w in loss_weights):
        expected = {count}
        if tree.is_nested(loss):  # one weight per entry, or per entry that has a loss
            flat = tree.flatten(loss)
            expected = {len(flat), len([spec for spec in flat if spec is not None])}
        if len(loss_weights) not in expected:
            raise ValueError(
                f"`loss_weights` must have one entry per output ({count}: {names}). "
                f"Received: loss_weights={loss_weights}"
            )


def validate_sam(sam_rho, sam_adaptive):
    """Check `compile(sam_rho=..., sam_adaptive=...)`; returns `(rho or None, adaptive)`.

    Raises:
        ValueError: `sam_rho` not `None` nor a finite real number > 0 (`bool` refused), or
            `sam_adaptive` not a bool, or `sam_adaptive=True` without `sam_rho`.
    """
    if not isinstance(sam_adaptive, bool):
        raise ValueError(
            f"`sam_adaptive` must be True or False. Received: sam_adaptive={sam_adaptive!r}"
        )
    if sam_rho is None:
        if sam_adaptive:
            raise ValueError(
                "`sam_adaptive=True` needs the neighbourhood radius `sam_rho` (e.g. 0.5 for "
                "ASAM). Received: sam_adaptive=True, sam_rho=None"
            )
        return None, False
    if (
        isinstance(sam_rho, bool)
        or not isinstance(sam_rho, numbers.Real)
        or not math.isfinite(sam_rho)
        or sam_rho <= 0
    ):
        raise ValueError(
            "`sam_rho` must be None or a finite number > 0 (the radius of the weight "
            f"perturbation, e.g. 0.05). Received: sam_rho={sam_rho!r}"
        )
    return float(sam_rho), sam_adaptive


def check_sam_compatible(class_name, overrides_train_step, weighting, sam_rho):
    """`sam_rho` needs the library's `train_step` and a weighting without per-task gradients.

    Raises:
        ValueError: a class with its own `train_step`, or a gradient-based loss weighting.
    """
    if overrides_train_step:
        raise ValueError(
            f"`sam_rho` needs the library's `train_step` (two gradients of the same batch), and "
            f"{class_name} has its own. Call `super().train_step(data)` from it, or take the "
            f"two passes in it. Received: sam_rho={sam_rho!r}"
        )
    if weighting.requires_task_gradients:
        raise ValueError(
            f"`sam_rho` cannot be combined with the gradient-based loss weighting "
            f"'{weighting.name}' (its weights would be decided from two gradients per step). "
            f"Received: sam_rho={sam_rho!r}, loss_weighting={weighting.name!r}"
        )


def check_overwritten_variables(model, optimizer, weighting, loss_weighting):
    """Refuse what cannot train a model with overwritten variables (float8 scales and amax
    histories, `overwrite_with_gradient=True`) in `compile()`: a gradient-based loss
    weighting would combine their values as per-task gradients, and an optimizer with
    `use_ema=True` keeps no average for them (Keras' `fit` then fails at its end).

    Raises:
        ValueError: the built model has such a variable and `weighting` needs per-task
            gradients or the optimizer (or a `LossScaleOptimizer`'s inner one) has
            `use_ema=True`.
    """
    if not model.built:
        return
    paths = [
        v.path for v in model.trainable_variables if getattr(v, "overwrite_with_gradient", False)
    ]
    if not paths:
        return
    received = f"variables={paths[:3]}" + (" ..." if len(paths) > 3 else "")
    if weighting.requires_task_gradients:
        raise ValueError(
            f"Loss weighting '{weighting.name}' combines per-task gradients, and this model "
            "has variables the optimizer overwrites with their gradient (float8 scales and "
            "amax histories, `model.quantize('float8')`), which are not gradients. Use static "
            "`loss_weights` or a loss-based method (`uw`, `dwa`, `rlw`, `famo`). "
            f"Received: loss_weighting={loss_weighting!r}, {received}"
        )
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "use_ema", False):
        raise ValueError(
            "An optimizer with `use_ema=True` cannot train a model with float8 layers: Keras "
            "keeps no moving average for their scales and amax histories, and `fit` fails "
            "at its end when it copies the averages into the model (keras.Model too). "
            "Compile with `use_ema=False`, or quantize after training. "
            f"Received: optimizer={type(inner).__name__}(use_ema=True), {received}"
        )


__all__ = [
    "validate_micro_batch_size",
    "check_loss_identifiers",
    "check_loss_weights",
    "unreduced_losses",
    "check_unreduced",
    "check_keys",
    "check_counts",
    "validate_sam",
    "check_sam_compatible",
    "check_overwritten_variables",
]
