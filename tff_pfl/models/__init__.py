"""Keras model builders, one registry by name.

Every builder is a plain function `(input_shape, num_classes) -> tf.keras.Model`
that returns a fresh, un-compiled model whose output is logits (no softmax):
losses and distillation apply softmax/temperature themselves (the builders refuse
a model ending in a softmax or sigmoid: `model_weights.check_logits`). TFF needs a fresh
model on every call (variables are created only inside computations).
"""

import contextlib
import importlib
import importlib.util
import os
import random
import re
import sys
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tff_pfl.models.kt_architectures import (
    alexnet,
    alexnet_small,
    resnet18,
    resnet_small,
    shufflenet_small,
    shufflenet_v2,
)

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


def mnist_dnn_bn(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """`mnist_dnn` with batch normalization: flatten, 100 units, BatchNormalization, ReLU, logits.

    FedBN's default model (its BatchNormalization layer is what FedBN keeps
    on each client); any model with such layers goes in as well.

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
            tf.keras.layers.Dense(100),
            tf.keras.layers.BatchNormalization(),
            tf.keras.layers.ReLU(),
            tf.keras.layers.Dense(num_classes),
        ],
        name='mnist_dnn_bn',
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


def fedavg_cnn(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """The CNN of McMahan et al. 2017 (FedAvg), used by KT-pFL's Table 2.

    Two 5x5 convolutions ('same' padding, 32 and 64 filters, ReLU), each
    followed by 2x2 max-pooling, a 512-unit ReLU layer, `num_classes` logits
    (the paper's softmax is left to the loss). On 28x28x1 with 10 classes:
    832 + 51,264 + 3,136*512 + 512 + 5,130 = 1,663,370 parameters, the
    paper's count. Pooling uses 'same' padding (as in google-research/federated's
    `create_original_fedavg_cnn_model`), which only matters for odd sizes.

    Args:
      input_shape: shape of one image, [H, W, C].
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model` (Sequential).

    Raises:
      ValueError: if `input_shape` is not [H, W, C].
    """
    if len(input_shape) != 3:
        raise ValueError(f'fedavg_cnn needs image inputs [H, W, C], got {tuple(input_shape)}')
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
            tf.keras.layers.Conv2D(32, 5, padding='same', activation='relu'),
            tf.keras.layers.MaxPool2D(2, padding='same'),
            tf.keras.layers.Conv2D(64, 5, padding='same', activation='relu'),
            tf.keras.layers.MaxPool2D(2, padding='same'),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(512, activation='relu'),
            tf.keras.layers.Dense(num_classes),
        ],
        name='fedavg_cnn',
    )


def pfllib_cnn(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """PFLlib's `FedAvgCNN` (TsingZ0/PFLlib, `system/flcore/trainmodel/models.py`).

    The CNN of PFLlib's leaderboards: two 5x5 convolutions with 'valid'
    padding (PyTorch's `padding=0`), 32 and 64 filters, each followed by ReLU
    and 2x2 max-pooling (stride 2, floor: Keras's 'valid'), flatten, a
    512-unit ReLU layer and `num_classes` logits. On 28x28x1 the maps are
    24, 12, 8 and 4 pixels wide, so 4*4*64 = 1,024 features (PFLlib's
    `dim=1024`) reach the dense layer; with 10 classes:
    832 + 51,264 + 524,800 + 5,130 = 582,026 parameters. Unlike `fedavg_cnn`
    ('same' convolutions, 3,136 features, 1,663,370 parameters). Keras
    flattens height, width, channels where PyTorch flattens channels first,
    which permutes the dense layer's rows and changes no count.

    Args:
      input_shape: shape of one image, [H, W, C], at least 16x16.
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model` (Sequential).

    Raises:
      ValueError: if `input_shape` is not [H, W, C] of at least 16x16.
    """
    if len(input_shape) != 3 or min(input_shape[:2]) < 16:
        raise ValueError(f'pfllib_cnn needs image inputs [H, W, C] of at least 16x16, got {tuple(input_shape)}')
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
            tf.keras.layers.Conv2D(32, 5, padding='valid', activation='relu'),
            tf.keras.layers.MaxPool2D(2),
            tf.keras.layers.Conv2D(64, 5, padding='valid', activation='relu'),
            tf.keras.layers.MaxPool2D(2),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(512, activation='relu'),
            tf.keras.layers.Dense(num_classes),
        ],
        name='pfllib_cnn',
    )


class _ScalarParameter(tf.keras.layers.Layer):
    """One trainable scalar theta, output for every example: [B, 1]."""

    def build(self, input_shape):
        self.theta = self.add_weight(name='theta', shape=(), initializer='zeros')

    def call(self, inputs):
        return tf.ones_like(inputs[:, :1]) * self.theta


def char_gru(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """Next-character prediction: character embedding, one GRU, logits at every position.

    Embedding of the `num_classes` ids (the vocabulary, with pad, OOV, BOS and
    EOS) in 8 dimensions, as in TFF's Shakespeare baseline; one GRU of 256
    units returning the whole sequence (TFF's baseline has two LSTMs of 256:
    3.6 times the parameters and 3 times the training time per sequence,
    benchmarks/results/char_model_cost.md); a
    dense layer of `num_classes` logits at every position. Padding is not
    masked in the model: it only ever trails a sequence, so it never reaches
    a scored position, and the loss leaves its targets out.

    Args:
      input_shape: `(L,)`, the length of a sequence of ids.
      num_classes: the vocabulary size.

    Returns:
      An un-compiled `tf.keras.Model` mapping int32 `[B, L]` to `[B, L, num_classes]`.
    """
    if len(input_shape) != 1:
        raise ValueError(f'char_gru needs sequences of ids [L], got inputs of shape {tuple(input_shape)}')
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape), dtype='int32'),
            tf.keras.layers.Embedding(num_classes, 8),
            tf.keras.layers.GRU(256, return_sequences=True),
            tf.keras.layers.Dense(num_classes),
        ],
        name='char_gru',
    )


def gaussian_mean(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """The two-level Gaussian model's client parameter theta_m (Self-FL §2.1).

    A single scalar, initialised to 0; the model outputs it for every example
    so a loss can compare it with scalar samples. Not a classifier:
    `num_classes` is ignored.

    Args:
      input_shape: shape of one example (the samples are scalars, e.g. (1,)).
      num_classes: ignored.

    Returns:
      An un-compiled `tf.keras.Model` with one trainable scalar, whose
      output is `[B, 1]`.
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

    Args:
      seed: the seed (a Python int).

    Yields:
      None; a context manager for the block.
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
    'mnist_dnn_bn': mnist_dnn_bn,
    'persfl_cnn': persfl_cnn,
    'logistic': logistic_regression,
    'gaussian_mean': gaussian_mean,
    'lenet': persfl_cnn,
    'alexnet_small': alexnet_small,
    'resnet_small': resnet_small,
    'shufflenet_small': shufflenet_small,
    'fedavg_cnn': fedavg_cnn,
    'pfllib_cnn': pfllib_cnn,
    'alexnet': alexnet,
    'resnet18': resnet18,
    'shufflenet_v2': shufflenet_v2,
    'char_gru': char_gru,
}


# KT-pFL's four architectures (Zhang et al. 2021, Section 5.1: LeNet, AlexNet,
# ResNet-18, ShuffleNetV2; small CPU versions here), for images [H, W, C].
PAPER_IMAGE_ARCHITECTURES = ('lenet', 'alexnet_small', 'resnet_small', 'shufflenet_small')
# The same four at the papers' sizes (docs/models.md), for images [H, W, C] of at least 16 x 16.
PAPER_SIZE_IMAGE_ARCHITECTURES = ('lenet', 'alexnet', 'resnet18', 'shufflenet_v2')
# For features that are not such images: models that flatten any shape.
VECTOR_ARCHITECTURES = ('logistic', 'mnist_dnn')
# LeNet's two 5x5 convolutions, each followed by 2x2 pooling, need 16 x 16.
_SMALLEST_IMAGE = 16


def default_architectures(feature_shape: Sequence[int]) -> tuple[str, ...]:
    """The client architectures chosen from the data when none are given.

    Args:
      feature_shape: the shape of one example.

    Returns:
      `PAPER_IMAGE_ARCHITECTURES` for images `[H, W, C]` of at least 16 x 16
      (every one of them builds on those), else `VECTOR_ARCHITECTURES`
      (vector features, or images too small for LeNet).
    """
    shape = tuple(int(d) for d in feature_shape)
    if len(shape) == 3 and min(shape[:2]) >= _SMALLEST_IMAGE:
        return PAPER_IMAGE_ARCHITECTURES
    return VECTOR_ARCHITECTURES


_BUILT_IN = frozenset(_REGISTRY)
_NAME = re.compile(r'^[a-z][a-z0-9_]*$')


def register(name: str, builder: ModelBuilder, *, replace: bool = False) -> None:
    """Makes a model of your own available by name, as the built-in ones are.

    A registered name works everywhere a model name does: `get`,
    tff-pfl-train's `--model` and KT-pFL / FedDF `--architectures`
    (through `--model_modules=your.module`, a module that calls `register`
    when imported), and the bench suites. The builder must return a fresh,
    un-compiled Keras model whose outputs are logits (a final softmax or
    sigmoid is refused when a process is built).

    Args:
      name: lower-case letters, digits and underscores, starting with a
        letter; not one of the built-in names.
      builder: `(input_shape, num_classes) -> tf.keras.Model`.
      replace: allow replacing a name registered earlier by `register`.

    Raises:
      ValueError: for a malformed or built-in name, or a name registered
        before without `replace`.
      TypeError: if `builder` is not callable.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f'name must be lower-case letters, digits and underscores, from a letter; got {name!r}')
    if name in _BUILT_IN:
        raise ValueError(f'name {name!r} is a built-in model; register yours under another name')
    if not callable(builder):
        raise TypeError(f'builder must be a function (input_shape, num_classes) -> tf.keras.Model, got {builder!r}')
    if name in _REGISTRY and not replace:
        raise ValueError(f'model {name!r} is registered already; pass replace=True to replace it')
    _REGISTRY[name] = builder


def unregister(name: str) -> None:
    """Removes a model registered by `register` (built-in ones stay).

    Args:
      name: a name given to `register`.

    Raises:
      ValueError: for a built-in or unknown name.
    """
    if name in _BUILT_IN or name not in _REGISTRY:
        raise ValueError(f'{name!r} is not a model registered by register()')
    del _REGISTRY[name]


def import_module(module: str) -> str | None:
    """Imports a module of the user's that registers models (`register`).

    Args:
      module: a dotted module name importable from `sys.path`, or the path
        of a `.py` file.

    Returns:
      None once imported (again: a no-op), else one line saying why not.
    """
    try:
        if module.endswith('.py'):
            path = os.path.abspath(module)
            if not os.path.isfile(path):
                return f'no file {module}'
            name = 'tff_pfl_user_models_' + re.sub(r'\W', '_', path)
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, path)
                loaded = importlib.util.module_from_spec(spec)
                sys.modules[name] = loaded
                try:
                    spec.loader.exec_module(loaded)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (the user's module: any error is reported in one line)
        first = (str(e).strip().splitlines() or [''])[0]
        return f'cannot import {module!r}: {type(e).__name__}: {first}'
    return None


def names() -> list[str]:
    """Names of the registered models.

    Returns:
      The sorted list of registered names.
    """
    return sorted(_REGISTRY)


def get(name: str) -> ModelBuilder:
    """Returns the builder registered as `name`.

    Args:
      name: a registered model name (see `names()`).

    Returns:
      The `ModelBuilder`, `(input_shape, num_classes) -> tf.keras.Model`.

    Raises:
      ValueError: for an unknown name.
    """
    if name not in _REGISTRY:
        raise ValueError(f'unknown model {name!r}; known: {", ".join(names())}')
    return _REGISTRY[name]


def parameter_count(name: str, feature_shape: Sequence[int], num_classes: int) -> int:
    """The number of parameters of a registered model for the data (built in a throwaway graph).

    Args:
      name: a registered model name.
      feature_shape: one example's shape.
      num_classes: the number of classes.

    Returns:
      The parameter count.
    """
    with tf.Graph().as_default():
        return int(get(name)(feature_shape, num_classes).count_params())
