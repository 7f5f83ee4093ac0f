"""FedRep's round against a numpy re-implementation of Algorithm 1: head epochs with the body fixed,
then body epochs with the new head fixed, the bodies' example-weighted mean at the server."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedrep
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3


def _linear_two_layer(seed=None):
    """body: Dense(4), head: Dense(3), no activation: logits = (x W1 + b1) W2 + b2."""
    return tf.keras.Sequential(
        [
            tf.keras.Input((FEATURES,)),
            tf.keras.layers.Dense(HIDDEN, name='body'),
            tf.keras.layers.Dense(CLASSES, name='head'),
        ]
    )


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, CLASSES))
    examples = {}
    for user, n in zip(USERS, SIZES):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(x @ w, axis=1).astype(np.int32))
    return federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('fedrep'))
    )


def _softmax_grad(logits, y):
    """d mean CE / d logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def _reference_client(x, y, body, head, *, head_epochs, body_epochs, lr):
    """Full-batch gradient descent: head_epochs steps on (W2, b2), then body_epochs on (W1, b1)."""
    w1, b1 = (a.astype(np.float64) for a in body)
    w2, b2 = (a.astype(np.float64) for a in head)
    for _ in range(head_epochs):
        h = x @ w1 + b1
        g = _softmax_grad(h @ w2 + b2, y)
        w2, b2 = w2 - lr * h.T @ g, b2 - lr * g.sum(0)
    for _ in range(body_epochs):
        h = x @ w1 + b1
        g = _softmax_grad(h @ w2 + b2, y)
        gh = g @ w2.T
        w1, b1 = w1 - lr * x.T @ gh, b1 - lr * gh.sum(0)
    return [w1, b1], [w2, b2]


def test_one_round_is_algorithm_1(spec, tff_runtime):
    # One batch holds a client's whole training split: each epoch is one full-batch step, whatever the order.
    settings = fedrep.FedRepSettings(
        local_epochs=2, fedrep_head_epochs=3, batch_size=64, client_learning_rate=0.5, server_learning_rate=1.0
    )
    process = fedrep.build_fedrep_process(spec, _linear_two_layer, settings, seed=3)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    body0 = [np.asarray(a) for a in state['model']]
    new_state, new_clients, metrics = process.next(state, clients)

    bodies, weights = [], []
    for client_id, before, after in zip(spec.client_ids, clients, new_clients):
        x, y = client_data.read_split_numpy(spec, client_id, 'train')
        head0 = [np.asarray(a) for a in before['head']]
        body, head = _reference_client(x.astype(np.float64), y, body0, head0, head_epochs=3, body_epochs=2, lr=0.5)
        for got, want in zip(after['head'], head):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
        bodies.append(body)
        weights.append(len(y))
    mean = [sum(w * b[k] for w, b in zip(weights, bodies)) / sum(weights) for k in range(2)]
    for got, want in zip(new_state['model'], mean):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    # The round's training metrics are the body phase's: every example once per body epoch.
    assert float(metrics['num_examples']) == 2 * sum(weights)


def test_the_head_phase_leaves_the_body_and_the_body_phase_the_head(spec, tff_runtime):
    """tau_h = 0 trains the body alone under the old head; a zero learning rate for the body is not expressible,
    so the body phase is checked by the head it leaves: with tau_h = 0 the client's head does not move."""
    settings = fedrep.FedRepSettings(local_epochs=1, fedrep_head_epochs=0, batch_size=64, client_learning_rate=0.5)
    process = fedrep.build_fedrep_process(spec, _linear_two_layer, settings, seed=3)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    new_state, new_clients, _ = process.next(state, clients)
    for before, after in zip(clients, new_clients):
        for a, b in zip(before['head'], after['head']):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in zip(state['model'], new_state['model']))


def test_a_client_optimizer_is_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r'^build_fedrep_process takes no client_optimizer: [^\n]+$'):
        fedrep.build_fedrep_process(spec, _linear_two_layer, client_optimizer=tff.learning.optimizers.build_sgdm(0.1))


def test_a_model_with_one_layer_is_refused_naming_personal_layers(spec):
    one_layer = functools.partial(
        lambda: tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])
    )
    with pytest.raises(ValueError, match='personal_layers=1 leaves no shared layer'):
        fedrep.build_fedrep_process(spec, one_layer)
