"""Multi-task loss weighting methods, by LibMTL short id.

`compile(loss_weighting=...)` takes `None` (Keras' `loss_weights`), a method id or a
`LossWeighting` object; `get` resolves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras

from keras_fastloop import _validation
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.aligned_mtl import AlignedMTL
from keras_fastloop.weighting.base import EqualWeighting, LossWeighting, Static
from keras_fastloop.weighting.cagrad import CAGrad
from keras_fastloop.weighting.db_mtl import DBMTL
from keras_fastloop.weighting.dwa import DWA
from keras_fastloop.weighting.excess_mtl import ExcessMTL
from keras_fastloop.weighting.fairgrad import FairGrad
from keras_fastloop.weighting.famo import FAMO
from keras_fastloop.weighting.gls import GLS
from keras_fastloop.weighting.graddrop import GradDrop
from keras_fastloop.weighting.gradnorm import GradNorm
from keras_fastloop.weighting.gradvac import GradVac
from keras_fastloop.weighting.imtl import IMTL, IMTLG
from keras_fastloop.weighting.loss_ema import LossEMA
from keras_fastloop.weighting.mgda import MGDA
from keras_fastloop.weighting.moco import MoCo
from keras_fastloop.weighting.modo import MoDo
from keras_fastloop.weighting.nash_mtl import NashMTL
from keras_fastloop.weighting.pcgrad import PCGrad
from keras_fastloop.weighting.rgw import RGW
from keras_fastloop.weighting.rlw import RLW
from keras_fastloop.weighting.sdmgrad import SDMGrad
from keras_fastloop.weighting.stch import STCH
from keras_fastloop.weighting.upgrad import UPGrad
from keras_fastloop.weighting.uw import UncertaintyWeighting

_METHODS = {
    method.name: method
    for method in (
        Static,
        EqualWeighting,
        LossEMA,
        UncertaintyWeighting,
        DWA,
        RLW,
        FAMO,
        GradNorm,
        PCGrad,
        CAGrad,
        MGDA,
        IMTL,
        IMTLG,
        NashMTL,
        AlignedMTL,
        UPGrad,
        GLS,
        RGW,
        STCH,
        DBMTL,
        ExcessMTL,
        GradDrop,
        FairGrad,
        GradVac,
        MoCo,
        MoDo,
        SDMGrad,
    )
}


def get(identifier: LossWeighting | str | dict[str, Any] | None) -> LossWeighting | None:
    """Resolve `compile(loss_weighting=...)`.

    Args:
        identifier: `None` (fixed `loss_weights`, as Keras), a method id (see
            `keras_fastloop.weighting.METHODS`), a `LossWeighting` instance, or a config
            dict from `keras.saving`.

    Returns:
        A `LossWeighting` instance, or `None` for `None` (as `keras.losses.get`;
        `compile` then uses `Static`, Keras' fixed `loss_weights`).

    Raises:
        ValueError: for an unknown method id.
        TypeError: for any other kind of value.
    """
    if identifier is None:
        return None
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


def check_loss_weights(
    weighting: LossWeighting | None,
    loss_weights: float | Sequence[float] | Mapping[str, float] | None,
) -> None:
    """Refuse `compile(loss_weights=...)` that the weighting method would ignore.

    Only `static` (the default, `loss_weighting=None`) and methods that set
    `accepts_loss_weights = True` use `loss_weights`; every adaptive method decides its own
    weights, and silently dropping the user's would train something else than asked. Weights
    that are all exactly 1 are accepted everywhere (they change nothing; their keys and length
    are checked later by `compile`). Called by `compile()` right after `get`, before
    the losses are resolved.

    Args:
        weighting: the `LossWeighting` from `get` (`None`: static weights).
        loss_weights: `compile`'s `loss_weights`: `None`, a float, a list or a dict.

    Raises:
        ValueError: `loss_weights` with an entry other than 1 for a method that ignores them.
    """
    if loss_weights is None or weighting is None or weighting.accepts_loss_weights:
        return
    if isinstance(loss_weights, dict):
        values = list(loss_weights.values())
    elif isinstance(loss_weights, (list, tuple)):
        values = list(loss_weights)
    else:
        values = [loss_weights]
    if all(_validation.is_real(v) and v == 1 for v in values):
        return
    raise ValueError(
        f"`loss_weights` would be ignored by loss_weighting='{weighting.name}', which sets its "
        "own task weights. Remove `loss_weights`, use loss_weighting=None (or 'static') for "
        "fixed weights, or scale the task's loss function itself. "
        f"Received: loss_weights={loss_weights!r}, loss_weighting='{weighting.name}'"
    )


METHODS = tuple(sorted(_METHODS))

__all__ = [
    "AlignedMTL",
    "CAGrad",
    "DBMTL",
    "DWA",
    "EqualWeighting",
    "ExcessMTL",
    "FAMO",
    "FairGrad",
    "GLS",
    "GradDrop",
    "GradNorm",
    "GradVac",
    "GradientWeighting",
    "IMTL",
    "IMTLG",
    "LossEMA",
    "LossWeighting",
    "METHODS",
    "MGDA",
    "MoCo",
    "MoDo",
    "NashMTL",
    "PCGrad",
    "RGW",
    "RLW",
    "SDMGrad",
    "STCH",
    "Static",
    "UPGrad",
    "UncertaintyWeighting",
    "check_loss_weights",
    "get",
]
