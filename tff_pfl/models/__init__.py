"""Keras model builders, one registry by name.

Every builder is a plain function `(input_shape, num_classes) -> tf.keras.Model`
that returns a fresh, un-compiled model whose output is logits (no softmax):
losses and distillation apply softmax/temperature themselves. TFF needs a fresh
model on every call (variables are created only inside computations).
"""

import contextlib
import random
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

ModelBuilder = Callable[[Sequence[int], int], tf.keras.Model]


def mnist_dnn(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """The PersFL MNIST DNN: flatten, 100 ReLU units, `num_classes` logits.

    Args:
      input_shape: shape of one example (e.g. (28, 28, 1) or (784,)).
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.
    """
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(100, activation='relu'),
            tf.keras.layers.Dense(num_classes),
        ],
        name='mnist_dnn',
    )


def persfl_cnn(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """The PersFL CIFAR CNN (the LeNet-5 style network of the paper).

    Two 5x5 conv layers (6 and 16 filters, ReLU) with 2x2 max-pooling after
    each, then fully connected 400 -> 120 -> 84 -> `num_classes`. On 32x32
    inputs the flattened features are exactly 16*5*5 = 400; on other input
    sizes a dense projection to 400 keeps the stated 400-120-84 head.

    Args:
      input_shape: shape of one image, [H, W, C] (a flat or [H, W] input is
        not accepted).
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.
    """
    if len(input_shape) != 3:
        raise ValueError(f'persfl_cnn needs image inputs [H, W, C], got {tuple(input_shape)}')
    layers = [
        tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
        tf.keras.layers.Conv2D(6, 5, activation='relu'),
        tf.keras.layers.MaxPool2D(2),
        tf.keras.layers.Conv2D(16, 5, activation='relu'),
        tf.keras.layers.MaxPool2D(2),
        tf.keras.layers.Flatten(),
    ]
    height, width = input_shape[0], input_shape[1]
    flat = ((height - 4) // 2 - 4) // 2 * (((width - 4) // 2 - 4) // 2) * 16
    if flat != 400:
        layers.append(tf.keras.layers.Dense(400, activation='relu'))
    layers += [
        tf.keras.layers.Dense(120, activation='relu'),
        tf.keras.layers.Dense(84, activation='relu'),
        tf.keras.layers.Dense(num_classes),
    ]
    return tf.keras.Sequential(layers, name='persfl_cnn')


def logistic_regression(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """Multinomial logistic regression: flatten, one dense layer of logits.

    Args:
      input_shape: shape of one example.
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.
    """
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(num_classes),
        ],
        name='logistic_regression',
    )


class _ScalarParameter(tf.keras.layers.Layer):
    """One trainable scalar theta, output for every example: [B, 1]."""

    def build(self, input_shape):
        self.theta = self.add_weight(name='theta', shape=(), initializer='zeros')

    def call(self, inputs):
        return tf.ones_like(inputs[:, :1]) * self.theta


def gaussian_mean(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """The two-level Gaussian model's client parameter theta_m (Self-FL §2.1).

    A single scalar, initialised to 0; the model outputs it for every example
    so a loss can compare it with scalar samples. Not a classifier:
    `num_classes` is ignored.
    """
    del num_classes
    return tf.keras.Sequential(
        [tf.keras.layers.InputLayer(input_shape=tuple(input_shape)), _ScalarParameter()],
        name='gaussian_mean',
    )


@contextlib.contextmanager
def seeded(seed: int):
    """Models built inside get initial weights fixed by `seed`.

    Keras initializers without a seed draw theirs from Python's global
    `random` module, so the same builder gives different weights in different
    processes. This sets Keras's, Python's, NumPy's and TF's seeds for the
    block (`tf.keras.utils.set_random_seed`) and puts the Python and NumPy
    generators back afterwards, so callers' random streams are untouched.
    """
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        tf.keras.utils.set_random_seed(seed)
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


_REGISTRY: dict[str, ModelBuilder] = {
    'mnist_dnn': mnist_dnn,
    'persfl_cnn': persfl_cnn,
    'logistic': logistic_regression,
    'gaussian_mean': gaussian_mean,
}


def names() -> list[str]:
    """Names of the registered models."""
    return sorted(_REGISTRY)


def get(name: str) -> ModelBuilder:
    """Returns the builder registered as `name`.

    Raises:
      ValueError: for an unknown name.
    """
    if name not in _REGISTRY:
        raise ValueError(f'unknown model {name!r}; known: {", ".join(names())}')
    return _REGISTRY[name]
