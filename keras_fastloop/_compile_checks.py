"""The checks `compile()` makes before anything changes (the step's own options).

Each raises `ValueError` saying what must hold and `Received: ...`, so a bad argument fails at
`compile`, never in the first step. `keras_fastloop._compile_settings` calls them; the traced
step (`keras_fastloop._step`) never does.
"""

from __future__ import annotations

import math
import numbers
import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation
from keras_fastloop._warnings import FastloopWarning


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


def check_remat_scopes(model):
    """The `keras.RematScope` arguments the model's layers were built under, checked at compile.

    Keras checks `mode` when the scope is made but not `output_size_threshold` or
    `layer_names`, which would fail (or act on nothing) deep inside the first step.

    Raises:
        ValueError: `output_size_threshold` not a non-negative integer (`"larger_than"`), or
            `layer_names` not a list of strings (`"list_of_layers"`).

    Warns:
        FastloopWarning: a `"list_of_layers"` scope none of whose `layer_names` is the name of
            a layer built under it (it rematerializes nothing).
    """
    found = internals.remat_modes(model)
    for layer_name, remat_mode in found:
        if remat_mode.mode == "larger_than":
            threshold = remat_mode.output_size_threshold
            if not _validation.is_int(threshold) or threshold < 0:
                _validation.fail(
                    "output_size_threshold",
                    'a non-negative integer (the `keras.RematScope(mode="larger_than")` '
                    f"layer '{layer_name}' was built under)",
                    threshold,
                )
        elif remat_mode.mode == "list_of_layers":
            names = remat_mode.layer_names
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                _validation.fail(
                    "layer_names",
                    "a list of layer names (strings) (the `keras.RematScope(mode="
                    f"\"list_of_layers\")` layer '{layer_name}' was built under)",
                    names,
                )
    scopes = {}
    for layer_name, remat_mode in found:
        if remat_mode.mode == "list_of_layers":
            # one RematMode per layer: scopes made with the same arguments count as one
            key = tuple(remat_mode.layer_names)
            scopes.setdefault(key, (remat_mode, set()))[1].add(layer_name)
    for remat_mode, built in scopes.values():
        if not built & set(remat_mode.layer_names):
            warnings.warn(
                'A `keras.RematScope(mode="list_of_layers")` names no layer built under it, so '
                f"it rematerializes nothing. Layers built under it: {sorted(built)}. "
                f"Received: layer_names={list(remat_mode.layer_names)}",
                FastloopWarning,
                stacklevel=3,
            )


def check_custom_step(class_name, weighting, loss_weighting, micro_batch_size):
    """Options a class's own `train_step` cannot reach: refused here, not silently dropped."""
    if micro_batch_size is not None:
        raise ValueError(
            f"`micro_batch_size` needs the library's forward pass, and {class_name} has its own "
            "`train_step`, which does its own. Call `super().train_step(data)` from it, or "
            f"split the batch in it. Received: micro_batch_size={micro_batch_size!r}"
        )
    if weighting.requires_task_gradients or weighting.has_state_update:
        raise ValueError(
            f"Loss weighting '{weighting.name}' needs the library's default `train_step` (per-"
            f"task gradients or a state update each step); {class_name} has its own. Use a "
            "method that only combines the losses in `compute_loss` (`uw`, `rlw`, static "
            f"weights) or call `super().train_step(data)`. Received: loss_weighting={loss_weighting!r}"
        )


def check_optimizer_clipping(optimizer, gradient_clipping):
    """Clipping or accumulation set on the optimizer that the step's own would clash with."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    set_on_optimizer = {
        name: getattr(inner, name, None)
        for name in ("clipnorm", "global_clipnorm", "clipvalue")
        if getattr(inner, name, None) is not None
    }
    if gradient_clipping is not None and set_on_optimizer:
        raise ValueError(
            "Gradient clipping is set twice: on the optimizer "
            f"({', '.join(f'{k}={v}' for k, v in set_on_optimizer.items())}) and in "
            "`compile(gradient_clipping=...)`. Set it in one place only (prefer "
            "`gradient_clipping`, which clips the gradient summed across replicas). "
            f"Received: gradient_clipping={gradient_clipping!r}"
        )
    accumulation = getattr(inner, "gradient_accumulation_steps", None)
    if accumulation and tf.distribute.has_strategy():
        raise ValueError(
            "The optimizer's `gradient_accumulation_steps` does not work under tf.distribute "
            "(Keras 3.15 synchronises inside a conditional, which raises in `fit`, with "
            "keras.Model too). Use `compile(micro_batch_size=...)` to accumulate inside the "
            f"step. Received: gradient_accumulation_steps={accumulation}"
        )
    if gradient_clipping is not None and accumulation:
        raise ValueError(
            "`gradient_clipping` cannot be combined with the optimizer's "
            "`gradient_accumulation_steps`: the step would clip each batch's gradient before "
            "Keras accumulates them (a mean of clipped gradients, not the clipped mean). Use "
            "`compile(micro_batch_size=...)` to accumulate inside the step, where clipping acts "
            f"on the accumulated gradient. Received: gradient_accumulation_steps={accumulation}, "
            f"gradient_clipping={gradient_clipping!r}"
        )
