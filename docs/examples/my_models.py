"""A model of your own, registered by name (docs/models.md, "A model of your own, by name").

`tff-pfl-train --model_modules=docs/examples/my_models.py --model=small_mlp` imports this file
before the run is checked; `--algorithm=ktpfl --architectures=small_mlp,lenet` mixes it with a
built-in architecture.
"""

import tensorflow as tf

from tff_pfl import models


def small_mlp(input_shape, num_classes):
    """Flatten, 64 ReLU units, `num_classes` logits (no softmax: the library applies it)."""
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation='relu'),
            tf.keras.layers.Dense(num_classes),
        ],
        name='small_mlp',
    )


models.register('small_mlp', small_mlp, replace=True)
