"""A grid of same-architecture models evaluated as one: stacked weights.

`forward(plan, weights, x)` runs G copies of a Keras Sequential model at once:
every weight carries a leading candidate dimension G, dense layers become
batched matmuls, so training a grid of hyper-parameters costs one loop, not G.
`plan(model)` reads the layer structure once (at trace time).

Supported layers: Flatten, Dense, Conv2D (channels_last), MaxPooling2D,
Activation. Others raise ValueError naming the layer.
"""

import collections

import tensorflow as tf

Layer = collections.namedtuple('Layer', ['kind', 'config', 'num_weights'])


def plan(model: tf.keras.Model) -> list:
    """The layer plan of a Sequential Keras model.

    Args:
      model: a Sequential Keras model of supported layers.

    Returns:
      A list of `Layer(kind, config, num_weights)`, one per layer but the
      input layer, in order.

    Raises:
      ValueError: for a layer kind `forward` does not implement.
    """
    layers = []
    for layer in model.layers:
        config = layer.get_config()
        kind = type(layer).__name__
        if kind in ('Dense', 'Conv2D'):
            if config.get('data_format', 'channels_last') != 'channels_last':
                raise ValueError(f'{layer.name}: only channels_last is supported')
            layers.append(Layer(kind, config, 2 if config['use_bias'] else 1))
        elif kind in ('Flatten', 'MaxPooling2D', 'Activation'):
            layers.append(Layer(kind, config, 0))
        elif kind != 'InputLayer':
            raise ValueError(f'layer {layer.name!r} of kind {kind} is not supported for stacked training')
    return layers


def forward(layers: list, weights, x: tf.Tensor) -> tf.Tensor:
    """Outputs of G stacked models on one shared batch.

    Args:
      layers: `plan(model)`.
      weights: the model's trainable weights in Keras order, each with a
        leading dimension G.
      x: inputs `[B, ...]`, shared by all G models.

    Returns:
      `[G, B, ...]` outputs (logits for the project's models).
    """
    num_models = tf.shape(weights[0])[0]
    h = tf.broadcast_to(x, tf.concat([[num_models], tf.shape(x)], axis=0))
    index = 0
    for layer in layers:
        params = weights[index : index + layer.num_weights]
        index += layer.num_weights
        if layer.kind == 'Flatten':
            h = tf.reshape(h, tf.concat([tf.shape(h)[:2], [-1]], axis=0))
        elif layer.kind == 'Dense':
            h = tf.matmul(h, params[0])
            if len(params) > 1:
                h = h + params[1][:, tf.newaxis, :]
            h = tf.keras.activations.get(layer.config['activation'])(h)
        elif layer.kind == 'Conv2D':
            h = _conv2d(h, params, layer.config)
        elif layer.kind == 'MaxPooling2D':
            h = _per_model(
                h,
                lambda y, c=layer.config: tf.nn.max_pool2d(
                    y, c['pool_size'], c['strides'] or c['pool_size'], c['padding'].upper()
                ),
            )
        elif layer.kind == 'Activation':
            h = tf.keras.activations.get(layer.config['activation'])(h)
    return h


def _per_model(h, fn):
    """Applies a [B, H, W, C] op to [G, B, H, W, C] by folding G into B."""
    shape = tf.shape(h)
    y = fn(tf.reshape(h, tf.concat([[-1], shape[2:]], axis=0)))
    return tf.reshape(y, tf.concat([shape[:2], tf.shape(y)[1:]], axis=0))


def _conv2d(h, params, config):
    """Conv2D of G models with their own kernels: a grouped convolution.

    The G inputs are laid side by side along channels, [B, H, W, G*C], and
    the G kernels along output channels, [kh, kw, C, G*F]; `groups = G`.
    """
    kernel = params[0]  # [G, kh, kw, C, F]
    num_models = kernel.shape[0]
    shape = tf.shape(h)
    channels = h.shape[-1]
    x = tf.transpose(h, [1, 2, 3, 0, 4])  # [B, H, W, G, C]
    x = tf.reshape(x, tf.concat([shape[1:4], [num_models * channels]], axis=0))
    k = tf.transpose(kernel, [1, 2, 3, 0, 4])  # [kh, kw, C, G, F]
    filters = kernel.shape[-1]
    k = tf.reshape(k, [kernel.shape[1], kernel.shape[2], channels, num_models * filters])
    y = tf.nn.conv2d(
        x, k, strides=config['strides'], padding=config['padding'].upper(), dilations=config['dilation_rate']
    )
    out_shape = tf.shape(y)
    y = tf.reshape(y, tf.concat([out_shape[:3], [num_models, filters]], axis=0))
    y = tf.transpose(y, [3, 0, 1, 2, 4])  # [G, B, H', W', F]
    if len(params) > 1:
        y = y + params[1][:, tf.newaxis, tf.newaxis, tf.newaxis, :]
    return tf.keras.activations.get(config['activation'])(y)
