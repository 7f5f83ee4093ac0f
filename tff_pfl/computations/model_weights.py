"""A Keras model's trainable weights, as the client and server computations handle them.

Their TFF type (`weights_type`, which refuses a model these algorithms cannot
train: non-trainable weights that differ from build to build,
`check_non_trainable`, or probabilities where logits are expected,
`check_logits`), the common initial weights of a run seed, snapshots and
assignment, and the merging of disjoint subsets of them (FedPer's shared base
and private head). Non-trainable weights (BatchNormalization's statistics)
are a fresh model's everywhere, as TFF's FedAvg keeps its initial ones;
FedBN reads and sets them per client (`get_non_trainable`,
`assign_non_trainable`). TF code, run inside `tff.tensorflow.computation`s.
"""

import contextlib
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import models

# Output activations that turn logits into probabilities: a model ending in one would be trained
# and distilled as if its probabilities were logits (the losses apply softmax themselves).
PROBABILITY_ACTIVATIONS = ('softmax', 'sigmoid')
# The TF ops that compute them, as the model's traced output op shows them.
_PROBABILITY_OPS = {'Softmax': 'softmax', 'Sigmoid': 'sigmoid'}
# Ops that pass their input through unchanged on the way to the output.
_PASS_THROUGH_OPS = ('Identity', 'Reshape', 'Cast', 'StopGradient')


def input_signature(model: tf.keras.Model) -> tf.TensorSpec | None:
    """The spec of one input batch of a model, where the model states it.

    A functional or Sequential Keras model built on an `Input` states it in
    `model.inputs`; a model over a TFF model (`models.adapters`) in
    `probe_spec`. A subclassed model does not.

    Args:
      model: a freshly built Keras model.

    Returns:
      A `tf.TensorSpec` of the features, or None.
    """
    spec = getattr(model, 'probe_spec', None)
    if spec is not None:
        return spec
    inputs = getattr(model, 'inputs', None)
    if inputs and len(inputs) == 1:
        return tf.TensorSpec(inputs[0].shape, inputs[0].dtype)
    return None


# Ops that call a function (a `tf.function` inside the model, e.g. a TFF model's `predict_on_batch`).
_CALL_OPS = ('PartitionedCall', 'StatefulPartitionedCall')


def _output_op(model: tf.keras.Model, spec: tf.TensorSpec) -> tuple[str, str] | None:
    """The (type, name) of the op that computes the model's output, traced on `spec`.

    Follows the output back through pass-through ops and into the functions
    it is computed in (their `FunctionDef`s in the traced graph's library).
    None when the output is not one tensor, comes straight from an input, or
    leads into a function the library does not hold.
    """
    traced = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec)
    if not isinstance(traced.structured_outputs, tf.Tensor):
        return None
    library = {f.signature.name: f for f in traced.graph.as_graph_def().library.function}
    function, index = traced.function_def, 0
    while True:
        nodes = {node.name: node for node in function.node_def}
        ref = function.ret[function.signature.output_arg[index].name]  # 'node:output:0'
        node = nodes.get(ref.split(':')[0])
        while node is not None and node.op in _PASS_THROUGH_OPS:
            ref = node.input[0]
            node = nodes.get(ref.split(':')[0])
        if node is None:
            return None
        if node.op not in _CALL_OPS:
            return node.op, node.name
        function, index = library.get(node.attr['f'].func.name), int(ref.split(':')[-1])
        if function is None or index >= len(function.signature.output_arg):
            return None


def _layer_of(model: tf.keras.Model, op_name: str) -> str:
    """The name of the model's layer whose scope holds the op (else the op's scope, e.g. 'sequential/dense')."""
    names = {layer.name for layer in getattr(model, 'layers', [])}
    scopes = op_name.split('/')[:-1]
    return next((scope for scope in scopes if scope in names), '/'.join(scopes) or op_name)


def check_logits(model: tf.keras.Model) -> None:
    """Refuses a Keras model whose output turns its logits into probabilities.

    Where the model states its input (`input_signature`), traces it and looks
    at the op that computes the output: a softmax or sigmoid op, however it
    got there (`Dense(..., activation=tf.nn.softmax)`, `activation='softmax'`,
    `Lambda(tf.nn.softmax)`, a `Softmax` layer, `tf.nn.softmax` applied in a
    functional model, a TFF model's `predict_on_batch` over such a model),
    is refused. A model that does not state its input is checked by its last
    layer (into a nested model ending another): a `Softmax` layer, or a layer
    whose `activation` is softmax or sigmoid. `log_softmax` passes: its
    softmax is the logits' softmax.

    Args:
      model: a freshly built Keras model.

    Raises:
      ValueError: in one line, naming the model, the layer and the fix.
    """
    spec = input_signature(model)
    if spec is not None:
        op = _output_op(model, spec)
        name = _PROBABILITY_OPS.get(op[0]) if op is not None else None
        layer = _layer_of(model, op[1]) if name else None
    else:
        layers = getattr(model, 'layers', None) or []
        if not layers:
            return
        last = layers[-1]
        if isinstance(last, tf.keras.Model):
            check_logits(last)
            return
        if isinstance(last, tf.keras.layers.Softmax):
            name = 'softmax'
        else:
            name = getattr(getattr(last, 'activation', None), '__name__', None)
            name = {'softmax_v2': 'softmax'}.get(name, name)
        layer = last.name
    if name in PROBABILITY_ACTIVATIONS:
        raise ValueError(
            f'model {model.name!r} ends in a {name} (layer {layer!r}): its outputs are probabilities, and the '
            f'losses and distillation here take logits; build it without the final {name} (e.g. activation=None)'
        )


# Model functions whose model `check_logits` has passed: a builder asks for `weights_type` of the same
# function two to five times, and the check traces the model each time it runs.
_LOGITS_CHECKED = weakref.WeakSet()
# Model functions whose non-trainable weights `check_non_trainable` has found the same in every build.
_NON_TRAINABLE_CHECKED = weakref.WeakSet()


def _once(checked: weakref.WeakSet, model_fn: Callable[[], tf.keras.Model], check: Callable[[], None]) -> None:
    """Runs `check()` unless it has passed for `model_fn` before (`checked` remembers it).

    A model function that cannot be weakly referenced (or hashed) is checked
    every time.
    """
    try:
        if model_fn in checked:
            return
    except TypeError:  # unhashable
        check()
        return
    check()
    with contextlib.suppress(TypeError):  # not weakly referenceable: checked again next time
        checked.add(model_fn)


def weights_type(model_fn: Callable[[], tf.keras.Model], indices: Sequence[int] | None = None) -> tff.Type:
    """The TFF type of a model's trainable weights: a list of float tensors.

    Args:
      model_fn: no-arg function returning a fresh Keras model.
      indices: optional; only these trainable variables, in this order
        (e.g. FedPer's shared base layers).

    Returns:
      A `tff.StructWithPythonType` (list container) of `tff.TensorType`s.

    Raises:
      ValueError: if the model has non-trainable weights that differ from
        build to build (`check_non_trainable`), or ends in a softmax or
        sigmoid (`check_logits`).
    """
    with tf.Graph().as_default():
        model = model_fn()
        _once(_LOGITS_CHECKED, model_fn, lambda: check_logits(model))
        if model.non_trainable_weights:
            _once(_NON_TRAINABLE_CHECKED, model_fn, lambda: check_non_trainable(model_fn))
        variables = model.trainable_weights
        if indices is not None:
            variables = [variables[i] for i in indices]
        return tff.StructWithPythonType([tff.TensorType(v.dtype.as_numpy_dtype, v.shape) for v in variables], list)


def statistics_type(model_fn: Callable[[], tf.keras.Model]) -> tff.Type | None:
    """The TFF type of a model's non-trainable weights (a personal model's own statistics), or None.

    A personal model (Local's, Ditto's v_k, APFL's v_k) keeps its
    BatchNormalization moving statistics with its trainable weights, as a
    Keras model trained on the client's data alone would; the global model
    keeps a fresh model's, as TFF's FedAvg does.

    Args:
      model_fn: no-arg function returning a fresh Keras model.

    Returns:
      A list-typed `tff.StructWithPythonType` of the non-trainable weights'
      types, in Keras order; None for a model without any (its personal
      state then has no statistics, exactly as before they were kept).
    """
    with tf.Graph().as_default():
        variables = model_fn().non_trainable_weights
        if not variables:
            return None
        return tff.StructWithPythonType([tff.TensorType(v.dtype.as_numpy_dtype, v.shape) for v in variables], list)


def initial_statistics(model_fn: Callable[[], tf.keras.Model]) -> list[tf.Tensor]:
    """A fresh model's non-trainable weights, from their initializers (TF code).

    Args:
      model_fn: no-arg function returning a fresh Keras model.

    Returns:
      One tensor per non-trainable weight, in Keras order (the same for
      every build: `check_non_trainable`).
    """
    return [tf.convert_to_tensor(v.initial_value) for v in model_fn().non_trainable_weights]


def non_trainable_values(model_fn: Callable[[], tf.keras.Model], seed: int) -> list[np.ndarray]:
    """The initial non-trainable weights of a model built under `models.seeded(seed)`, as numpy arrays.

    Built in a graph of its own and read in a session, so it can be called
    from inside another graph (`weights_type`).

    Args:
      model_fn: no-arg function returning a fresh Keras model.
      seed: the seed the model is built under (`models.seeded`).

    Returns:
      One array per non-trainable weight, in Keras order (empty for none).
    """
    graph = tf.Graph()
    with graph.as_default(), models.seeded(seed):
        weights = model_fn().non_trainable_weights
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.initializers.variables(weights))
            return [np.asarray(value) for value in session.run(weights)]


def check_non_trainable(model_fn: Callable[[], tf.keras.Model]) -> None:
    """Refuses a model whose non-trainable weights depend on how it was initialized.

    Non-trainable weights are handled as TFF's FedAvg handles them
    (`tff.learning.algorithms.build_weighted_fed_avg`: its server keeps the
    initial ones and its clients start each round from them): every
    computation here builds a fresh model and sets only its trainable
    weights, so the non-trainable ones are a fresh model's, which is the
    same thing only if a fresh model's are always the same
    (BatchNormalization's moving mean and variance start at 0 and 1). A
    frozen layer with random initial weights (a `Dense` with
    `trainable=False`) would get different weights in every computation,
    and is refused.

    Args:
      model_fn: no-arg function returning a fresh Keras model.

    Raises:
      ValueError: one line, naming the layers, if two builds under
        different seeds give different non-trainable weights.
    """
    first, second = non_trainable_values(model_fn, 1), non_trainable_values(model_fn, 2)
    if all(np.array_equal(a, b) for a, b in zip(first, second)):
        return
    with tf.Graph().as_default():
        model = model_fn()
        changing = [w for w, a, b in zip(model.non_trainable_weights, first, second) if not np.array_equal(a, b)]
        layers = [
            layer.name
            for layer in model._flatten_layers(include_self=False)
            if any(w is v for v in layer.non_trainable_weights for w in changing)
        ]
    raise ValueError(
        f'model {model.name!r} has non-trainable weights that differ from build to build (layer '
        f'{(layers or ["?"])[-1]!r}): only trainable weights are averaged or kept, and '
        "non-trainable ones are a fresh model's; give them a constant initializer or make them trainable"
    )


def non_trainable_refusal(model: tf.keras.Model) -> str:
    """The one-line refusal of a model with non-trainable weights, naming the layers that hold them.

    Args:
      model: a Keras model with non-trainable weights.

    Returns:
      The message: each holding layer (innermost) with its kind and weights,
      and the fix.
    """
    holders = []
    for layer in model._flatten_layers(include_self=False):  # every nested layer, depth first
        own = [
            w
            for w in layer.non_trainable_weights
            if not any(w is v for sub in layer._flatten_layers(include_self=False) for v in sub.non_trainable_weights)
        ]
        if own:
            names = ', '.join(w.name.split('/')[-1].split(':')[0] for w in own)
            holders.append(f'{layer.name!r} ({type(layer).__name__}: {names})')
    where = '; '.join(holders) if holders else 'outside its layers'
    return (
        f'model {model.name!r} has non-trainable weights, which these algorithms neither average nor keep per '
        f'client: layer {where}; use layers without them (GroupNormalization or LayerNormalization for '
        'BatchNormalization, trainable=True for frozen layers)'
    )


def merge_weights(parts: Sequence[tuple[Sequence[int], Sequence[tf.Tensor]]]) -> list:
    """Puts disjoint subsets of a model's weights back in variable order.

    Args:
      parts: `(indices, weights)` pairs that together cover every index once.

    Returns:
      The list of all weights, ordered by index.
    """
    merged = {}
    for indices, weights in parts:
        merged.update(zip(indices, weights))
    return [merged[i] for i in range(len(merged))]


def initial_weights(model_fn: Callable[[], tf.keras.Model], seed: int) -> list[tf.Tensor]:
    """A fresh model's trainable weights, fixed by the run seed (TF code).

    The same on the server and on every client for a given seed, so a
    client can build the common initial model itself instead of receiving it.

    Args:
      model_fn: no-arg function returning a fresh Keras model.
      seed: the run seed (a Python int), as for `models.seeded`.

    Returns:
      The list of the new model's trainable weights, as tensors.
    """
    with models.seeded(seed):
        return get_weights(model_fn())


def get_weights(model: tf.keras.Model) -> list[tf.Tensor]:
    """Current trainable weights as tensors (a snapshot, not variables).

    Args:
      model: the Keras model.

    Returns:
      A list of tensors, one per trainable variable, in Keras order.
    """
    return [tf.identity(v) for v in model.trainable_weights]


def assign_weights(model: tf.keras.Model, weights: Sequence[tf.Tensor]) -> list:
    """Assigns `weights` to the model's trainable variables; returns the ops.

    Args:
      model: the Keras model whose variables are assigned.
      weights: one tensor per trainable variable, in Keras order.

    Returns:
      The list of the variables' `assign` results, one per variable.
    """
    return [v.assign(w) for v, w in zip(model.trainable_weights, weights)]


def get_non_trainable(model: tf.keras.Model) -> list[tf.Tensor]:
    """Current non-trainable weights as tensors (BatchNormalization's moving statistics; TF code).

    Args:
      model: the Keras model.

    Returns:
      A list of tensors, one per non-trainable variable, in Keras order.
    """
    return [tf.identity(v) for v in model.non_trainable_weights]


def fresh_weights(model: tf.keras.Model, weights: Sequence[tf.Tensor]) -> list:
    """Assigns `weights` to the trainable variables and their initial values to the others (TF code).

    A freshly built model's non-trainable variables (BatchNormalization's
    moving statistics) hold their initial values only once TFF has run the
    computation's variable initializers, which it does not do for a
    computation called inside another one: this sets them explicitly, so a
    building block is the same model wherever it runs.

    Args:
      model: a freshly built Keras model.
      weights: one tensor per trainable variable, in Keras order.

    Returns:
      The list of the `assign` results.
    """
    initial = [v.assign(v.initial_value) for v in model.non_trainable_weights]
    return assign_weights(model, weights) + initial


def assign_non_trainable(model: tf.keras.Model, values: Sequence[tf.Tensor]) -> list:
    """Assigns `values` to the model's non-trainable variables; returns the ops (TF code).

    Args:
      model: the Keras model whose variables are assigned.
      values: one tensor per non-trainable variable, in Keras order.

    Returns:
      The list of the variables' `assign` results, one per variable.
    """
    return [v.assign(w) for v, w in zip(model.non_trainable_weights, values)]
