"""Keras' rematerialization (`keras.RematScope`, `keras.remat`) made exact inside our steps.

Part of `keras_fastloop._keras_internals`: every Keras internal it uses is imported here.
"""

import contextlib
import functools
import threading

# ------------------------------------------------------------------ rematerialization (remat)
#
# Keras applies `keras.RematScope` in `Operation.rematerialized_call` / `Layer.rematerialized_call`
# and `keras.remat` through `keras.src.backend.common.remat.remat`, which both call
# `backend.core.remat(f)` (TensorFlow: `tf.recompute_grad(f)`). The call passes keyword arguments
# (`training=`) that `tf.recompute_grad` refuses outside eager execution (keras#21207), and its
# recompute runs outside the forward pass' autocast scope and call context and draws new random
# numbers. While a step of ours is traced (`exact_remat`), `backend.core.remat` gives instead a
# recompute that binds the keyword arguments and replays all of that.

_STATEFUL_RANDOM_OPS = frozenset(
    {
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "Multinomial",
        "StatefulUniform",
        "StatefulUniformInt",
        "StatefulUniformFullInt",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulRandomBinomial",
        "RngReadAndSkip",
        "RngSkip",
    }
)

# Per thread: MirroredStrategy traces each replica's step in its own thread, and their entries
# and exits interleave. `models` is a stack: the innermost traced step's model is last.
_remat_state = threading.local()
_stock_core_remat = None


def _traced_models():
    if not hasattr(_remat_state, "models"):
        _remat_state.models = []
    return _remat_state.models


def install_remat_hook():
    """Route Keras' `backend.core.remat` (`RematScope`, `keras.remat`) through `exact_remat`.

    Outside a step of ours it returns what Keras' own returns (`tf.recompute_grad(f)`).
    Idempotent; run at import so that `keras.remat(f)` called while building a model is routed.
    """
    global _stock_core_remat
    from keras.src.backend.tensorflow import core

    if _stock_core_remat is None:
        _stock_core_remat = core.remat
    core.remat = _keras_remat_hook


def _keras_remat_hook(f):
    # `keras.remat(f)` may run while a model is built, outside our steps: decide at call time.
    def call(*args, **kwargs):
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope

        if in_symbolic_scope():  # shape inference (`compute_output_spec`): no gradient to save
            return f(*args, **kwargs)
        if not _traced_models():
            return _stock_core_remat(f)(*args, **kwargs)
        return _exact_remat_call(f, args, kwargs)

    call.__wrapped__ = f
    return call


@contextlib.contextmanager
def exact_remat(model):
    """Inside: Keras' rematerialization replays its forward pass exactly (see `_exact_remat_call`).

    `model` is the model whose step is traced (its seed generators are replayed when the
    rematerialized function belongs to no layer).
    """
    models = _traced_models()
    models.append(model)
    try:
        yield
    finally:
        models.pop()


def with_exact_remat(model, step_function):
    """`step_function` run inside `exact_remat(model)` (what our traced steps are built from)."""

    @functools.wraps(step_function)
    def replayed(*args, **kwargs):
        with exact_remat(model):
            return step_function(*args, **kwargs)

    replayed._fastloop_exact_remat = True
    return replayed


def remat_modes(model):
    """`(layer name, RematMode)` of every layer of `model` built under a `keras.RematScope`.

    Keras keeps the scope's `RematMode(mode, output_size_threshold, layer_names)` on each
    operation made inside it, as `_remat_mode` (`None` outside a scope).
    """
    found = []
    for layer in model._flatten_layers(include_self=True):
        remat_mode = getattr(layer, "_remat_mode", None)
        if remat_mode is not None and remat_mode.mode is not None:
            found.append((layer.name, remat_mode))
    return found


def _owner_layer(f):
    from keras.src.layers.layer import Layer

    if isinstance(f, Layer):
        return f
    owner = getattr(f, "__self__", None)
    return owner if isinstance(owner, Layer) else None


def _replayed_variables(f):
    """The variables whose forward-pass values the recompute reads: the owning layer's
    non-trainable ones (seed generators' states, moving statistics), else every seed
    generator's state in the model, and Keras' global seed generator's."""
    from keras.src.backend.common import global_state

    owner = _owner_layer(f)
    if owner is not None:
        variables = list(owner.non_trainable_variables)
    else:
        model = _traced_models()[-1] if _traced_models() else None
        variables = []
        if model is not None:
            for layer in model._flatten_layers(include_self=True):
                variables.extend(sg.state for sg in layer._seed_generators)
    generator = global_state.get_global_attribute("global_seed_generator")
    if generator is not None:
        variables.append(generator.state)
    unique = {id(v): v for v in variables}
    return list(unique.values())


def _is_differentiable(value):
    import tensorflow as tf

    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _exact_remat_call(f, args, kwargs):
    """`f(*args, **kwargs)` rematerialized with `tf.recompute_grad`, replayed exactly.

    The float tensors among the arguments (keyword ones included) are `tf.recompute_grad`'s
    positional inputs; everything else (`training=`, masks, integer ids) is bound. The forward
    pass saves the values of `_replayed_variables(f)`, Keras' autocast scope and call context;
    the recompute runs under them inside a `StatelessScope` mapping those variables to the saved
    values, so a `SeedGenerator` draws the same numbers again and no variable is assigned twice.
    Raises `ValueError` where the forward pass cannot be replayed: a stateful random op (one
    without a seed generator), a loss added with `add_loss`, or Keras' global seed generator
    created by the call.
    """
    import tensorflow as tf
    from keras.src import tree
    from keras.src.backend.common import global_state
    from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope
    from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

    structure = (args, kwargs)
    flat = tree.flatten(structure)
    positions = [i for i, v in enumerate(flat) if _is_differentiable(v)]
    autocast = get_autocast_scope()
    call_context = global_state.get_global_attribute("current_call_ctx")
    saved = {}

    def rebuilt(tensors):
        values = list(flat)
        for i, t in zip(positions, tensors):
            values[i] = t
        return tree.pack_sequence_as(structure, values)

    def forward(tensors):
        had_global = global_state.get_global_attribute("global_seed_generator") is not None
        variables = _replayed_variables(f)
        with AutocastScope(None):
            saved["mapping"] = [(v, tf.convert_to_tensor(v.value)) for v in variables]
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations()) if graph is not None else 0
        a, kw = rebuilt(tensors)
        losses_before = _added_losses(f)
        outputs = f(*a, **kw)
        if graph is not None:
            stateful = sorted(
                {op.type for op in graph.get_operations()[first_op:]} & _STATEFUL_RANDOM_OPS
            )
            if stateful:
                raise ValueError(
                    f"Cannot rematerialize {_describe(f)} exactly: it draws random numbers with "
                    f"stateful TensorFlow ops ({', '.join(stateful)}) that the recompute cannot "
                    "replay. Draw them through a `keras.random.SeedGenerator` (keras.random.* "
                    "with `seed=` a generator the layer owns), or build this layer outside the "
                    f"`keras.RematScope`. Received: ops={stateful}"
                )
        if not had_global and global_state.get_global_attribute("global_seed_generator"):
            raise ValueError(
                f"Cannot rematerialize {_describe(f)} exactly: it creates Keras' global seed "
                "generator (a `keras.random` call with `seed=None`), whose first state cannot be "
                "replayed. Pass a `keras.random.SeedGenerator` owned by the layer as `seed=`."
            )
        if _added_losses(f) != losses_before:
            raise ValueError(
                f"Cannot rematerialize {_describe(f)}: it adds a loss (`add_loss`, an activity "
                "regularizer) inside the rematerialized call, whose gradient the recompute "
                "would drop. Build this layer outside the `keras.RematScope`."
            )
        return outputs

    def recompute(tensors):
        previous_autocast = get_autocast_scope()
        previous_context = global_state.get_global_attribute("current_call_ctx")
        scope = StatelessScope(initialize_variables=False)
        outer = get_stateless_scope()
        if outer is not None:
            scope.state_mapping.update(outer.state_mapping)
        for v, value in saved["mapping"]:
            scope.state_mapping[id(v)] = value
        global_state.set_global_attribute("autocast_scope", autocast)
        global_state.set_global_attribute("current_call_ctx", call_context)
        try:
            with scope:
                a, kw = rebuilt(tensors)
                return f(*a, **kw)
        finally:
            global_state.set_global_attribute("autocast_scope", previous_autocast)
            global_state.set_global_attribute("current_call_ctx", previous_context)

    def positional(*tensors):
        if "mapping" not in saved:
            return forward(tensors)
        return recompute(tensors)

    return _stock_core_remat(positional)(*[flat[i] for i in positions])


def _added_losses(f):
    """How many `add_loss` losses the layer owning `f` (else the traced model) and its
    sublayers hold now (an activity regularizer of a sublayer counts too)."""
    owner = _owner_layer(f)
    if owner is None:
        owner = _traced_models()[-1] if _traced_models() else None
    if owner is None:
        return 0
    return sum(len(layer._losses) for layer in owner._flatten_layers(include_self=True))


def _describe(f):
    owner = _owner_layer(f)
    if owner is not None:
        return f"layer '{owner.name}' ({type(owner).__name__})"
    return f"function {getattr(f, '__qualname__', repr(f))}"


install_remat_hook()
