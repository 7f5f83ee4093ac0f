"""A grid of same-architecture models evaluated as one: stacked weights.

`forward(plan, weights, x)` runs G copies of a Keras Sequential model at once:
every weight carries a leading candidate dimension G, dense layers become
batched matmuls, so training a grid of hyper-parameters costs one loop, not G.
`plan(model)` reads the layer structure once (at trace time).

Supported layers: Flatten, Dense, Conv2D (channels_last), MaxPooling2D,
Activation, ReLU (Keras's defaults), BatchNormalization over the last axis,
and for sequences Embedding (without masking) and GRU (Keras's default cell:
reset_after, tanh / sigmoid, no dropout, returning the whole sequence).
Others raise ValueError naming the layer.

BatchNormalization runs as Keras runs it under `training=`: on the batch's
own mean and (biased) variance when training, else on the moving statistics.
Those are a fresh model's (its initializers'), as everywhere in the project
outside a client's local training (`model_weights.check_non_trainable`): only
trainable weights are stacked.
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
      ValueError: for a layer kind `forward` does not implement, or
        weights held outside the model's layers (a subclassed model).
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
        elif kind == 'ReLU':
            changed = [f'{key}={config[key]!r}' for key, wanted in _RELU_CONFIG.items() if config.get(key) != wanted]
            if changed:
                raise ValueError(f'{layer.name}: ReLU with {", ".join(changed)} is not supported')
            layers.append(Layer(kind, config, 0))
        elif kind == 'BatchNormalization':
            layers.append(_batch_norm(layer, config))
        elif kind == 'Embedding':
            if config.get('mask_zero'):
                raise ValueError(f'{layer.name}: an Embedding with mask_zero is not supported')
            layers.append(Layer(kind, config, 1))
        elif kind == 'GRU':
            unsupported = [
                f'{key}={config[key]!r}' for key, wanted in _GRU_CONFIG.items() if config.get(key, wanted) != wanted
            ]
            if unsupported:
                raise ValueError(f'{layer.name}: GRU with {", ".join(unsupported)} is not supported')
            layers.append(Layer(kind, config, 3 if config['use_bias'] else 2))
        elif kind != 'InputLayer':
            raise ValueError(f'layer {layer.name!r} of kind {kind} is not supported for stacked training')
    counted = sum(layer.num_weights for layer in layers)
    if counted != len(model.trainable_weights):
        raise ValueError(
            f'its layers hold {counted} of its {len(model.trainable_weights)} weights: stacked training needs a '
            'Sequential Keras model (not a subclassed or wrapped one, e.g. a FunctionalModel)'
        )
    return layers


def _batch_norm(layer, config) -> Layer:
    """The plan entry of a BatchNormalization layer over the last axis, with its fresh moving statistics."""
    axes = list(layer.axis) if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    rank = layer.input_spec.ndim if layer.input_spec is not None else None
    if len(axes) != 1 or (axes[0] != -1 and axes[0] != (rank or 0) - 1):
        raise ValueError(f'{layer.name}: BatchNormalization over axis {layer.axis} (not the last) is not supported')
    changed = [
        f'{key}={config[key]!r}' for key, wanted in _BATCH_NORM_CONFIG.items() if config.get(key, wanted) != wanted
    ]
    if changed:
        raise ValueError(f'{layer.name}: BatchNormalization with {", ".join(changed)} is not supported')
    config = dict(config, channels=int(layer.moving_mean.shape[-1]))
    return Layer('BatchNormalization', config, int(config['scale']) + int(config['center']))


def forward(layers: list, weights, x: tf.Tensor, training: bool = False) -> tf.Tensor:
    """Outputs of G stacked models on one shared batch.

    Args:
      layers: `plan(model)`.
      weights: the model's trainable weights in Keras order, each with a
        leading dimension G.
      x: inputs `[B, ...]`, shared by all G models.
      training: as Keras's `training=`: BatchNormalization on the batch's
        statistics (True) or on the moving ones (False); no other layer
        depends on it.

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
            h = _dense(h, params)
            h = tf.keras.activations.get(layer.config['activation'])(h)
        elif layer.kind == 'Embedding':
            h = tf.gather(params[0], h, batch_dims=1)  # [G, V, E] at [G, B, L] -> [G, B, L, E]
        elif layer.kind == 'GRU':
            h = _gru(h, params)
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
        elif layer.kind == 'ReLU':
            h = tf.nn.relu(h)
        elif layer.kind == 'BatchNormalization':
            h = _normalize(h, params, layer.config, training)
    return h


# The ReLU and BatchNormalization configurations `forward` implements.
_RELU_CONFIG = {'max_value': None, 'negative_slope': 0.0, 'threshold': 0.0}
_BATCH_NORM_CONFIG = {'renorm': False, 'virtual_batch_size': None, 'adjustment': None, 'synchronized': False}


def _normalize(h, params, config, training):
    """G BatchNormalizations over the last axis of [G, B, ..., C] (Keras's formula, epsilon inside the root)."""
    if training:
        mean, variance = tf.nn.moments(h, axes=list(range(1, h.shape.rank - 1)), keepdims=True)
    else:
        shape = [config['channels']]
        mean = tf.keras.initializers.get(config['moving_mean_initializer'])(shape)
        variance = tf.keras.initializers.get(config['moving_variance_initializer'])(shape)
    normalized = (h - mean) * tf.math.rsqrt(variance + config['epsilon'])
    params = list(params)
    if config['scale']:
        normalized = normalized * _per_channel(params.pop(0), h.shape.rank)
    if config['center']:
        normalized = normalized + _per_channel(params.pop(0), h.shape.rank)
    return normalized


def _per_channel(values, rank):
    """[G, C] as [G, 1, ..., 1, C], to broadcast over a rank-`rank` activation."""
    return tf.reshape(values, tf.concat([tf.shape(values)[:1], tf.ones([rank - 2], tf.int32), tf.shape(values)[1:]], 0))


# The GRU configuration `_gru` implements (Keras's defaults).
_GRU_CONFIG = {
    'activation': 'tanh',
    'recurrent_activation': 'sigmoid',
    'reset_after': True,
    'return_sequences': True,
    'return_state': False,
    'go_backwards': False,
    'stateful': False,
    'dropout': 0.0,
    'recurrent_dropout': 0.0,
}


def _dense(h, params):
    """[G, B, ..., U] times G kernels [G, U, V] (plus biases [G, V])."""
    if h.shape.rank == 3:
        h = tf.matmul(h, params[0])
        return h + params[1][:, tf.newaxis, :] if len(params) > 1 else h
    shape = tf.shape(h)
    y = tf.matmul(tf.reshape(h, tf.stack([shape[0], -1, shape[-1]])), params[0])
    if len(params) > 1:
        y = y + params[1][:, tf.newaxis, :]
    return tf.reshape(y, tf.concat([shape[:-1], tf.shape(params[0])[-1:]], axis=0))


def _gru(h, params):
    """G GRUs (Keras's cell, reset_after) over [G, B, L, E] inputs -> [G, B, L, U] outputs.

    Keras's gate order in the kernels is (z, r, h): z = sigmoid(x W_z + b_z +
    s U_z + c_z), r = sigmoid(x W_r + b_r + s U_r + c_r), candidate = tanh(x W_h
    + b_h + r * (s U_h + c_h)), s' = z * s + (1 - z) * candidate, with b the
    input bias and c the recurrent bias (`bias[0]`, `bias[1]`).
    """
    kernel, recurrent = params[0], params[1]  # [G, E, 3U], [G, U, 3U]
    bias = params[2] if len(params) > 2 else tf.zeros([tf.shape(kernel)[0], 2, tf.shape(kernel)[-1]], h.dtype)
    units = recurrent.shape[1]
    shape = tf.shape(h)
    inputs = tf.matmul(tf.reshape(h, tf.stack([shape[0], -1, shape[-1]])), kernel) + bias[:, 0][:, tf.newaxis, :]
    inputs = tf.reshape(inputs, tf.stack([shape[0], shape[1], shape[2], 3 * units]))
    inputs = tf.transpose(inputs, [2, 0, 1, 3])  # [L, G, B, 3U]
    recurrent_bias = bias[:, 1][:, tf.newaxis, :]

    def step(state, projected):
        x_z, x_r, x_h = tf.split(projected, 3, axis=-1)
        s_z, s_r, s_h = tf.split(tf.matmul(state, recurrent) + recurrent_bias, 3, axis=-1)
        z = tf.sigmoid(x_z + s_z)
        r = tf.sigmoid(x_r + s_r)
        candidate = tf.tanh(x_h + r * s_h)
        return z * state + (1.0 - z) * candidate

    initial = tf.zeros(tf.stack([shape[0], shape[1], units]), h.dtype)
    outputs = tf.scan(step, inputs, initializer=initial)  # [L, G, B, U]
    return tf.transpose(outputs, [1, 2, 0, 3])


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
