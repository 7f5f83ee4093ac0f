"""FedDBE's rounds against a numpy re-implementation: round 0 trains h(f(x)) with no bias and no MR and forms the
global representation mean once, the example-weighted mean of the clients' running means; round 1 trains the model
and each client's bias on the loss of h(f(x) + bias) plus kappa times the mean regularizer; the model is averaged
by examples; `personalized_model` is the global model with the client's bias. The bias never reaches the server."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import feddbe
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, privacy
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3
SEED = 3
STEPS, LR, MU, KAPPA = 3, 0.1, 0.5, 20.0
# The mean of each logit over a client's test examples: with the loss, it pins each evaluated model down.
LOGIT_MEANS = {f'logit{k}': (lambda y, logits, k=k: logits[:, k]) for k in range(CLASSES)}


def _linear_two_layer():
    """feature extractor: Dense(4), head: Dense(3), no activation: logits = (x W1 + b1 + bias) W2 + b2."""
    return tf.keras.Sequential(
        [tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(HIDDEN), tf.keras.layers.Dense(CLASSES)]
    )


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    rng = np.random.default_rng(0)
    examples = {}
    for k, (user, n) in enumerate(zip(USERS, SIZES)):
        x = (rng.normal(size=(n, FEATURES)) + 0.5 * k).astype(np.float32)  # a shifted domain per client
        examples[user] = collections.OrderedDict(x=x, y=rng.integers(0, CLASSES, n).astype(np.int32))
    return federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('feddbe'))
    )


def _split(spec, client_id, split):
    x, y = client_data.read_split_numpy(spec, client_id, split)
    return x.astype(np.float64), y


def _softmax_grad(logits, y):
    """d/d logits of the mean cross-entropy, and the mean cross-entropy."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y])
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y), loss


def _reference_clients(spec, weights, biases, global_mean):
    """Each client's full-batch steps; global_mean None: round 0 (no bias, no MR). Returns the clients' models,
    biases, running means, training examples and the sum of their losses times their examples."""
    models, new_biases, means, sizes, loss_sum = [], [], [], [], 0.0
    dbe = global_mean is not None
    for client_id, bias in zip(spec.client_ids, biases):
        x, y = _split(spec, client_id, 'train')
        n = len(y)
        w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in weights)
        bias = np.asarray(bias, np.float64)
        running = np.zeros(HIDDEN)
        for _ in range(STEPS):
            z = x @ w1 + b1
            running = (1 - MU) * running + MU * z.mean(0)
            shifted = z + bias if dbe else z
            dl, loss = _softmax_grad(shifted @ w2 + b2, y)
            loss_sum += loss * n
            dz = dl @ w2.T
            if dbe:  # d/dz_j of KAPPA mean_k 0.5 (running_k - g_k)^2, running = ... + MU mean_j z_j
                dz = dz + KAPPA * MU * (running - global_mean) / (HIDDEN * n)
            dbias = dl.sum(0) @ w2.T if dbe else 0.0
            w1, b1, w2, b2 = w1 - LR * x.T @ dz, b1 - LR * dz.sum(0), w2 - LR * shifted.T @ dl, b2 - LR * dl.sum(0)
            bias = bias - LR * dbias
        models.append([w1, b1, w2, b2])
        new_biases.append(bias)
        means.append(running)
        sizes.append(n)
    return models, new_biases, means, sizes, loss_sum


def _reference_round(spec, weights, biases, global_mean):
    """One round of full-batch steps; global_mean None: round 0 (no bias, no MR). Returns the example-weighted
    mean model, the biases, the example-weighted mean of the running means and the train loss."""
    models, new_biases, means, sizes, loss_sum = _reference_clients(spec, weights, biases, global_mean)
    total = sum(sizes)
    mean = [sum(n * m[k] for n, m in zip(sizes, models)) / total for k in range(4)]
    formed = sum(n * m for n, m in zip(sizes, means)) / total
    return mean, new_biases, formed, loss_sum / (STEPS * total)


def _scores(logits, y):
    z = logits - logits.max(axis=1, keepdims=True)
    loss = np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y])
    return {'loss': loss, **{f'logit{k}': logits[:, k].mean() for k in range(CLASSES)}}


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5)


def _build(spec, model_aggregator=None, **changes):
    # One batch holds a client's whole training split: each epoch is one full-batch step.
    values = dict(
        local_epochs=STEPS, batch_size=64, client_learning_rate=LR, feddbe_momentum=MU, feddbe_kl_weight=KAPPA
    )
    settings = feddbe.FedDBESettings(**{**values, **changes})
    return feddbe.build_feddbe_process(
        spec, _linear_two_layer, settings, model_aggregator=model_aggregator, metrics=LOGIT_MEANS, seed=SEED
    )


def _rounds(process, spec, rounds):
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    for _ in range(rounds):
        state, clients, metrics = process.next(state, clients)
    return state, clients, metrics


@pytest.fixture(scope='module')
def two_rounds(spec, tff_runtime):
    process = _build(spec)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    initial = [np.asarray(a, np.float64) for a in state['model']]
    state1, clients1, metrics1 = process.next(state, clients)
    state2, clients2, metrics2 = process.next(state1, clients1)
    return dict(process=process, initial=initial, rounds=[(state1, clients1, metrics1), (state2, clients2, metrics2)])


def test_two_rounds_are_the_reference(spec, two_rounds):
    zero = [np.zeros(HIDDEN)] * len(USERS)
    model, biases, formed, loss0 = _reference_round(spec, two_rounds['initial'], zero, None)
    (state1, clients1, metrics1), (state2, clients2, metrics2) = two_rounds['rounds']
    for got, want in zip(state1['model'], model):
        _close(got, want)
    _close(state1['global_mean'], formed)  # formed once, in round 0
    for client in clients1:  # round 0 trains no bias
        assert not np.any(np.asarray(client['bias']))
    np.testing.assert_allclose(float(metrics1['train_loss']), loss0, rtol=1e-4)

    model2, biases2, _, loss1 = _reference_round(spec, model, biases, formed)
    for got, want in zip(state2['model'], model2):
        _close(got, want)
    _close(state2['global_mean'], formed)  # kept, not re-formed
    for client, want in zip(clients2, biases2):
        _close(client['bias'], want)
        assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(float(metrics2['train_loss']), loss1, rtol=1e-4)

    evaluation = two_rounds['process'].evaluate(state2, clients2)
    w1, b1, w2, b2 = model2
    for client_id, result, bias in zip(spec.client_ids, evaluation, biases2):
        x, y = _split(spec, client_id, spec.evaluation_split)
        z = x @ w1 + b1
        for name, value in _scores(z @ w2 + b2, y).items():
            np.testing.assert_allclose(float(result['global_model'][name]), value, rtol=1e-4, atol=1e-5)
        for name, value in _scores((z + bias) @ w2 + b2, y).items():
            np.testing.assert_allclose(float(result['personalized_model'][name]), value, rtol=1e-4, atol=1e-5)


def test_the_mean_regularizer_moves_the_model(spec, two_rounds):
    """kappa = 0: another feature extractor after round 1 (MR's gradient reaches the model through z)."""
    process = _build(spec, feddbe_kl_weight=0.0)
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    for _ in range(2):
        state, clients, _ = process.next(state, clients)
    w1 = np.asarray(two_rounds['rounds'][1][0]['model'][0])
    assert np.abs(np.asarray(state['model'][0]) - w1).max() > 1e-4


def test_the_bias_never_crosses_to_the_server(spec):
    process = _build(spec)
    uploads = [(str(name), str(t)) for name, t in audit.clients_to_server_values(process.next)]
    assert not any('bias' in name for name, _ in uploads)
    # float32[4]: the update of b1 and the running mean, not the client's bias (a third one).
    assert ' '.join(t for _, t in uploads).count(f'float32[{HIDDEN}]') == 2
    assert 'bias' in str(process.next.type_signature.parameter[1])  # it is in the client state


def test_a_weighted_mean_factory_is_the_default_round(spec, two_rounds):
    """MeanFactory over the record [update, n_i-weighted running mean]: the fused default's means, by examples."""
    state, clients, metrics = _rounds(_build(spec, tff.aggregators.MeanFactory()), spec, 2)
    want_state, want_clients, _ = two_rounds['rounds'][1]
    for got, want in zip(state['model'], want_state['model']):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state['global_mean'], want_state['global_mean'], rtol=1e-6, atol=1e-6)
    for got, want in zip(clients, want_clients):
        np.testing.assert_allclose(got['bias'], want['bias'], rtol=1e-6, atol=1e-6)
    assert 'aggregator_state' in state and 'train_loss' in metrics


def test_dp_clips_the_update_and_the_round_0_mean_as_one_record(spec, two_rounds):
    """Noise 0, clip C: each client's [update, zbar_i] scaled by min(1, C / its L2 norm), summed, over q N."""
    clip = 0.55
    process = _build(spec, privacy.DPConfig(0.0, clients_per_round=len(USERS), clip=clip).factory())
    state, _, _ = _rounds(process, spec, 1)
    initial = two_rounds['initial']
    models, _, means, _, _ = _reference_clients(spec, initial, [np.zeros(HIDDEN)] * len(USERS), None)
    records = [[w - m for w, m in zip(initial, model)] + [mean] for model, mean in zip(models, means)]
    norms = [np.sqrt(sum(np.sum(part**2) for part in record)) for record in records]
    assert min(norms) < clip < sorted(norms)[1]  # one record kept whole, two clipped
    mean = [
        sum(part * min(1.0, clip / norm) for part, norm in zip(parts, norms)) / len(USERS) for parts in zip(*records)
    ]
    for got, w, update in zip(state['model'], initial, mean[:-1]):
        _close(got, w - update)
    _close(state['global_mean'], mean[-1])
    # Clipped, the mean part is not the example-weighted mean of the running means.
    assert np.abs(mean[-1] - np.asarray(two_rounds['rounds'][0][0]['global_mean'])).max() > 1e-3
    assert 'l2_norm_clip' in str(process.next.type_signature.parameter[0])  # its state is the server's
    # The noised mean a DP run declares: the model's parameters and the representation's width.
    dimension = sum(w.size for w in initial) + HIDDEN
    assert feddbe._record_upload(None, spec, process, 1.0) == [algorithm.Upload(dimension, float(len(USERS)))]


def test_secure_sums_give_the_plain_rounds(spec, two_rounds):
    """The example-weighted means through secure sums, up to the 32-bit quantization of their range."""
    process = _build(spec, privacy.secure_mean_factory(max(SIZES)))
    state, clients, metrics = _rounds(process, spec, 2)
    want_state, want_clients, _ = two_rounds['rounds'][1]
    for got, want in zip(state['model'], want_state['model']):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(state['global_mean'], want_state['global_mean'], atol=1e-5)
    for got, want in zip(clients, want_clients):
        np.testing.assert_allclose(got['bias'], want['bias'], atol=1e-5)
    assert metrics['aggregator']['mean_value']['secure_upper_clipped_count'] == 0
    # What crosses as large as the head's layer (the metric sums are smaller): the record, through secure sums.
    layer_bytes = 4 * (HIDDEN + 1) * CLASSES
    uploads = {uri for uri, t in audit.clients_to_server_values(process.next) if audit.type_bytes(t) >= layer_bytes}
    assert uploads == {'federated_secure_sum_bitwidth'}, uploads


def test_the_device_form_sends_what_the_round_does_with_dp_and_secure_sums(spec):
    process = _build(spec, privacy.DPConfig(1.0, clients_per_round=len(USERS), clip=1.0).factory(secure=True))

    def crossings(comps):
        return sorted((uri, str(t)) for comp in comps for uri, t in audit.clients_to_server_values(comp))

    assert crossings(process.device.phases.values()) == crossings([process.next])
    assert not any('bias' in t for _, t in crossings([process.next]))


def test_a_client_optimizer_is_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r'^build_feddbe_process takes no client_optimizer: [^\n]+$'):
        feddbe.build_feddbe_process(spec, _linear_two_layer, client_optimizer=tff.learning.optimizers.build_sgdm(0.1))


def test_a_model_with_one_layer_is_refused_in_one_line(spec):
    def one_layer():
        return tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])

    with pytest.raises(ValueError, match=r'^head_layers=1 leaves no feature extractor layer: [^\n]+FedDBE needs'):
        feddbe.build_feddbe_process(spec, one_layer)


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(feddbe_momentum=0.0), r'^feddbe_momentum must be in \(0, 1\], got 0.0$'),
        (dict(feddbe_kl_weight=-1.0), r'^feddbe_kl_weight must be >= 0, got -1.0$'),
    ],
)
def test_bad_settings_are_refused_in_one_line(spec, changes, message):
    with pytest.raises(settings_lib.SettingsError, match=message):
        feddbe.build_feddbe_process(spec, _linear_two_layer, feddbe.FedDBESettings(**changes))
