"""FedProto's rounds against a numpy re-implementation: each client's own model trained on cross-entropy plus
lambda times the mean squared error between its embeddings and their class's global prototype (a class without
one adding 0), its per-class mean embeddings uploaded with their presence, and the server's equal mean over the
clients that have each class. No model is averaged: each client's model is `personalized_model`."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedproto
from tff_pfl.computations import device_state, privacy
from tff_pfl.data import client_data, federated

USERS = ('ann', 'ben', 'cat')
SIZES = (40, 30, 35)
FEATURES, HIDDEN, CLASSES = 6, 4, 3
SEED = 3
STEPS, LR, LAMBDA = 3, 0.5, 0.7


def _linear_two_layer():
    """body: Dense(4), head: Dense(3), no activation: the embedding z = x W1 + b1, the logits z W2 + b2."""
    return tf.keras.Sequential(
        [
            tf.keras.Input((FEATURES,)),
            tf.keras.layers.Dense(HIDDEN, name='body'),
            tf.keras.layers.Dense(CLASSES, name='head'),
        ]
    )


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    """Three clients; 'cat' has no example of class 2."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, CLASSES))
    examples = {}
    for user, n in zip(USERS, SIZES):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        scores = x @ w if user != 'cat' else x @ w[:, :2]
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(scores, axis=1).astype(np.int32))
    return federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples), cache_dir=str(tmp_path_factory.mktemp('fedproto'))
    )


def _train(spec, client_id):
    x, y = client_data.read_split_numpy(spec, client_id, 'train')
    return x.astype(np.float64), y


def _reference_client(spec, client_id, weights, prototypes, has_prototype, lam=LAMBDA):
    """Full-batch steps on CE + lam * sum_i [y_i has one] ||z_i - C_{y_i}||^2 / (n d), all weights updated at once;
    then the per-class mean embeddings of the trained model and the classes present. Returns (weights, means,
    present, summed loss)."""
    x, y = _train(spec, client_id)
    n = len(y)
    w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in weights)
    onehot = np.eye(CLASSES)[y]
    mask = np.asarray(has_prototype, np.float64)[y][:, None]
    centres = np.asarray(prototypes, np.float64)[y]
    loss_sum = 0.0
    for _ in range(STEPS):
        z = x @ w1 + b1
        logits = z @ w2 + b2
        shifted = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        ce = np.mean(-np.log(p[np.arange(n), y]))
        proto = np.sum(mask * (z - centres) ** 2) / (n * HIDDEN)
        loss_sum += (ce + lam * proto) * n
        dlogits = (p - onehot) / n
        dz = dlogits @ w2.T + lam * 2.0 * mask * (z - centres) / (n * HIDDEN)
        w1, b1, w2, b2 = w1 - LR * x.T @ dz, b1 - LR * dz.sum(0), w2 - LR * z.T @ dlogits, b2 - LR * dlogits.sum(0)
    z = x @ w1 + b1
    present = np.array([float(np.any(y == k)) for k in range(CLASSES)])
    means = np.stack([z[y == k].mean(axis=0) if present[k] else np.zeros(HIDDEN) for k in range(CLASSES)])
    return [w1, b1, w2, b2], means, present, loss_sum


def _reference_server(uploads):
    """C_bar^(j): the equal mean of the clients' prototypes of class j over the clients that have it."""
    sums = sum(means * present[:, None] for means, present in uploads)
    clients = sum(present for _, present in uploads)
    return sums / np.maximum(clients, 1.0)[:, None], clients


def _build(spec, model_fn=_linear_two_layer, dp=None, secure=False, **changes):
    # One batch holds a client's whole training split: each epoch is one full-batch step, whatever the order.
    values = dict(local_epochs=STEPS, batch_size=64, client_learning_rate=LR, fedproto_lambda=LAMBDA)
    return fedproto.build_fedproto_process(
        spec, model_fn, fedproto.FedProtoSettings(**{**values, **changes}), seed=SEED, dp=dp, secure=secure
    )


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope='module')
def rounds(spec, tff_runtime):
    """Round 1 samples 'cat' alone (classes 0 and 1 get prototypes, 2 none); round 2 all three clients."""
    process = _build(spec)
    state = process.initialize()
    initial = process.initial_client_states(spec.client_ids)  # ann, ben, cat
    state1, (cat1,), metrics1 = process.next(state, [initial[2]])
    clients2 = [initial[0], initial[1], cat1]
    state2, after2, metrics2 = process.next(state1, clients2)
    return dict(
        process=process,
        state=state,
        initial=initial,
        state1=state1,
        cat1=cat1,
        metrics1=metrics1,
        clients2=clients2,
        state2=state2,
        after2=after2,
        metrics2=metrics2,
    )


def test_first_round_no_prototype_term_and_one_clients_prototypes(spec, rounds):
    np.testing.assert_array_equal(np.asarray(rounds['state']['prototype_clients']), np.zeros(CLASSES))
    start = [np.asarray(a) for a in rounds['initial'][2]['model']]
    for client in rounds['initial']:  # every client starts from the run seed's initial model
        for got, want in zip(client['model'], start):
            np.testing.assert_array_equal(np.asarray(got), want)
    weights, means, present, loss_sum = _reference_client(
        spec, spec.client_ids[2], start, np.zeros((CLASSES, HIDDEN)), np.zeros(CLASSES)
    )
    for got, want in zip(rounds['cat1']['model'], weights):
        _close(got, want)
    assert list(present) == [1.0, 1.0, 0.0]
    prototypes, clients = _reference_server([(means, present)])
    _close(rounds['state1']['prototypes'], prototypes)
    np.testing.assert_array_equal(np.asarray(rounds['state1']['prototype_clients']), clients)
    assert int(rounds['metrics1']['num_prototypes']) == 2
    size = len(_train(spec, spec.client_ids[2])[1])
    np.testing.assert_allclose(float(rounds['metrics1']['train_loss']), loss_sum / (STEPS * size), rtol=1e-4)


def test_second_round_is_the_reference_with_a_class_without_prototype(spec, rounds):
    prototypes = np.asarray(rounds['state1']['prototypes'], np.float64)
    has = (np.asarray(rounds['state1']['prototype_clients']) > 0).astype(np.float64)
    assert list(has) == [1.0, 1.0, 0.0]  # ann's and ben's class-2 examples add no prototype term
    uploads, total = [], 0.0
    for client_id, client, after in zip(spec.client_ids, rounds['clients2'], rounds['after2']):
        weights, means, present, loss_sum = _reference_client(spec, client_id, client['model'], prototypes, has)
        for got, want in zip(after['model'], weights):
            _close(got, want)
        assert int(after['num_participations']) == int(client['num_participations']) + 1
        uploads.append((means, present))
        total += loss_sum
    want_prototypes, want_clients = _reference_server(uploads)
    np.testing.assert_array_equal(np.asarray(rounds['state2']['prototype_clients']), [3.0, 3.0, 2.0])
    np.testing.assert_array_equal(np.asarray(rounds['state2']['prototype_clients']), want_clients)
    _close(rounds['state2']['prototypes'], want_prototypes)
    metrics = rounds['metrics2']
    size = sum(len(_train(spec, c)[1]) for c in spec.client_ids)
    assert float(metrics['num_examples']) == STEPS * size
    np.testing.assert_allclose(float(metrics['train_loss']), total / (STEPS * size), rtol=1e-4)


def test_the_uploads_are_each_clients_class_means_and_presence(spec, rounds, tmp_path):
    """The device form's client work, run on its own: what one client sends up."""
    process = rounds['process']
    work = process.device.client_computations['client_work']
    value = collections.OrderedDict(
        prototypes=rounds['state1']['prototypes'],
        prototype_clients=rounds['state1']['prototype_clients'],
        round_num=rounds['state1']['round_num'],
    )
    prototypes = np.asarray(value['prototypes'], np.float64)
    has = (np.asarray(value['prototype_clients']) > 0).astype(np.float64)
    for client_id, client in zip(spec.client_ids, rounds['clients2']):
        device_state.save(str(tmp_path / f'{client_id}.state'), client)
        sent = work(value, device_state.device_input(client_id, str(tmp_path)))
        _, means, present, _ = _reference_client(spec, client_id, client['model'], prototypes, has)
        _close(sent['prototypes']['sums'], means * present[:, None])
        np.testing.assert_array_equal(np.asarray(sent['prototypes']['clients']), present)
    assert list(np.asarray(sent['prototypes']['clients'])) == [1.0, 1.0, 0.0]  # cat: no class 2


def test_evaluate_is_each_clients_own_model(spec, rounds):
    evaluation = rounds['process'].evaluate(rounds['state2'], rounds['after2'])
    for client_id, client, result in zip(spec.client_ids, rounds['after2'], evaluation):
        assert set(result) == {'personalized_model'}
        x, y = client_data.read_split_numpy(spec, client_id, spec.evaluation_split)
        w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in client['model'])
        logits = (x.astype(np.float64) @ w1 + b1) @ w2 + b2
        accuracy = np.mean(np.argmax(logits, axis=1) == y)
        np.testing.assert_allclose(float(result['personalized_model']['accuracy']), accuracy, atol=1e-6)
    assert not rounds['process'].has_global_model


@pytest.mark.parametrize(
    'keyword, message',
    [
        ('server_optimizer', '^build_fedproto_process takes no server_optimizer: the server averages'),
        ('model_aggregator', '^build_fedproto_process takes no model_aggregator: FedProto uploads no model'),
    ],
)
def test_refuses_what_it_cannot_use_in_one_line(spec, keyword, message):
    value = tff.learning.optimizers.build_sgdm(1.0) if keyword == 'server_optimizer' else tff.aggregators.MeanFactory()
    with pytest.raises(ValueError, match=message) as raised:
        fedproto.build_fedproto_process(spec, _linear_two_layer, **{keyword: value})
    assert '\n' not in str(raised.value)


def test_refuses_a_model_without_a_body_in_one_line(spec):
    def one_layer():
        return tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(CLASSES)])

    with pytest.raises(ValueError, match='^fedproto_head_layers=1 leaves no body') as raised:
        _build(spec, one_layer)
    assert '\n' not in str(raised.value)


def _one_round(process, spec):
    """Round 1 of `process` with all three clients from the initial model (no prototype term yet)."""
    state = process.initialize()
    state1, _, metrics = process.next(state, process.initial_client_states(spec.client_ids))
    return state1, metrics


def test_dp_clips_each_clients_record_as_a_whole(spec, rounds, tff_runtime):
    """Noise 0: the global prototypes are the clients' means weighted by s_i = min(1, C / ||(u_i, presence_i)||)."""
    start = [np.asarray(a) for a in rounds['initial'][0]['model']]
    records = []
    for client_id in spec.client_ids:
        _, means, present, _ = _reference_client(spec, client_id, start, np.zeros((CLASSES, HIDDEN)), np.zeros(CLASSES))
        records.append((means * present[:, None], present))
    norms = [np.sqrt(np.sum(u**2) + np.sum(p**2)) for u, p in records]
    clip = float(np.median(norms))  # clips one client or two, leaves the others whole
    scales = [min(1.0, clip / n) for n in norms]
    assert min(scales) < 1.0 == max(scales)
    sums = sum(s * u for s, (u, _) in zip(scales, records)) / len(USERS)
    counts = sum(s * p for s, (_, p) in zip(scales, records)) / len(USERS)
    dp = privacy.DPConfig(0.0, clients_per_round=len(USERS), clip=clip)
    state1, metrics = _one_round(_build(spec, dp=dp), spec)
    _close(state1['prototype_clients'], counts)
    _close(state1['prototypes'], sums / counts[:, None])
    assert int(metrics['num_prototypes']) == CLASSES


def test_the_dp_count_threshold_is_three_noise_deviations_with_a_floor():
    record = tff.StructWithPythonType(
        [('sums', tff.TensorType(np.float32, [CLASSES, HIDDEN])), ('clients', tff.TensorType(np.float32, [CLASSES]))],
        collections.OrderedDict,
    )
    _, noised = fedproto._record_aggregation(record, privacy.DPConfig(1.5, clients_per_round=20.0, clip=2.0), False)
    assert noised == pytest.approx(3 * 1.5 * 2.0 / 20.0)
    _, exact = fedproto._record_aggregation(record, privacy.DPConfig(0.0, clients_per_round=20.0, clip=2.0), False)
    assert exact == pytest.approx(1e-3 * 2.0 / 20.0)
    assert fedproto._record_aggregation(record, None, False) == (None, 0.5)


def test_secure_sums_give_the_plain_round(spec, tff_runtime):
    plain, _ = _one_round(_build(spec), spec)
    secure, metrics = _one_round(_build(spec, secure=True), spec)
    np.testing.assert_allclose(np.asarray(secure['prototypes']), np.asarray(plain['prototypes']), atol=1e-5)
    np.testing.assert_allclose(np.asarray(secure['prototype_clients']), [3.0, 3.0, 2.0], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(plain['prototype_clients']), [3.0, 3.0, 2.0])
    assert metrics['aggregator']['secure_upper_clipped_count'] == 0  # nothing beyond the secure sum's range


def test_dp_refuses_adaptive_clipping_in_one_line(spec):
    dp = privacy.DPConfig(0.0, clients_per_round=3.0, target_quantile=0.5)
    with pytest.raises(ValueError, match="^dp: FedProto's DP needs a fixed clip") as raised:
        _build(spec, dp=dp)
    assert '\n' not in str(raised.value)
