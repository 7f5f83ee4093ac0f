"""FedBABU's round and its personalization against a numpy re-implementation of Algorithm 1: the body trained under
the fixed initial head and averaged by examples; the global model is that body with the initial head; each client's
personalized model is the whole global model fine-tuned on its own training split."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedbabu
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3
SEED = 3
# The mean of each logit over a client's test examples: with the loss, it pins each evaluated model down.
LOGIT_MEANS = {f'logit{k}': (lambda y, logits, k=k: logits[:, k]) for k in range(CLASSES)}


def _linear_two_layer():
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
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('fedbabu'))
    )


def _initial_head():
    """theta_cls^0: the head of the run seed's initial model, built here, outside TFF."""
    with models.seeded(SEED):
        model = _linear_two_layer()
    return [w.numpy().astype(np.float64) for w in model.trainable_weights[2:]]


def _split(spec, client_id, split):
    x, y = client_data.read_split_numpy(spec, client_id, split)
    return x.astype(np.float64), y


def _softmax_grad(logits, y):
    """d mean CE / d logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def _gradient_steps(x, y, weights, *, steps, lr, train_body=True, train_head=True):
    """Full-batch gradient descent on (W1, b1, W2, b2), on the parts asked; the others stay."""
    w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in weights)
    for _ in range(steps):
        h = x @ w1 + b1
        g = _softmax_grad(h @ w2 + b2, y)
        gh = g @ w2.T
        if train_head:
            w2, b2 = w2 - lr * h.T @ g, b2 - lr * g.sum(0)
        if train_body:
            w1, b1 = w1 - lr * x.T @ gh, b1 - lr * gh.sum(0)
    return [w1, b1, w2, b2]


def _reference_round(spec, body, head, *, steps, lr, train_head=False):
    """One round: every client from (body, head); the example-weighted means (server rate 1)."""
    trained, sizes = [], []
    for client_id in spec.client_ids:
        x, y = _split(spec, client_id, 'train')
        trained.append(_gradient_steps(x, y, body + head, steps=steps, lr=lr, train_head=train_head))
        sizes.append(len(y))
    mean = [sum(n * t[k] for n, t in zip(sizes, trained)) / sum(sizes) for k in range(4)]
    return mean[:2], mean[2:], sum(sizes)


def _scores(x, y, weights):
    """What `evaluate` reports of a model on a split: the mean cross-entropy and the mean of each logit."""
    w1, b1, w2, b2 = weights
    logits = (x @ w1 + b1) @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    loss = np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y])
    return {'loss': loss, **{f'logit{k}': logits[:, k].mean() for k in range(CLASSES)}}


def _assert_scores(got, want):
    for name, value in want.items():
        np.testing.assert_allclose(float(got[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)


def _build(spec, **changes):
    # One batch holds a client's whole training split: each epoch is one full-batch step, whatever the order.
    values = dict(local_epochs=3, fedbabu_finetune_epochs=2, batch_size=64, client_learning_rate=0.5)
    settings = fedbabu.FedBABUSettings(**{**values, **changes})
    return fedbabu.build_fedbabu_process(spec, _linear_two_layer, settings, metrics=LOGIT_MEANS, seed=SEED)


def test_one_round_and_the_personalized_models_are_algorithm_1(spec, tff_runtime):
    process = _build(spec)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    body0 = [np.asarray(a, np.float64) for a in state['model']]
    head0 = _initial_head()
    new_state, new_clients, metrics = process.next(state, clients)

    body, head, examples = _reference_round(spec, body0, head0, steps=3, lr=0.5)
    for got, want in zip(new_state['model'], body):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    for got, want in zip(head, head0):  # the reference's own head: trained with the body fixed, it does not move
        np.testing.assert_array_equal(got, want)
    assert float(metrics['num_examples']) == 3 * examples

    evaluation = process.evaluate(new_state, new_clients)
    for client_id, result in zip(spec.client_ids, evaluation):
        # global_model: the averaged body with the initial head.
        x_test, y_test = _split(spec, client_id, spec.evaluation_split)
        _assert_scores(result['global_model'], _scores(x_test, y_test, body + head0))
        # personalized_model: two epochs of the whole model (body and head) from it, on the client's training split.
        x, y = _split(spec, client_id, 'train')
        tuned = _gradient_steps(x, y, body + head0, steps=2, lr=0.5)
        _assert_scores(result['personalized_model'], _scores(x_test, y_test, tuned))


def test_the_head_stays_at_its_initialization_round_after_round(spec, tff_runtime):
    """Two rounds match the reference with the head fixed; training the head in the rounds (FedAvg on the whole
    model) would give another body and another global model, far beyond the tolerance."""
    process = _build(spec, local_epochs=2)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    for _ in range(2):
        state, clients, _ = process.next(state, clients)

    fixed = [np.asarray(a, np.float64) for a in process.initialize()['model']], _initial_head()
    trained = fixed
    for _ in range(2):
        fixed = _reference_round(spec, *fixed, steps=2, lr=0.5)[:2]
        trained = _reference_round(spec, *trained, steps=2, lr=0.5, train_head=True)[:2]
    got = [np.asarray(a) for a in state['model']]
    for g, want in zip(got, fixed[0]):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)
    assert max(np.abs(g - other).max() for g, other in zip(got, trained[0])) > 1e-2

    x_test, y_test = _split(spec, spec.client_ids[0], spec.evaluation_split)
    (result,) = process.evaluate(state, clients[:1])
    _assert_scores(result['global_model'], _scores(x_test, y_test, fixed[0] + _initial_head()))
    assert abs(float(result['global_model']['loss']) - _scores(x_test, y_test, trained[0] + trained[1])['loss']) > 1e-3


def test_a_client_optimizer_is_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r'^build_fedbabu_process takes no client_optimizer: [^\n]+$'):
        fedbabu.build_fedbabu_process(spec, _linear_two_layer, client_optimizer=tff.learning.optimizers.build_sgdm(0.1))


def test_a_model_with_one_layer_is_refused_naming_personal_layers(spec):
    def one_layer():
        return tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])

    with pytest.raises(ValueError, match=r'^personal_layers=1 leaves no shared layer: [^\n]+FedBABU needs'):
        fedbabu.build_fedbabu_process(spec, one_layer)


def test_no_fine_tuning_is_refused_in_one_line(spec):
    with pytest.raises(settings_lib.SettingsError, match=r'^fedbabu_finetune_epochs must be >= 1, got 0$'):
        fedbabu.build_fedbabu_process(spec, _linear_two_layer, fedbabu.FedBABUSettings(fedbabu_finetune_epochs=0))
