"""FedRoD's round against a numpy re-implementation: the body and generic head trained with the balanced softmax
(cross-entropy of g + gamma log N_c, a class the client lacks left out) and averaged by examples; each client's
personal head trained with cross-entropy on g + P(z) with z and g detached; the generic model is `global_model`,
g + P(z) is `personalized_model`. The personal head never moves the shared model."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg, fedrod
from tff_pfl import settings as settings_lib
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3
SEED = 3
STEPS, LR, GAMMA = 3, 0.5, 0.5
# The mean of each logit over a client's test examples: with the loss, it pins each evaluated model down.
LOGIT_MEANS = {f'logit{k}': (lambda y, logits, k=k: logits[:, k]) for k in range(CLASSES)}


def _linear_two_layer():
    """body: Dense(4), generic head: Dense(3), no activation: g = (x W1 + b1) W2 + b2."""
    return tf.keras.Sequential(
        [
            tf.keras.Input((FEATURES,)),
            tf.keras.layers.Dense(HIDDEN, name='body'),
            tf.keras.layers.Dense(CLASSES, name='head'),
        ]
    )


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    """Three clients; 'cat' has no example of class 2, so its balanced softmax leaves class 2 out."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, CLASSES))
    examples = {}
    for user, n in zip(USERS, SIZES):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        scores = x @ w if user != 'cat' else x @ w[:, :2]
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(scores, axis=1).astype(np.int32))
    return federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('fedrod'))
    )


def _split(spec, client_id, split):
    x, y = client_data.read_split_numpy(spec, client_id, split)
    return x.astype(np.float64), y


def _balanced_grad(logits, y, counts, gamma):
    """d/d logits of mean -log(N_y^gamma e^{l_y} / sum_c N_c^gamma e^{l_c}) (0^gamma = 0 for gamma > 0, 1 for 0)."""
    weights = np.power(counts.astype(np.float64), gamma)
    e = weights * np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def _cross_entropy(logits, y):
    z = logits - logits.max(axis=1, keepdims=True)
    return np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y])


def _reference_round(spec, weights, p_heads, gamma=GAMMA):
    """One round of full-batch steps from (W1, b1, W2, b2) and each client's P-head (Wp, bp), all updated at once
    from the step's values; the example-weighted mean of the shared weights (server rate 1)."""
    shared, heads, sizes, loss_sum = [], [], [], 0.0
    for client_id, p_head in zip(spec.client_ids, p_heads):
        x, y = _split(spec, client_id, 'train')
        counts = np.bincount(y, minlength=CLASSES)
        w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in weights)
        wp, bp = (np.asarray(a, np.float64) for a in p_head)
        for _ in range(STEPS):
            z = x @ w1 + b1
            g = z @ w2 + b2
            dg = _balanced_grad(g, y, counts, gamma)  # L_BSM: body and generic head
            personalized = g + z @ wp + bp
            dp = _balanced_grad(personalized, y, counts, 0.0)  # L_P: cross-entropy, z and g held fixed
            loss_sum += _cross_entropy(personalized, y) * len(y)
            dz = dg @ w2.T
            w1, b1, w2, b2 = w1 - LR * x.T @ dz, b1 - LR * dz.sum(0), w2 - LR * z.T @ dg, b2 - LR * dg.sum(0)
            wp, bp = wp - LR * z.T @ dp, bp - LR * dp.sum(0)
        shared.append([w1, b1, w2, b2])
        heads.append([wp, bp])
        sizes.append(len(y))
    mean = [sum(n * s[k] for n, s in zip(sizes, shared)) / sum(sizes) for k in range(4)]
    return mean, heads, loss_sum / (STEPS * sum(sizes))


def _scores(logits, y):
    """What `evaluate` reports of a model on a split: the mean cross-entropy and the mean of each logit."""
    return {'loss': _cross_entropy(logits, y), **{f'logit{k}': logits[:, k].mean() for k in range(CLASSES)}}


def _assert_scores(got, want):
    for name, value in want.items():
        np.testing.assert_allclose(float(got[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)


def _build(spec, model_fn=_linear_two_layer, **changes):
    # One batch holds a client's whole training split: each epoch is one full-batch step, whatever the order.
    values = dict(local_epochs=STEPS, batch_size=64, client_learning_rate=LR, fedrod_bsm_gamma=GAMMA)
    settings = fedrod.FedRoDSettings(**{**values, **changes})
    return fedrod.build_fedrod_process(spec, model_fn, settings, metrics=LOGIT_MEANS, seed=SEED)


def _one_round(spec, **changes):
    process = _build(spec, **changes)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    new_state, new_clients, metrics = process.next(state, clients)
    return dict(
        process=process,
        initial=[np.asarray(a, np.float64) for a in state['model']],
        initial_heads=[[np.asarray(a) for a in c['p_head']] for c in clients],
        state=new_state,
        clients=new_clients,
        metrics=metrics,
    )


@pytest.fixture(scope='module')
def first_round(spec, tff_runtime):
    """One round with the default P-head start: a copy of the initial generic head."""
    return _one_round(spec)


def test_one_round_and_both_models_are_the_reference(spec, first_round):
    initial = first_round['initial']
    for heads in first_round['initial_heads']:  # every P-head starts as the run seed's initial generic head
        for got, want in zip(heads, initial[2:]):
            np.testing.assert_array_equal(got, want)
    shared, heads, train_loss = _reference_round(spec, initial, [initial[2:]] * len(USERS))
    for got, want in zip(first_round['state']['model'], shared):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    for client, want in zip(first_round['clients'], heads):
        for got, w in zip(client['p_head'], want):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)
    metrics = first_round['metrics']
    assert float(metrics['num_examples']) == STEPS * sum(len(_split(spec, c, 'train')[1]) for c in spec.client_ids)
    np.testing.assert_allclose(float(metrics['train_loss']), train_loss, rtol=1e-4)

    evaluation = first_round['process'].evaluate(first_round['state'], first_round['clients'])
    w1, b1, w2, b2 = shared
    for client_id, result, (wp, bp) in zip(spec.client_ids, evaluation, heads):
        x, y = _split(spec, client_id, spec.evaluation_split)
        z = x @ w1 + b1
        _assert_scores(result['global_model'], _scores(z @ w2 + b2, y))  # g alone
        _assert_scores(result['personalized_model'], _scores(z @ w2 + b2 + z @ wp + bp, y))  # g + P(z)


def test_the_personal_head_never_moves_the_shared_model(spec, first_round):
    """P-heads from zero: their own reference, and the same body and generic head as with the other start."""
    zeros = _one_round(spec, fedrod_p_head_init='zeros')
    initial = zeros['initial']
    for heads in zeros['initial_heads']:
        assert all(not np.any(h) for h in heads)
    _, heads, _ = _reference_round(spec, initial, [[np.zeros_like(a) for a in initial[2:]]] * len(USERS))
    for client, want in zip(zeros['clients'], heads):
        for got, w in zip(client['p_head'], want):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)
        assert max(np.abs(np.asarray(g) - h).max() for g, h in zip(client['p_head'], initial[2:])) > 1e-2
    for got, other in zip(zeros['state']['model'], first_round['state']['model']):
        np.testing.assert_allclose(np.asarray(got), np.asarray(other), rtol=0, atol=1e-6)


def test_without_the_balance_the_shared_model_is_fedavgs(spec, tff_runtime):
    """gamma = 0: plain cross-entropy; the body and generic head are FedAvg's, which has no personal head."""
    rod = _one_round(spec, fedrod_bsm_gamma=0.0)
    settings = fedavg.FedAvgSettings(local_epochs=STEPS, batch_size=64, client_learning_rate=LR)
    process = fedavg.build_fedavg_process(spec, _linear_two_layer, settings, seed=SEED)
    state, _, _ = process.next(process.initialize(), process.initial_client_states(spec.client_ids))
    for got, want in zip(rod['state']['model'], state['model']):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    balanced, _, _ = _reference_round(spec, rod['initial'], [rod['initial'][2:]] * len(USERS))
    assert max(np.abs(np.asarray(g) - b).max() for g, b in zip(state['model'], balanced)) > 1e-3


def _residual():
    """A functional model: a residual body, a one-layer generic head."""
    inputs = tf.keras.Input((FEATURES,))
    h = tf.keras.layers.Dense(HIDDEN, activation='relu')(inputs)
    h = tf.keras.layers.Add()([h, tf.keras.layers.Dense(HIDDEN)(h)])
    return tf.keras.Model(inputs, tf.keras.layers.Dense(CLASSES)(h), name='residual')


def test_a_functional_models_heads_run_on_its_bodys_features(spec, tff_runtime):
    """With a zero P-head, g + P(z) is the model's own output: the split of a functional model loses nothing."""
    process = _build(spec, model_fn=_residual, fedrod_p_head_init='zeros')
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    for result in process.evaluate(state, clients):
        for name, value in result['global_model'].items():
            np.testing.assert_allclose(float(result['personalized_model'][name]), float(value), rtol=1e-6)
    state, clients, metrics = process.next(state, clients)
    assert np.isfinite(float(metrics['train_loss']))


def test_logits_beyond_the_classes_are_classes_every_client_lacks(spec, tff_runtime):
    """A model with 5 logits for 3 classes (taken by every builder): the balanced softmax leaves the extra 2 out,
    so the generic head's rows for them get no gradient from it and stay where they started."""

    def wider():
        return tf.keras.Sequential(
            [tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(HIDDEN), tf.keras.layers.Dense(CLASSES + 2)]
        )

    rod = _one_round(spec, model_fn=wider)
    _, _, w2, b2 = (np.asarray(a) for a in rod['state']['model'])
    np.testing.assert_array_equal(w2[:, CLASSES:], rod['initial'][2][:, CLASSES:].astype(np.float32))
    np.testing.assert_array_equal(b2[CLASSES:], rod['initial'][3][CLASSES:].astype(np.float32))
    assert np.abs(w2[:, :CLASSES] - rod['initial'][2][:, :CLASSES]).max() > 1e-3
    assert np.isfinite(float(rod['metrics']['train_loss']))


def test_a_head_that_is_not_a_chain_is_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r'^model_fn: FedRoD runs the layers from the generic head on \(fedrod_head_l'):
        _build(spec, model_fn=_residual, fedrod_head_layers=2)


def test_a_client_optimizer_is_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r'^build_fedrod_process takes no client_optimizer: [^\n]+$'):
        fedrod.build_fedrod_process(spec, _linear_two_layer, client_optimizer=tff.learning.optimizers.build_sgdm(0.1))


def test_a_model_with_one_layer_is_refused_naming_fedrod_head_layers(spec):
    def one_layer():
        return tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])

    with pytest.raises(ValueError, match=r'^fedrod_head_layers=1 leaves no body layer: [^\n]+FedRoD needs'):
        fedrod.build_fedrod_process(spec, one_layer)


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(fedrod_bsm_gamma=-1.0), r'^fedrod_bsm_gamma must be >= 0, got -1.0$'),
        (dict(fedrod_p_head_init='copy'), r"^fedrod_p_head_init must be one of initial, zeros, got 'copy'$"),
    ],
)
def test_bad_settings_are_refused_in_one_line(spec, changes, message):
    with pytest.raises(settings_lib.SettingsError, match=message):
        fedrod.build_fedrod_process(spec, _linear_two_layer, fedrod.FedRoDSettings(**changes))
