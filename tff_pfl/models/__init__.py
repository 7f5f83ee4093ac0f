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
import math
import os
import random
import re
import sys
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


def _image_input(input_shape):
    if len(input_shape) != 3:
        raise ValueError(f'this model needs image inputs [H, W, C], got {tuple(input_shape)}')
    return tf.keras.Input(shape=tuple(input_shape))


def alexnet_small(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """A small AlexNet-style CNN: three 3x3 conv layers (32, 64, 64), two
    max-pools, a 128-unit dense layer, logits. (KT-pFL's heterogeneous set.)

    Args:
      input_shape: shape of one image, [H, W, C].
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.

    Raises:
      ValueError: if `input_shape` is not [H, W, C].
    """
    inputs = _image_input(input_shape)
    h = tf.keras.layers.Conv2D(32, 3, padding='same', activation='relu')(inputs)
    h = tf.keras.layers.MaxPool2D(2)(h)
    h = tf.keras.layers.Conv2D(64, 3, padding='same', activation='relu')(h)
    h = tf.keras.layers.MaxPool2D(2)(h)
    h = tf.keras.layers.Conv2D(64, 3, padding='same', activation='relu')(h)
    h = tf.keras.layers.Flatten()(h)
    h = tf.keras.layers.Dense(128, activation='relu')(h)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(h), name='alexnet_small')


def _conv_norm(h, filters, kernel, strides=1, relu=True, depthwise=False):
    """Convolution, group normalisation (4 groups, or 2 where the number of
    channels is not a multiple of 4, e.g. ShuffleNetV2's 58-channel branches),
    optional ReLU.

    Group normalisation stands in for batch normalisation: its only weights
    are trainable (scale and offset), so a client's whole model is its
    trainable weights, and it does not depend on batch statistics, which
    non-IID clients would not share (Hsieh et al., "The Non-IID Data
    Quagmire", ICML 2020). Without any normalisation these nets did not
    train with SGD at lr 0.1 on MNIST (resnet 0.68 accuracy after 75 epochs
    on 600 examples, shufflenet diverged).
    """
    if depthwise:
        h = tf.keras.layers.DepthwiseConv2D(kernel, strides=strides, padding='same', use_bias=False)(h)
    else:
        h = tf.keras.layers.Conv2D(filters, kernel, strides=strides, padding='same', use_bias=False)(h)
    h = tf.keras.layers.GroupNormalization(groups=math.gcd(4, h.shape[-1]))(h)
    return tf.keras.layers.ReLU()(h) if relu else h


def _basic_block(h, filters, stride):
    """ResNet's basic block: two 3x3 convolutions, a 1x1 projection shortcut when the shape changes."""
    y = _conv_norm(h, filters, 3, strides=stride)
    y = _conv_norm(y, filters, 3, relu=False)
    shortcut = h
    if stride != 1 or h.shape[-1] != filters:
        shortcut = _conv_norm(h, filters, 1, strides=stride, relu=False)
    return tf.keras.layers.ReLU()(tf.keras.layers.Add()([y, shortcut]))


def resnet_small(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """A small ResNet: a strided 16-channel stem, two residual stages (16 and 32
    channels, the second strided with a 1x1 projection shortcut), logits from
    the flattened 7x7 map (with global average pooling instead, it reached
    0.68-0.9 test accuracy, unstably, where LeNet reaches 0.95). Group normalisation after every convolution
    instead of batch normalisation (see `_conv_norm`).

    Args:
      input_shape: shape of one image, [H, W, C].
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.

    Raises:
      ValueError: if `input_shape` is not [H, W, C].
    """
    inputs = _image_input(input_shape)
    h = _conv_norm(inputs, 16, 3, strides=2)
    for filters, stride in ((16, 1), (32, 2)):
        h = _basic_block(h, filters, stride)
    h = tf.keras.layers.Flatten()(h)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(h), name='resnet_small')


def _channel_shuffle(x, groups=2):
    height, width, channels = x.shape[1], x.shape[2], x.shape[3]
    x = tf.reshape(x, [-1, height, width, groups, channels // groups])
    x = tf.transpose(x, [0, 1, 2, 4, 3])
    return tf.reshape(x, [-1, height, width, channels])


def _shuffle_unit(x, channels, stride):
    branch_channels = channels // 2

    def branch(y):
        y = _conv_norm(y, branch_channels, 1)
        y = _conv_norm(y, None, 3, strides=stride, relu=False, depthwise=True)
        return _conv_norm(y, branch_channels, 1)

    if stride == 1:
        left = tf.keras.layers.Lambda(lambda t: t[..., :branch_channels])(x)
        right = tf.keras.layers.Lambda(lambda t: t[..., branch_channels:])(x)
        out = tf.keras.layers.Concatenate()([left, branch(right)])
    else:
        left = _conv_norm(x, None, 3, strides=stride, relu=False, depthwise=True)
        left = _conv_norm(left, branch_channels, 1)
        out = tf.keras.layers.Concatenate()([left, branch(x)])
    return tf.keras.layers.Lambda(_channel_shuffle)(out)


def shufflenet_small(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """A small ShuffleNetV2-style net: a strided 3x3 stem (24 channels), a
    strided and a plain shuffle unit at 48 channels (channel split, 1x1 -
    depthwise 3x3 - 1x1 branch, concatenation, channel shuffle), logits from
    the flattened 7x7 map (see `resnet_small`). Group normalisation after every convolution
    (see `_conv_norm`).

    Args:
      input_shape: shape of one image, [H, W, C].
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.

    Raises:
      ValueError: if `input_shape` is not [H, W, C].
    """
    inputs = _image_input(input_shape)
    h = _conv_norm(inputs, 24, 3, strides=2)
    h = _shuffle_unit(h, 48, 2)
    h = _shuffle_unit(h, 48, 1)
    h = tf.keras.layers.Flatten()(h)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(h), name='shufflenet_small')


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


def alexnet(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """AlexNet for small images, as in KT-pFL's released code (cugzj/KT-pFL).

    Five 3x3 convolutions ('same' padding, ReLU) with 64, 192, 384, 256, 256
    filters, the first with stride 2; 2x2 max-pooling after the first, second
    and fifth; then AlexNet's classifier: dense 4096 - 4096 (ReLU) - logits.
    On 28x28 the features reaching the classifier are 1x1x256 (the authors'
    code says so: 256*2*2 on 32x32, 256 on 28x28); the first dense layer takes
    the flattened map whatever its size. About 20.1M parameters on 28x28x1,
    84% of them in the 4096x4096 layer.

    AlexNet's dropout (0.5 before both 4096-unit layers) is left out: every
    model here is a deterministic function of its weights and input, so runs
    repeat exactly. It has no weights, so the parameter count is unchanged.

    Args:
      input_shape: shape of one image, [H, W, C], at least 8x8 (three
        halving pools after a stride-2 convolution).
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model` (Sequential).

    Raises:
      ValueError: if `input_shape` is not [H, W, C] or is smaller than 8x8.
    """
    if len(input_shape) != 3 or min(input_shape[:2]) < 8:
        raise ValueError(f'alexnet needs image inputs [H, W, C] of at least 8x8, got {tuple(input_shape)}')
    conv = tf.keras.layers.Conv2D
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=tuple(input_shape)),
            conv(64, 3, strides=2, padding='same', activation='relu'),
            tf.keras.layers.MaxPool2D(2),
            conv(192, 3, padding='same', activation='relu'),
            tf.keras.layers.MaxPool2D(2),
            conv(384, 3, padding='same', activation='relu'),
            conv(256, 3, padding='same', activation='relu'),
            conv(256, 3, padding='same', activation='relu'),
            tf.keras.layers.MaxPool2D(2),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(4096, activation='relu'),
            tf.keras.layers.Dense(4096, activation='relu'),
            tf.keras.layers.Dense(num_classes),
        ],
        name='alexnet',
    )


def resnet18(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """ResNet-18 (He et al. 2016) with the CIFAR-style stem used at 32x32 and below.

    Stem: one 3x3 convolution, 64 channels, stride 1, and no max-pool (the
    ImageNet stem's 7x7 stride-2 convolution and 3x3 max-pool would shrink a
    28x28 image to 7x7 before the first block). Then four stages of two basic
    blocks (two 3x3 convolutions), 64-128-256-512 channels, stages 2-4 starting
    with stride 2 and a 1x1 projection shortcut; global average pooling;
    `num_classes` logits. Convolutions have no bias; group normalisation takes
    batch normalisation's place after every convolution (see `_conv_norm`),
    with the same trainable parameters (scale and offset per channel) and no
    moving statistics. On 28x28 the maps are 28, 14, 7, 4 ('same' padding).
    11,172,810 parameters on 28x28x1 with 10 classes (11,173,962 with 3 input
    channels, the usual CIFAR-10 count).

    Args:
      input_shape: shape of one image, [H, W, C].
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.

    Raises:
      ValueError: if `input_shape` is not [H, W, C].
    """
    inputs = _image_input(input_shape)
    h = _conv_norm(inputs, 64, 3)
    for stage, filters in enumerate((64, 128, 256, 512)):
        for block in range(2):
            h = _basic_block(h, filters, 2 if stage > 0 and block == 0 else 1)
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(h), name='resnet18')


def shufflenet_v2(input_shape: Sequence[int], num_classes: int) -> tf.keras.Model:
    """ShuffleNetV2 1.0x (Ma et al. 2018) with a small-input stem.

    Stem: a 3x3 convolution, 24 channels, stride 1, and no max-pool (the
    ImageNet stem has stride 2 and a 3x3 stride-2 max-pool). Then three
    stages of shuffle units with 116, 232, 464 channels, repeated 4, 8, 4
    times, the first unit of each with stride 2 (the units of
    `shufflenet_small`: both branches 1x1 - depthwise 3x3 - 1x1 at half the
    stage's channels, as in the paper's Figure 3 and torchvision); conv5, a
    1x1 convolution to 1024 channels; global average pooling;
    `num_classes` logits. Group normalisation after every convolution (see
    `_conv_norm`). On 28x28 the maps are 28, 14, 7, 4. 1,263,422 parameters
    on 28x28x1 with 10 classes (torchvision's `shufflenet_v2_x1_0`, 2,278,604
    with 3 channels and 1000 classes, differs only in the first convolution
    and the classifier).

    Args:
      input_shape: shape of one image, [H, W, C].
      num_classes: number of output logits.

    Returns:
      An un-compiled `tf.keras.Model`.

    Raises:
      ValueError: if `input_shape` is not [H, W, C].
    """
    inputs = _image_input(input_shape)
    h = _conv_norm(inputs, 24, 3)
    for channels, repeats in ((116, 4), (232, 8), (464, 4)):
        h = _shuffle_unit(h, channels, 2)
        for _ in range(repeats - 1):
            h = _shuffle_unit(h, channels, 1)
    h = _conv_norm(h, 1024, 1)
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(h), name='shufflenet_v2')


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
