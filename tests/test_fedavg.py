"""FedAvg against a small numpy FedAvg, and what crosses from CLIENTS to SERVER."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import audit, local_training
from tff_pfl.data import client_data

SEED = 7


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def numpy_fedavg_round(weights, spec, client_ids, round_num, config, server_lr):
    """One FedAvg round of multinomial logistic regression in float64 numpy.

    Only the example order of each epoch is taken from the project (the
    stateless permutation); gradients, SGD steps and weighted averaging are
    computed here independently.
    """
    w, b = (np.asarray(a, np.float64) for a in weights)
    deltas, counts = [], []
    for client_id in client_ids:
        x, y = client_data.read_split_numpy(spec, client_id, 'train')
        x = x.astype(np.float64)
        n = len(y)
        seed = local_training.client_seed(SEED, tf.constant(round_num), tf.constant(client_id))
        perms = local_training.epoch_permutations(seed, config.epochs, n).numpy()
        cw, cb = w.copy(), b.copy()
        for epoch in range(config.epochs):
            for start in range(0, n, config.batch_size):
                idx = perms[epoch, start : start + config.batch_size]
                xb, yb = x[idx], y[idx]
                p = _softmax(xb @ cw + cb)
                p[np.arange(len(yb)), yb] -= 1.0
                cw -= config.learning_rate * xb.T @ p / len(yb)
                cb -= config.learning_rate * p.sum(axis=0) / len(yb)
        deltas.append((cw - w, cb - b))
        counts.append(n)
    counts = np.asarray(counts, np.float64)
    mean_dw = sum(c * d[0] for c, d in zip(counts, deltas)) / counts.sum()
    mean_db = sum(c * d[1] for c, d in zip(counts, deltas)) / counts.sum()
    return w + server_lr * mean_dw, b + server_lr * mean_db


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('fedavg') / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    return spec, model_fn


@pytest.mark.parametrize('server_lr', [1.0, 0.5])
def test_fedavg_matches_numpy(problem, tff_runtime, server_lr):
    spec, model_fn = problem
    config = local_training.TrainingConfig(epochs=2, batch_size=8, learning_rate=0.3)
    process = fedavg.build_fedavg_process(
        spec,
        model_fn,
        local_config=config,
        server_optimizer=tff.learning.optimizers.build_sgdm(learning_rate=server_lr),
        seed=SEED,
    )
    state = process.initialize()
    sampled = [spec.client_ids[0], spec.client_ids[2]]  # a subset, in a given order
    client_states = [process.initial_client_state(c) for c in sampled]
    expected = [np.asarray(a) for a in state['model']]
    for round_num in range(3):
        expected = numpy_fedavg_round(expected, spec, sampled, round_num, config, server_lr)
        output = process.next(state, client_states)
        state, client_states = output.state, output.client_states
        for got, want in zip(state['model'], expected):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert state['round_num'] == 3
    assert [s['client_id'].decode() for s in client_states] == sampled
    assert all(s['num_participations'] == 3 and s['last_round'] == 2 for s in client_states)
    assert output.metrics['num_clients'] == 2
    assert output.metrics['num_examples'] == 2 * (37 + 23)


def test_evaluate_is_per_client_on_test_split(problem, tff_runtime):
    spec, model_fn = problem
    config = local_training.TrainingConfig(epochs=1, batch_size=8, learning_rate=0.3)
    process = fedavg.build_fedavg_process(spec, model_fn, local_config=config, seed=SEED)
    state = process.initialize()
    client_states = [process.initial_client_state(c) for c in spec.client_ids]
    results = process.evaluate(state, client_states)
    w, b = (np.asarray(a, np.float64) for a in state['model'])
    for client_id, result in zip(spec.client_ids, results):
        x, y = client_data.read_split_numpy(spec, client_id, 'test')
        logits = x @ w + b
        p = _softmax(logits)
        loss = -np.mean(np.log(p[np.arange(len(y)), y]))
        accuracy = np.mean(np.argmax(logits, 1) == y)
        got = result['global_model']
        assert got['num_examples'] == len(y)
        np.testing.assert_allclose(got['loss'], loss, rtol=1e-5)
        np.testing.assert_allclose(got['accuracy'], accuracy, rtol=1e-6)


def test_only_aggregates_reach_server(problem):
    spec, model_fn = problem
    config = local_training.TrainingConfig(epochs=1, batch_size=8, learning_rate=0.3)
    process = fedavg.build_fedavg_process(spec, model_fn, local_config=config)
    signature = process.next.type_signature
    # Client states go in and come out at CLIENTS; state and metrics are at SERVER.
    assert signature.parameter[1].placement is tff.CLIENTS
    assert signature.result.state.placement is tff.SERVER
    assert signature.result.client_states.placement is tff.CLIENTS
    assert signature.result.metrics.placement is tff.SERVER
    moved = audit.clients_to_server_intrinsics(process.next)
    assert moved, 'the round must aggregate something'
    # Only sums and (weighted) means: no aggregation that could concatenate
    # individual client values.
    assert moved <= {'federated_sum', 'federated_mean', 'federated_weighted_mean'}, moved
    # The client computation's only data input is the client id: no dataset
    # type appears anywhere in the round's signature.
    assert 'float32[?' not in str(signature) and '*' not in str(signature)


def test_audit_sees_sums_and_ignores_maps():
    @tff.tensorflow.computation(np.float32)
    def double(v):
        return v * 2.0

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def summed(values):
        return tff.federated_sum(tff.federated_map(double, values))

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def mapped(values):
        return tff.federated_map(double, values)

    assert audit.clients_to_server_intrinsics(summed) == {'federated_sum'}
    assert audit.clients_to_server_intrinsics(mapped) == set()
