"""A Keras model read as a body (the representation) and a head: FedRoD's and FedDBE's split.

The head is the last `head_layers` layers with weights and every layer after
them; the body is what comes before, run layer by layer for a Sequential
model, or as the functional model's graph up to the head's input. Both
algorithms run the two parts separately (FedRoD: a second head on the same
features; FedDBE: a bias added to the features), so the head must be one
chain of layers ending at the model's output (`inspect`).
"""

from collections.abc import Callable

import tensorflow as tf


def chain(layers, h, training):
    """`layers` applied one after another to `h` (TF code).

    Args:
      layers: Keras layers (or models), in order.
      h: their input.
      training: passed to every layer.

    Returns:
      The last layer's output.
    """
    for layer in layers:
        h = layer(h, training=training)
    return h


def head_start(model: tf.keras.Model, head_layers: int = 1) -> int:
    """The index in `model.layers` of the head's first layer: the first of the last `head_layers` with weights.

    Args:
      model: a Keras model.
      head_layers: how many of the last layers with weights are the head.

    Returns:
      The index.
    """
    weighted = [layer for layer in model.layers if layer.trainable_weights]
    return model.layers.index(weighted[-head_layers])


class BodyHead:
    """`model`'s body and head, over its own layers and variables (TF code).

    Attributes:
      start: the index in `model.layers` of the head's first layer.
      body: the layers (or one functional sub-model) that make the features.
      head: the layers from `start` on.
    """

    def __init__(self, model: tf.keras.Model, head_layers: int = 1):
        self.start = head_start(model, head_layers)
        self.head = model.layers[self.start :]
        if isinstance(model, tf.keras.Sequential):
            self.body = model.layers[: self.start]
        else:  # a functional model: its graph up to the head's input
            self.body = [tf.keras.Model(model.inputs, model.layers[self.start].input)]

    def features(self, x, training=False):
        """z, the head's input.

        Args:
          x: a batch of inputs.
          training: passed to every layer.

        Returns:
          The features.
        """
        return chain(self.body, x, training)

    def logits(self, z, training=False):
        """The head on the features z.

        Args:
          z: features, as `features` returns them.
          training: passed to every layer.

        Returns:
          The logits.
        """
        return chain(self.head, z, training)


def inspect(model_fn: Callable[[], tf.keras.Model], head_layers: int = 1) -> tuple[str, bool, tuple, int]:
    """What a builder checks before splitting `model_fn()`'s model (built in a graph of its own).

    Args:
      model_fn: no-arg function returning a fresh Keras model.
      head_layers: how many of the last layers with weights are the head.

    Returns:
      `(model name, whether the head is one chain ending at the model's only
      output, the head's input shape (empty if unknown), the number of
      logits (0 when not a chain))`.
    """
    with tf.Graph().as_default():
        model = model_fn()
        head = model.layers[head_start(model, head_layers) :]
        try:
            is_chain = isinstance(model, tf.keras.Sequential) or (
                all(later.input is earlier.output for earlier, later in zip(head, head[1:]))
                and len(model.outputs) == 1
                and head[-1].output is model.outputs[0]
            )
        except (AttributeError, TypeError, ValueError):  # a layer called more than once, or no graph
            is_chain = False
        try:
            shape = tuple(head[0].input.shape)
        except (AttributeError, TypeError, ValueError):
            shape = ()
        width = int(model.output_shape[-1]) if is_chain else 0
    return model.name, is_chain, shape, width
