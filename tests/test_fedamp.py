"""FedAMP: the attentive message passing (xi, u_i) and the clients' proximal step against numpy, what crosses to the
server, the device form, and the settings."""

import functools
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedamp
from tests import numpy_reference as ref
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, device_state

SEED = 3
# Local training of the round tests: 2 epochs of batch 8 at learning rate 0.2.
LOCAL = dict(local_epochs=2, batch_size=8, client_learning_rate=0.2)


# Independent numpy references of the server's step.


def _numpy_attention(w, ids, alpha, sigma):
    """xi_ij = alpha exp(-||w_i - w_j||^2 / sigma) / sigma (j != i, both real), xi_ii = 1 - sum of the others."""
    k = len(w)
    xi = np.zeros((k, k))
    for i in range(k):
        if ids[i] < 0:
            continue
        for j in range(k):
            if j != i and ids[j] >= 0:
                xi[i, j] = alpha * np.exp(-np.sum((w[i] - w[j]) ** 2) / sigma) / sigma
        xi[i, i] = 1.0 - xi[i].sum()
    return xi


def _numpy_cosine_attention(w, ids, self_attention, scale):
    """HeurFedAMP: xi_ii fixed, the rest (1 - xi_ii) exp(scale cos) / sum over the other real rows."""
    k = len(w)
    xi = np.zeros((k, k))
    for i in range(k):
        if ids[i] < 0:
            continue
        others = [j for j in range(k) if j != i and ids[j] >= 0]
        if not others:
            xi[i, i] = 1.0
            continue
        cos = {j: w[i] @ w[j] / np.linalg.norm(w[i]) / np.linalg.norm(w[j]) for j in others}
        total = sum(np.exp(scale * c) for c in cos.values())
        for j in others:
            xi[i, j] = (1 - self_attention) * np.exp(scale * cos[j]) / total
        xi[i, i] = self_attention
    return xi


@pytest.fixture
def rows():
    """Four models of 6 parameters, the third row empty (a round of three clients, capacity four)."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 6))
    ids = np.array([0, 2, -1, 3], np.int32)
    w[2] = 0.0
    return w, ids


@pytest.mark.parametrize('alpha, sigma', [(0.3, 8.0), (2.0, 5.0), (1.0, 1e6)])
def test_attention_and_cloud_models_against_numpy(rows, alpha, sigma):
    w, ids = rows
    settings = fedamp.FedAMPSettings(fedamp_alpha=alpha, fedamp_sigma=sigma)
    xi, clouds = fedamp.attentive_message_passing(
        tf.constant(w, tf.float32), tf.constant(ids), settings.attention_fn(4)
    )
    want = _numpy_attention(w, ids, alpha, sigma)
    np.testing.assert_allclose(xi.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(clouds.numpy(), want @ w, rtol=1e-5, atol=1e-5)
    real = ids >= 0
    np.testing.assert_allclose(xi.numpy()[real].sum(axis=1), 1.0, atol=1e-6)  # each u_i is an affine mix
    assert not xi.numpy()[~real].any() and not xi.numpy()[:, ~real].any()  # the empty row gets and gives nothing
    # The closer model weighs more: client 0's weights of the others order as their distances do (reversed).
    distances = [np.sum((w[0] - w[j]) ** 2) for j in (1, 3)]
    assert (xi.numpy()[0, 1] > xi.numpy()[0, 3]) == (distances[0] < distances[1]) or sigma > 1e5


def test_cosine_attention_against_numpy(rows):
    w, ids = rows
    settings = fedamp.FedAMPSettings(fedamp_attention='cosine', fedamp_self_attention=0.4, fedamp_cosine_scale=3.0)
    xi, clouds = fedamp.attentive_message_passing(
        tf.constant(w, tf.float32), tf.constant(ids), settings.attention_fn(4)
    )
    want = _numpy_cosine_attention(w, ids, 0.4, 3.0)
    np.testing.assert_allclose(xi.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(clouds.numpy(), want @ w, rtol=1e-5, atol=1e-5)
    alone = fedamp.cosine_attention_weights(
        tf.constant(w[:1], tf.float32), tf.constant([5]), self_attention=0.4, scale=3.0
    )
    np.testing.assert_allclose(alone.numpy(), [[1.0]])  # a client alone in its round keeps its model


def test_attention_record_replaces_the_rounds_rows_only():
    record = np.arange(25, dtype=np.float32).reshape(5, 5)
    xi = np.array([[0.7, 0.3, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.0]], np.float32)
    got = fedamp.attention_rows(tf.constant(record), tf.constant([1, 4, -1]), tf.constant(xi)).numpy()
    want = record.copy()
    want[1] = [0, 0.7, 0, 0, 0.3]
    want[4] = [0, 0.2, 0, 0, 0.8]
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    """Three clients of a tiny linear task (37, 50 and 23 examples) and multinomial logistic regression."""
    spec = make_linear_problem(tmp_path_factory.mktemp('fedamp') / 'data')
    return spec, functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)


def _unpack(packed, dim, classes):
    packed = np.asarray(packed, np.float64)
    return [packed[: dim * classes].reshape(dim, classes), packed[dim * classes :]]


def _numpy_client_step(spec, client_id, start, cloud, weight, config, round_num):
    """Local SGD on F_i(w) + weight / 2 ||w - u_i||^2 from `start`, in the project's batch order."""
    x, y = ref.read(spec, client_id)
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, len(y), config.epochs, config.batch_size)
    pull = lambda params: [weight * (p - u) for p, u in zip(params, cloud)]  # noqa: E731
    return ref.sgd(start, x, y, config, batch, ref.num_steps(config, per_epoch), grad_fn=pull)


@pytest.mark.parametrize('start', ['cloud', 'own'])
@pytest.mark.parametrize('attention', ['distance', 'cosine'])
def test_a_round_against_numpy(problem, tff_runtime, start, attention):
    """Round 1 from the common w^0; round 2 with two of three clients: xi over their models, u_i, the proximal
    SGD from u_i (or w_i), the server's attention record, and the round's metrics."""
    spec, model_fn = problem
    settings = fedamp.FedAMPSettings(
        **LOCAL,
        fedamp_alpha=0.5,
        fedamp_lambda=0.1,
        fedamp_sigma=4.0,
        fedamp_start=start,
        fedamp_attention=attention,
        fedamp_self_attention=0.3,
        fedamp_cosine_scale=2.0,
    )
    process = fedamp.build_fedamp_process(spec, model_fn, settings, seed=SEED)
    ids = list(spec.client_ids)
    dim, classes = spec.feature_shape[0], spec.num_classes
    weight = settings.fedamp_lambda / settings.fedamp_alpha
    config = settings.training_config()
    state = process.initialize()
    np.testing.assert_array_equal(state['attention'], np.eye(3))
    states = [process.initial_client_state(c) for c in ids]
    w0 = np.asarray(states[0]['params'])
    assert all(np.array_equal(s['params'], w0) for s in states)  # one initial model w^0

    state, states, metrics = process.next(state, states)
    # Round 1: every model is w^0, so every cloud model is w^0 (the weights sum to 1).
    for client_id, s in zip(ids, states):
        u = _unpack(w0, dim, classes)
        ref.assert_close(
            _unpack(s['params'], dim, classes), _numpy_client_step(spec, client_id, u, u, weight, config, 0)
        )
    assert metrics['num_clients'] == 3

    sampled = [0, 2]
    w = np.stack([np.asarray(states[k]['params'], np.float64) for k in sampled])
    state_2, updated, metrics = process.next(state, [states[k] for k in sampled])

    def numpy_xi(models, round_ids):
        if attention == 'distance':
            return _numpy_attention(models, round_ids, settings.fedamp_alpha, settings.fedamp_sigma)
        return _numpy_cosine_attention(models, round_ids, 0.3, 2.0)

    xi = numpy_xi(w, np.array(sampled, np.int32))
    clouds = xi @ w
    for row, (k, s) in enumerate(zip(sampled, updated)):
        cloud = _unpack(clouds[row], dim, classes)
        begin = cloud if start == 'cloud' else _unpack(w[row], dim, classes)
        want = _numpy_client_step(spec, ids[k], begin, cloud, weight, config, 1)
        ref.assert_close(_unpack(s['params'], dim, classes), want)
        assert s['num_participations'] == 2 and s['last_round'] == 1
    # Row i: the weights of client i's last cloud model. Client 1 sat out round 2: its row is round 1's.
    record = numpy_xi(np.stack([w0] * 3).astype(np.float64), np.arange(3))
    record[sampled] = 0.0
    record[np.ix_(sampled, sampled)] = xi
    np.testing.assert_allclose(state_2['attention'], record, rtol=1e-5, atol=1e-6)
    assert state_2['round_num'] == 2
    assert metrics['mean_self_attention'] == pytest.approx(np.mean(np.diag(xi)), rel=1e-5)
    assert metrics['min_self_attention'] == pytest.approx(np.min(np.diag(xi)), rel=1e-5)
    trained = np.stack([np.asarray(s['params'], np.float64) for s in updated])
    distance = np.mean(np.sum((trained - clouds) ** 2, axis=1))
    assert metrics['mean_distance_to_cloud'] == pytest.approx(distance, rel=1e-4)
    assert metrics['num_clients'] == 2 and metrics['num_examples'] == 2 * (37 + 23)
    evaluation = process.evaluate(state_2, updated)
    assert all(0 <= e['personalized_model']['accuracy'] <= 1 for e in evaluation)


def test_with_uniform_attention_and_no_pull_it_is_fedavg(tmp_path, tff_runtime):
    """sigma far above every distance makes A' = 1/sigma for every pair; alpha = sigma / K then gives xi = 1/K:
    u_i is the plain mean, and with lambda = 0 each client trains from it as FedAvg's clients train from the global
    model (equal client sizes: FedAvg's weighted mean is the plain mean)."""
    from processes import fedavg

    spec = make_linear_problem(tmp_path / 'data', sizes=(30, 30, 30))
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    sigma = 1e7
    process = fedamp.build_fedamp_process(
        spec,
        model_fn,
        fedamp.FedAMPSettings(**LOCAL, fedamp_sigma=sigma, fedamp_alpha=sigma / 3, fedamp_lambda=0.0),
        seed=SEED,
    )
    reference = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**LOCAL), seed=SEED)
    state, ref_state = process.initialize(), reference.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    ref_states = [reference.initial_client_state(c) for c in spec.client_ids]
    for _ in range(3):
        state, states, metrics = process.next(state, states)
        ref_state, ref_states, _ = reference.next(ref_state, ref_states)
        mean = np.mean([np.asarray(s['params'], np.float64) for s in states], axis=0)
        global_model = np.concatenate([np.asarray(w).ravel() for w in ref_state['model']])
        np.testing.assert_allclose(mean, global_model, atol=1e-5)
        assert metrics['mean_self_attention'] == pytest.approx(1 / 3, abs=1e-5)


def test_only_each_clients_model_and_metric_sums_reach_the_server(problem):
    """The paper's exchange: each client's whole w_i, with its index (one row of the server's K rows); nothing of
    size N x D leaves a client."""
    spec, model_fn = problem
    process = fedamp.build_fedamp_process(spec, model_fn, fedamp.FedAMPSettings(**LOCAL))
    num_params = (spec.feature_shape[0] + 1) * spec.num_classes
    moved = [(uri, str(t)) for uri, t in audit.clients_to_server_values(process.next)]
    assert moved[0] == ('federated_aggregate', f'{{<index=int32,value=float32[{num_params}]>}}@CLIENTS')
    assert {uri for uri, _ in moved[1:]} == {'federated_sum'}
    for _, sent in moved[1:]:  # the training metric sums: scalars
        assert sent.startswith('{<') and '[' not in sent, sent
    assert process.extras['communication']['parameter_bytes_up_per_client'] == num_params * 4
    # The device form sends the same model in the client's row of an [N, D] sum, and its presence.
    uploads = [str(t) for phase in process.device.phases.values() for _, t in audit.clients_to_server_values(phase)]
    assert f'{{float32[3,{num_params}]}}@CLIENTS' in uploads and '{float32[3]}@CLIENTS' in uploads


def test_the_device_form_gives_the_in_process_rounds(problem, tmp_path, tff_runtime):
    """Three rounds (all, two, all clients) in process and as the device form's two phases: the same server state,
    metrics and client states, bit for bit."""
    spec, model_fn = problem
    process = fedamp.build_fedamp_process(
        spec, model_fn, fedamp.FedAMPSettings(**LOCAL, fedamp_alpha=0.5, fedamp_sigma=4.0, fedamp_lambda=0.1)
    )
    device = process.device
    assert list(device.phases) == ['share', 'train']
    ids = list(spec.client_ids)
    os.makedirs(tmp_path / 'states')
    devices = {c: device_state.device_input(c, str(tmp_path / 'states')) for c in ids}
    states = {c: process.initial_client_state(c) for c in ids}
    state, device_server = process.initialize(), device.initialize()
    for sampled in (ids, ids[1:], ids):
        output = process.next(state, [states[c] for c in sampled])
        states.update(zip(sampled, output.client_states))
        device_server, metrics = device_state.run_round(device, device_server, [devices[c] for c in sampled])
        for name in ('attention', 'round_num'):
            np.testing.assert_array_equal(output.state[name], device_server[name])
        assert list(output.metrics) == list(metrics)
        for name in metrics:
            np.testing.assert_array_equal(output.metrics[name], metrics[name])
        for c in ids:
            on_device = device_state.load(devices[c]['state_file'], states[c])
            for name in on_device:
                np.testing.assert_array_equal(np.asarray(states[c][name]), np.asarray(on_device[name]))
        state = output.state


def test_a_round_takes_at_most_its_capacity(problem, tff_runtime):
    spec, model_fn = problem
    process = fedamp.build_fedamp_process(spec, model_fn, fedamp.FedAMPSettings(**LOCAL), max_clients_per_round=2)
    states = [process.initial_client_state(c) for c in spec.client_ids]
    process.next(process.initialize(), states[:2])
    with pytest.raises(Exception, match='more clients in the round than its capacity'):
        process.next(process.initialize(), states)
    with pytest.raises(ValueError, match=r'^max_clients_per_round must be in \[1, 3\], got 4$'):
        fedamp.build_fedamp_process(spec, model_fn, max_clients_per_round=4)


@pytest.mark.parametrize(
    'values, message',
    [
        (dict(fedamp_alpha=0.0), 'fedamp_alpha must be > 0, got 0.0'),
        (dict(fedamp_lambda=-1.0), 'fedamp_lambda must be >= 0, got -1.0'),
        (dict(fedamp_sigma=0.0), 'fedamp_sigma must be > 0, got 0.0'),
        (dict(fedamp_attention='dot'), "fedamp_attention must be one of distance, cosine, got 'dot'"),
        (dict(fedamp_self_attention=1.5), 'fedamp_self_attention must be in [0, 1], got 1.5'),
        (dict(fedamp_cosine_scale=-1.0), 'fedamp_cosine_scale must be >= 0, got -1.0'),
        (dict(fedamp_start='global'), "fedamp_start must be one of cloud, own, got 'global'"),
        (dict(fedamp_sigma='1'), "fedamp_sigma must be a number, got '1'"),
        (dict(local_epochs=0), 'local_epochs must be >= 1, got 0'),
    ],
)
def test_bad_settings_are_refused_in_one_line(values, message):
    with pytest.raises(settings_lib.SettingsError) as raised:
        fedamp.FedAMPSettings(**values).validate()
    assert str(raised.value) == message


def test_the_builder_refuses_what_it_cannot_use_in_one_line(problem):
    spec, model_fn = problem
    for keyword, value in [
        ('server_optimizer', tff.learning.optimizers.build_sgdm(1.0)),
        ('model_aggregator', tff.aggregators.MeanFactory()),
    ]:
        with pytest.raises(ValueError, match=rf'^build_fedamp_process takes no {keyword}: ') as raised:
            fedamp.build_fedamp_process(spec, model_fn, **{keyword: value})
        assert '\n' not in str(raised.value)
    with pytest.raises(TypeError, match='^build_fedamp_process takes FedAMPSettings, got LocalTraining$'):
        fedamp.build_fedamp_process(spec, model_fn, settings_lib.LocalTraining())
    with pytest.raises(TypeError, match='^client_optimizer must be a tff.learning.optimizers.Optimizer'):
        fedamp.build_fedamp_process(spec, model_fn, client_optimizer=tf.keras.optimizers.SGD())


def test_dp_and_secure_aggregation_are_refused_in_one_line():
    from tff_pfl.program import run_config

    for values in (dict(dp_noise_multiplier=0.5, dp_clip=1.0), dict(secure_aggregation=True)):
        config = run_config.make_config(output_dir='x', algorithm='fedamp', **values)
        with pytest.raises(run_config.ConfigError) as refused:
            config.validate()
        line = str(refused.value)
        assert line.endswith(f'fedamp {fedamp.NO_PRIVACY}') and '\n' not in line


def test_the_default_alpha_is_sigma_over_the_rounds_capacity(rows):
    """Unset, alpha_k = sigma / K: a full round of models far closer than sigma is mixed into its plain mean, and
    xi_ii >= 1 / K."""
    w, ids = rows
    settings = fedamp.FedAMPSettings(fedamp_sigma=1e6)
    assert settings.fedamp_alpha is None and settings.alpha(4) == 1e6 / 4
    xi, _ = fedamp.attentive_message_passing(tf.constant(w, tf.float32), tf.constant(ids), settings.attention_fn(4))
    real = ids >= 0
    np.testing.assert_allclose(xi.numpy()[np.ix_(real, real)], 0.25 + 0.25 * np.eye(3), atol=1e-5)
    far = fedamp.FedAMPSettings(fedamp_sigma=1e-3).attention_fn(4)(tf.constant(w, tf.float32), tf.constant(ids))
    np.testing.assert_allclose(far.numpy()[np.ix_(real, real)], np.eye(3), atol=1e-6)  # far apart: each keeps its own


def test_a_sampled_run_writes_the_attention_matrix_and_each_clients_rounds(tiny_npz, tmp_path):
    """Through the training binary's code, half the clients a round: the attention heatmap and CSV (row i: client
    i's last cloud model), and clients.csv's rounds taken part."""
    import csv

    from tff_pfl.program import experiment, run_config

    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        algorithm='fedamp',
        dataset=f'npz:{tiny_npz}',
        partition='iid',
        num_clients=4,
        client_fraction=0.5,
        rounds=2,
        eval_every=0,
        model='logistic',
        local_steps=2,
    ).validate()
    result = experiment.run_experiment(config, log=lambda line: None)
    attention = np.asarray(result.state['attention'])
    assert attention.shape == (4, 4)
    np.testing.assert_allclose(attention.sum(axis=1), 1.0, atol=1e-6)  # every row a mix (or the identity)
    assert (tmp_path / 'run' / 'attention.png').exists()
    with open(tmp_path / 'run' / 'attention.csv') as f:
        assert [row['client_id'] for row in csv.DictReader(f)] == [f'client_{i:05d}' for i in range(4)]
    with open(tmp_path / 'run' / 'clients.csv') as f:
        taken = [int(row['rounds_taken_part']) for row in csv.DictReader(f)]
    assert sum(taken) == 2 * 2 and len(taken) == 4
    assert [r['num_clients'] for r in result.rounds] == [2, 2]
