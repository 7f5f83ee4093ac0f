"""Float64 numpy re-implementations the algorithm tests compare against.

A dense ReLU network (`tff_pfl.models.mnist_dnn`, `logistic`) with softmax
cross-entropy, its gradients by hand, and the project's batch order. Only the
example order is taken from the project (its stateless permutations), so
that a test checks the algorithm's arithmetic, not its random draws.
"""

import numpy as np
import tensorflow as tf

from tff_pfl.computations import local_training
from tff_pfl.data import client_data


def as_float64(weights):
    return [np.asarray(w, np.float64) for w in weights]


def forward(params, x):
    """Logits of a dense network [W1, b1, W2, b2, ...], ReLU between layers."""
    activations = [x]
    h = x
    for i in range(0, len(params), 2):
        z = h @ params[i] + params[i + 1]
        h = np.maximum(z, 0.0) if i + 2 < len(params) else z
        activations.append(h)
    return h, activations


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def loss_and_grads(params, x, y):
    """Mean softmax cross-entropy and its gradient for every parameter."""
    logits, activations = forward(params, x)
    p = softmax(logits)
    n = len(y)
    loss = -np.mean(np.log(p[np.arange(n), y]))
    delta = p.copy()
    delta[np.arange(n), y] -= 1.0
    delta /= n
    grads = [None] * len(params)
    for layer in range(len(params) // 2 - 1, -1, -1):
        h = activations[layer]
        grads[2 * layer] = h.T @ delta
        grads[2 * layer + 1] = delta.sum(axis=0)
        if layer > 0:
            delta = (delta @ params[2 * layer].T) * (activations[layer] > 0)
    return loss, grads


def accuracy(params, x, y):
    logits, _ = forward(params, x)
    return float(np.mean(np.argmax(logits, axis=1) == y))


def read(spec, client_id, split='train'):
    x, y = client_data.read_split_numpy(spec, client_id, split)
    return x.reshape(len(y), -1).astype(np.float64), y


def batch_stream(seed_parts, client_id, round_num, n, epochs, batch_size, salt=0, offset=None):
    """The project's batch `i -> indices` for a client's round (`local_training.batch_stream`)."""
    seed = local_training.client_seed(seed_parts, tf.constant(round_num), tf.constant(client_id), salt=salt)
    if offset is not None:
        seed = seed + tf.constant(offset, tf.int64)
    epochs = max(int(epochs), 1)
    permutations = local_training.epoch_permutations(seed, epochs, n).numpy()
    per_epoch = -(-n // batch_size)

    def batch(i):
        epoch, start = (i // per_epoch) % epochs, (i % per_epoch) * batch_size
        return permutations[epoch, start : start + batch_size]

    return per_epoch, batch


def num_steps(config, per_epoch, batches_per_step=1):
    steps = max(config.epochs * per_epoch // batches_per_step, 1)
    return steps if config.max_steps is None else min(steps, config.max_steps)


def sgd(params, x, y, config, batch, steps, grad_fn=None):
    """Plain SGD over `steps` batches of the stream; `grad_fn(params, xb, yb)` adds terms."""
    params = [p.copy() for p in params]
    for i in range(steps):
        idx = batch(i)
        _, grads = loss_and_grads(params, x[idx], y[idx])
        if grad_fn is not None:
            grads = [g + extra for g, extra in zip(grads, grad_fn(params))]
        params = [p - config.learning_rate * g for p, g in zip(params, grads)]
    return params


def weighted_mean(values, weights):
    weights = np.asarray(weights, np.float64) / np.sum(weights)
    return [sum(w * v[i] for w, v in zip(weights, values)) for i in range(len(values[0]))]


def assert_close(actual, expected, atol=2e-5, rtol=2e-4):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, atol=atol, rtol=rtol)


def numeric_gradient(f, c, eps=1e-6):
    """Central finite differences of a scalar function `f` at the array `c`."""
    grad = np.zeros_like(c)
    for index in np.ndindex(c.shape):
        plus, minus = c.copy(), c.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = (f(plus) - f(minus)) / (2 * eps)
    return grad
