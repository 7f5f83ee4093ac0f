"""FedALA's rounds against a numpy re-implementation of Algorithm 1: adaptive local aggregation (the lower layer takes
the global model, the top layer's element-wise weights W <- clip(W - eta grad_W L, 0, 1) learned with the start
phase's passes, then one pass a round), local training from the mixed model, FedAvg's example-weighted mean; the
personalized model is the ALA model against the current global model."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedala
from tff_pfl import settings as settings_lib
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3
SEED = 3
START_PASSES = 3
# The mean of each logit over a client's test examples: with the loss, it pins each evaluated model down.
LOGIT_MEANS = {f'logit{k}': (lambda y, logits, k=k: logits[:, k]) for k in range(CLASSES)}


def _linear_two_layer():
    """lower: Dense(4), top: Dense(3), no activation: logits = (x W1 + b1) W2 + b2."""
    return tf.keras.Sequential(
        [
            tf.keras.Input((FEATURES,)),
            tf.keras.layers.Dense(HIDDEN, name='lower'),
            tf.keras.layers.Dense(CLASSES, name='top'),
        ]
    )


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, CLASSES))
    examples = {}
    for user, n in zip(USERS, SIZES):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        # Each client its own labelling (a column permutation): personal top layers pay.
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(x @ w[:, rng.permutation(CLASSES)], axis=1))
        examples[user]['y'] = examples[user]['y'].astype(np.int32)
    return federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('fedala'))
    )


def _split(spec, client_id, split):
    x, y = client_data.read_split_numpy(spec, client_id, split)
    return x.astype(np.float64), y


def _gradients(x, y, weights):
    """Full-batch gradients of the mean cross-entropy by (W1, b1, W2, b2)."""
    w1, b1, w2, b2 = weights
    h = x @ w1 + b1
    logits = h @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    g = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    g[np.arange(len(y)), y] -= 1.0
    g /= len(y)
    gh = g @ w2.T
    return [x.T @ gh, gh.sum(0), h.T @ g, g.sum(0)]


def _ala(x, y, local, global_, ala_weights, passes, eta, clip=True):
    """Adaptive local aggregation: (W, theta_hat); the lower layer is the global one, the top one mixed by W."""

    def mixed(ws):
        return global_[:2] + [t + (g - t) * w for t, g, w in zip(local[2:], global_[2:], ws)]

    for _ in range(passes):  # one full-batch step per pass (s = 100 %, a batch larger than the client's split)
        grads = _gradients(x, y, mixed(ala_weights))[2:]
        ala_weights = [w - eta * gr * (g - t) for w, gr, t, g in zip(ala_weights, grads, local[2:], global_[2:])]
        if clip:
            ala_weights = [np.clip(w, 0.0, 1.0) for w in ala_weights]
    return ala_weights, mixed(ala_weights)


def _passes(client, global_, start_passes):
    """0 while theta_i is the global model on the top layer, the start phase's passes the first time, then 1."""
    if all(np.array_equal(t, g) for t, g in zip(client['local'][2:], global_[2:])):
        return 0
    return 1 if client['started'] else start_passes


def _reference_round(spec, global_, clients, *, eta, steps, lr, start_passes=START_PASSES, clip=True):
    """One round for every client; returns the new global model (server rate 1) and client states."""
    trained, sizes, new_clients = [], [], {}
    for client_id in spec.client_ids:
        client = clients[client_id]
        x, y = _split(spec, client_id, 'train')
        passes = _passes(client, global_, start_passes)
        ala_weights, model = _ala(x, y, client['local'], global_, client['W'], passes, eta, clip)
        for _ in range(steps):
            model = [w - lr * g for w, g in zip(model, _gradients(x, y, model))]
        trained.append(model)
        sizes.append(len(y))
        new_clients[client_id] = dict(local=model, W=ala_weights, started=client['started'] or passes > 0)
    mean = [sum(n * t[k] for n, t in zip(sizes, trained)) / sum(sizes) for k in range(4)]
    return mean, new_clients


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
    # s = 100 % and one batch holding a client's whole split: each pass and each epoch is one full-batch step.
    values = dict(
        local_epochs=2,
        batch_size=64,
        client_learning_rate=0.5,
        fedala_eta=20.0,
        fedala_sample_percent=100.0,
        fedala_start_passes=START_PASSES,
        fedala_threshold=0.0,  # the start phase runs all its passes
    )
    settings = fedala.FedALASettings(**{**values, **changes})
    return fedala.build_fedala_process(spec, _linear_two_layer, settings, metrics=LOGIT_MEANS, seed=SEED)


def _initial(spec, state):
    model = [np.asarray(a, np.float64) for a in state['model']]
    return model, {c: dict(local=model, W=[np.ones_like(w) for w in model[2:]], started=False) for c in spec.client_ids}


def _assert_close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5)


def test_three_rounds_and_the_personalized_models_are_algorithm_1(spec, tff_runtime):
    """Round 0 is FedAvg (theta_i is the global model: nothing to mix), round 1 the start phase, round 2 one pass."""
    process = _build(spec)
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    global_, reference = _initial(spec, state)
    for _ in range(3):
        state, clients, metrics = process.next(state, clients)
        global_, reference = _reference_round(spec, global_, reference, eta=20.0, steps=2, lr=0.5)
        _assert_close(state['model'], global_)
    assert float(metrics['num_examples']) == 2 * sum(len(_split(spec, c, 'train')[1]) for c in spec.client_ids)
    for client_id, client in zip(spec.client_ids, clients):
        _assert_close(client['local'], reference[client_id]['local'])
        _assert_close(client['ala_weights'], reference[client_id]['W'])
        assert int(client['ala_start_passes']) == START_PASSES
    moved = np.concatenate([np.ravel(w) for c in clients for w in c['ala_weights']])
    assert moved.min() < 0.9 and (moved == 1.0).any()  # learned, and clipped at 1

    for client_id, result in zip(spec.client_ids, process.evaluate(state, clients)):
        x_test, y_test = _split(spec, client_id, spec.evaluation_split)
        _assert_scores(result['global_model'], _scores(x_test, y_test, global_))
        # personalized_model: one pass of ALA against the current global model, no local training.
        x, y = _split(spec, client_id, 'train')
        client = reference[client_id]
        _, mixed = _ala(x, y, client['local'], global_, client['W'], 1, 20.0)
        _assert_scores(result['personalized_model'], _scores(x_test, y_test, mixed))


def test_the_weights_are_clipped_to_the_unit_interval(spec, tff_runtime):
    """A step so large that the unclipped weights leave [0, 1] on both sides: they stop at 0 and 1."""
    process = _build(spec, fedala_eta=100.0, fedala_start_passes=1)
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    global_, reference = _initial(spec, state)
    for _ in range(2):
        state, clients, _ = process.next(state, clients)
        before = global_, reference
        global_, reference = _reference_round(spec, global_, reference, eta=100.0, steps=2, lr=0.5, start_passes=1)
    _, unclipped = _reference_round(spec, *before, eta=100.0, steps=2, lr=0.5, start_passes=1, clip=False)
    got = np.concatenate([np.ravel(w) for c in clients for w in c['ala_weights']])
    free = np.concatenate([np.ravel(w) for c in spec.client_ids for w in unclipped[c]['W']])
    assert free.min() < -0.5 and free.max() > 1.5
    assert got.min() == 0.0 and got.max() == 1.0
    for client_id, client in zip(spec.client_ids, clients):
        _assert_close(client['ala_weights'], reference[client_id]['W'])
    _assert_close(state['model'], global_)


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(fedala_sample_percent=0.0), r'^fedala_sample_percent must be in \(0, 100\], got 0.0$'),
        (dict(fedala_eta=0.0), r'^fedala_eta must be > 0, got 0.0$'),
        (dict(fedala_layers=0), r'^fedala_layers must be >= 1, got 0$'),
        (dict(fedala_loss_window=1), r'^fedala_loss_window must be >= 2, got 1$'),
        (dict(fedala_start_passes=0), r'^fedala_start_passes must be >= 1, got 0$'),
    ],
)
def test_a_bad_setting_is_refused_in_one_line(spec, changes, message):
    with pytest.raises(settings_lib.SettingsError, match=message):
        fedala.build_fedala_process(spec, _linear_two_layer, fedala.FedALASettings(**changes))


def test_more_layers_than_the_model_has_are_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r'^fedala_layers=3 is more than the 2 layers with weights of model [^\n]+$'):
        fedala.build_fedala_process(spec, _linear_two_layer, fedala.FedALASettings(fedala_layers=3))


def test_the_start_phase_stops_once_the_last_losses_settle(spec, tff_runtime):
    """With a threshold every spread passes, the start phase stops after fedala_loss_window + 1 passes (the authors'
    rule: more losses than the window, and their spread under the threshold), not at fedala_start_passes."""
    process = _build(spec, fedala_threshold=1e9, fedala_loss_window=2, fedala_start_passes=20)
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    global_, reference = _initial(spec, state)
    for _ in range(2):
        state, clients, _ = process.next(state, clients)
        global_, reference = _reference_round(spec, global_, reference, eta=20.0, steps=2, lr=0.5, start_passes=3)
    for client_id, client in zip(spec.client_ids, clients):
        assert int(client['ala_start_passes']) == 3
        _assert_close(client['ala_weights'], reference[client_id]['W'])
