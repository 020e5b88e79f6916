"""Multi-task loss weighting methods, by LibMTL short id.

``compile(loss_weighting=...)`` takes ``None`` (Keras' ``loss_weights``), a method id or a
:class:`LossWeighting` object; :func:`get` resolves it.
"""

from __future__ import annotations

import keras

from keras_fastloop.weighting.base import EqualWeighting, LossWeighting, Static
from keras_fastloop.weighting.dwa import DWA
from keras_fastloop.weighting.famo import FAMO
from keras_fastloop.weighting.gradient_based import (
    IMTL,
    MGDA,
    CAGrad,
    GradientWeighting,
    GradNorm,
    PCGrad,
)
from keras_fastloop.weighting.loss_based import LossEMA
from keras_fastloop.weighting.rlw import RLW
from keras_fastloop.weighting.uncertainty import UncertaintyWeighting

_METHODS = {
    "static": Static,
    "ew": EqualWeighting,
    "loss_ema": LossEMA,
    "uw": UncertaintyWeighting,
    "dwa": DWA,
    "rlw": RLW,
    "famo": FAMO,
    "gradnorm": GradNorm,
    "pcgrad": PCGrad,
    "cagrad": CAGrad,
    "mgda": MGDA,
    "imtl": IMTL,
}


def get(identifier):
    """Resolve ``compile(loss_weighting=...)``.

    Args:
        identifier: ``None`` (fixed ``loss_weights``, as Keras), a method id (see
            ``keras_fastloop.weighting.METHODS``), a :class:`LossWeighting` instance, or a config
            dict from ``keras.saving``.

    Returns:
        A :class:`LossWeighting` instance.

    Raises:
        ValueError: for an unknown method id.
        TypeError: for any other kind of value.
    """
    if identifier is None:
        return Static()
    if isinstance(identifier, LossWeighting):
        return identifier
    if isinstance(identifier, str):
        if identifier not in _METHODS:
            raise ValueError(
                f"Unknown `loss_weighting` id. Expected one of {sorted(_METHODS)}. "
                f"Received: loss_weighting={identifier!r}"
            )
        return _METHODS[identifier]()
    if isinstance(identifier, dict):
        obj = keras.saving.deserialize_keras_object(identifier)
        if isinstance(obj, LossWeighting):
            return obj
    raise TypeError(
        "`loss_weighting` must be None, a method id string or a "
        f"keras_fastloop.weighting.LossWeighting. Received: loss_weighting={identifier!r}"
    )


METHODS = tuple(sorted(_METHODS))

__all__ = [
    "DWA",
    "FAMO",
    "IMTL",
    "MGDA",
    "METHODS",
    "RLW",
    "CAGrad",
    "EqualWeighting",
    "GradNorm",
    "GradientWeighting",
    "LossEMA",
    "LossWeighting",
    "PCGrad",
    "Static",
    "UncertaintyWeighting",
    "get",
]
