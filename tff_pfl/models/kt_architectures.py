"""KT-pFL's heterogeneous image architectures: small CPU versions and the papers' sizes.

AlexNet, ResNet-18 and ShuffleNetV2 beside LeNet (`persfl_cnn`), the four
architectures of KT-pFL's Section 5.1, each a plain builder `(input_shape,
num_classes) -> tf.keras.Model` with logits out; `tff_pfl.models` registers
them by name (`alexnet_small`, `resnet_small`, `shufflenet_small`, `alexnet`,
`resnet18`, `shufflenet_v2`) and re-exports them.
"""

import math
from collections.abc import Sequence

import tensorflow as tf


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
