"""LG-FedAvg's round against a numpy re-implementation of Algorithm 1: each client trains its local layers and the
global layers together, keeps the local ones, and the server takes the example-weighted mean of the global ones."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import lgfedavg
from tff_pfl.computations import audit
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3


def _linear_two_layer():
    """local: Dense(4), global: Dense(3), no activation: logits = (x W1 + b1) W2 + b2."""
    return tf.keras.Sequential(
        [
            tf.keras.Input((FEATURES,)),
            tf.keras.layers.Dense(HIDDEN, name='representation'),
            tf.keras.layers.Dense(CLASSES, name='classifier'),
        ]
    )


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(FEATURES, CLASSES))
    examples = {}
    for user, n in zip(USERS, SIZES):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(x @ w, axis=1).astype(np.int32))
    return federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('lgfedavg'))
    )


def _softmax_grad(logits, y):
    """d mean CE / d logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def _reference_client(x, y, local, shared, *, steps, lr):
    """Full-batch gradient descent on both layers at once (LocalUpdate of Algorithm 1)."""
    w1, b1 = (a.astype(np.float64) for a in local)
    w2, b2 = (a.astype(np.float64) for a in shared)
    for _ in range(steps):
        h = x @ w1 + b1
        g = _softmax_grad(h @ w2 + b2, y)
        gh = g @ w2.T
        w1, b1, w2, b2 = w1 - lr * x.T @ gh, b1 - lr * gh.sum(0), w2 - lr * h.T @ g, b2 - lr * g.sum(0)
    return [w1, b1], [w2, b2]


def _round(spec, process, state, clients, steps, lr):
    """The reference's round: each client's new local layers, and the mean of the clients' global layers."""
    shared0 = [np.asarray(a) for a in state['model']]
    locals_, shareds, weights = [], [], []
    for client_id, before in zip(spec.client_ids, clients):
        x, y = client_data.read_split_numpy(spec, client_id, 'train')
        local0 = [np.asarray(a) for a in before['local_layers']]
        local, shared = _reference_client(x.astype(np.float64), y, local0, shared0, steps=steps, lr=lr)
        locals_.append(local)
        shareds.append(shared)
        weights.append(len(y))
    mean = [sum(w * s[k] for w, s in zip(weights, shareds)) / sum(weights) for k in range(2)]
    return locals_, mean


def test_two_rounds_are_algorithm_1(spec, tff_runtime):
    # One batch holds a client's whole training split: each epoch is one full-batch step, whatever the order.
    settings = lgfedavg.LGFedAvgSettings(local_epochs=3, batch_size=64, client_learning_rate=0.5)
    process = lgfedavg.build_lgfedavg_process(spec, _linear_two_layer, settings, seed=5)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    # The server holds the global (last) layer only; every client starts from the same representation.
    assert [np.shape(a) for a in state['model']] == [(HIDDEN, CLASSES), (CLASSES,)]
    assert [np.shape(a) for a in clients[0]['local_layers']] == [(FEATURES, HIDDEN), (HIDDEN,)]
    for _ in range(2):  # the second round starts from each client's own, now different, representation
        want_locals, want_shared = _round(spec, process, state, clients, steps=3, lr=0.5)
        state, clients, metrics = process.next(state, clients)
        for after, want in zip(clients, want_locals):
            for got, w in zip(after['local_layers'], want):
                np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)
        for got, want in zip(state['model'], want_shared):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    assert float(metrics['num_examples']) == 3 * sum(spec.sizes('train').values())  # three epochs
    assert not np.allclose(np.asarray(clients[0]['local_layers'][0]), np.asarray(clients[1]['local_layers'][0]))


def test_only_the_global_layers_cross_from_clients_to_the_server(spec):
    process = lgfedavg.build_lgfedavg_process(spec, _linear_two_layer, lgfedavg.LGFedAvgSettings())
    uploads = ' '.join(str(t) for _, t in audit.clients_to_server_values(process.next))
    assert f'float32[{HIDDEN},{CLASSES}]' in uploads
    assert f'float32[{FEATURES},{HIDDEN}]' not in uploads


def test_a_model_with_one_layer_is_refused_naming_global_layers(spec):
    def one_layer():
        return tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])

    with pytest.raises(ValueError, match=r'^global_layers=1 leaves no local layer: [^\n]+global_layers \+ 1 = 2$'):
        lgfedavg.build_lgfedavg_process(spec, one_layer)


def test_global_layers_below_one_is_refused():
    with pytest.raises(ValueError, match='global_layers must be >= 1, got 0'):
        lgfedavg.LGFedAvgSettings(global_layers=0).validate()
