"""A Keras model's trainable weights, as the client and server computations handle them.

Their TFF type (`weights_type`, which refuses a model these algorithms cannot
train: non-trainable weights, or probabilities where logits are expected,
`check_logits`), the common initial weights of a run seed, snapshots and
assignment, and the merging of disjoint subsets of them (FedPer's shared base
and private head). TF code, run inside `tff.tensorflow.computation`s.
"""

from collections.abc import Callable, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import models

# Output activations that turn logits into probabilities: a model ending in one would be trained
# and distilled as if its probabilities were logits (the losses apply softmax themselves).
PROBABILITY_ACTIVATIONS = ('softmax', 'sigmoid')


def check_logits(model: tf.keras.Model) -> None:
    """Refuses a Keras model whose output layer turns its logits into probabilities.

    Looks at the last layer (into a nested model ending another): a `Softmax`
    layer, or a layer whose `activation` is softmax or sigmoid (`Dense(...,
    activation='softmax')`, `Activation('softmax')`). `log_softmax` passes: its
    softmax is the logits' softmax. A subclassed model without layers is not
    checked.

    Args:
      model: a freshly built Keras model.

    Raises:
      ValueError: in one line, naming the model, the layer and the fix.
    """
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
    if name in PROBABILITY_ACTIVATIONS:
        raise ValueError(
            f'model {model.name!r} ends in a {name} (layer {last.name!r}): its outputs are probabilities, and the '
            f'losses and distillation here take logits; build it without the final {name} (e.g. activation=None)'
        )


def weights_type(model_fn: Callable[[], tf.keras.Model], indices: Sequence[int] | None = None) -> tff.Type:
    """The TFF type of a model's trainable weights: a list of float tensors.

    Args:
      model_fn: no-arg function returning a fresh Keras model.
      indices: optional; only these trainable variables, in this order
        (e.g. FedPer's shared base layers).

    Returns:
      A `tff.StructWithPythonType` (list container) of `tff.TensorType`s.

    Raises:
      ValueError: if the model has non-trainable weights (batch-norm
        statistics and the like are not averaged by these algorithms), or
        ends in a softmax or sigmoid (`check_logits`).
    """
    with tf.Graph().as_default():
        model = model_fn()
        check_logits(model)
        if model.non_trainable_weights:
            raise ValueError(f'model {model.name!r} has non-trainable weights, which are not supported')
        variables = model.trainable_weights
        if indices is not None:
            variables = [variables[i] for i in indices]
        return tff.StructWithPythonType([tff.TensorType(v.dtype.as_numpy_dtype, v.shape) for v in variables], list)


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
