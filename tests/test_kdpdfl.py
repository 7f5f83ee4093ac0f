"""KD-PDFL: the star's exchange against numpy, neighbour draws, the driver."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf

from processes import kdpdfl
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import audit, local_training
from tff_pfl.data import client_data


def test_draw_neighbours_mean_and_cap():
    rng = np.random.default_rng(0)
    counts = [len(kdpdfl.draw_neighbours(rng, 21, 3, mean_reachable=5.0)) for _ in range(4000)]
    assert np.mean(counts) == pytest.approx(5.0, abs=0.15)  # 20 peers x exp(-ln 4) = 5
    capped = [kdpdfl.draw_neighbours(rng, 21, 3, mean_reachable=5.0, max_neighbours=2) for _ in range(200)]
    assert max(len(c) for c in capped) == 2
    assert all(3 not in c and c == sorted(c) for c in capped)


def test_output_distances_eq3():
    rng = np.random.default_rng(1)
    own, theirs = rng.random((6, 4)), rng.random((3, 6, 4))
    want = ((theirs - own) ** 2).sum(-1).mean(-1)
    got = kdpdfl.output_distances(tf.constant(own), tf.constant(theirs)).numpy()
    np.testing.assert_allclose(got, want)


def _numpy_connectivity(row, ids, present, d, mu1, mu2):
    row = row.copy()
    grad = np.array([(mu1 * d[k] - mu2 * (1 - row.sum())) if present[k] else 0.0 for k in range(len(ids))])
    norm = np.linalg.norm(grad)
    if norm == 0:
        return row
    for k, j in enumerate(ids):
        if present[k]:
            row[j] = max(0.0, row[j] - grad[k] / norm)
    return row


@pytest.mark.parametrize('mu1,mu2', [(1.0, 1.0), (5.0, 0.1), (0.0, 2.0), (0.0, 0.0)])
def test_connectivity_update_eq2(mu1, mu2):
    row = np.array([0.2, 0.0, 0.2, 0.2, 0.2, 0.2], np.float32)  # client 1 is the star: w_ii = 0
    ids, present = np.array([0, 4, 5, -1], np.int32), np.array([1, 1, 1, 0], np.float32)
    d = np.array([0.05, 0.4, 0.9, 0.0], np.float32)
    got = kdpdfl.connectivity_update(
        tf.constant(row), tf.constant(ids), tf.constant(present), tf.constant(d), mu1=mu1, mu2=mu2
    ).numpy()
    np.testing.assert_allclose(got, _numpy_connectivity(row, ids, present, d, mu1, mu2), atol=1e-6)
    assert got[1] == 0 and got[2] == row[2] and got[3] == row[3]  # the star and non-neighbours untouched
    if mu1 == mu2 == 0:
        np.testing.assert_array_equal(got, row)


def test_confidence_and_mix():
    assert float(kdpdfl.confidence(30, 4, 100.0)) == pytest.approx(0.2)  # min(0.3, 1/5)
    assert float(kdpdfl.confidence(10, 4, 100.0)) == pytest.approx(0.1)
    own = [tf.constant([1.0, 1.0])]
    theirs = [tf.constant([[3.0, 3.0], [7.0, 7.0], [100.0, 100.0]])]
    mixed = kdpdfl.star_mix(own, theirs, tf.constant([1.0, 3.0, 0.0]), 0.25)[0].numpy()
    np.testing.assert_allclose(mixed, 0.25 * 1 + 0.75 * (0.25 * 3 + 0.75 * 7))
    alone = kdpdfl.star_mix(own, theirs, tf.constant([0.0, 0.0, 0.0]), 0.25)[0].numpy()
    np.testing.assert_allclose(alone, [1.0, 1.0])  # nobody trusted: keep the own model


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('kd') / 'data', num_clients=4, sizes=(37, 50, 23, 41))
    return spec, functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)


def _numpy_logits(weights, x):
    kernel, bias = weights
    return x @ kernel + bias


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize('mode', ['kdpdfl', 'fedavg'])
def test_exchange_against_numpy(problem, tff_runtime, mode):
    spec, model_fn = problem
    config = local_training.TrainingConfig(1, 8, 0.3)
    proc = kdpdfl.build_kdpdfl_process(
        spec,
        model_fn,
        local_config=config,
        max_neighbours=3,
        mu1=2.0,
        mu2=0.5,
        c_base=100.0,
        distance_batch=1000,
        mode=mode,
    )
    ids = spec.client_ids
    states = [proc.initial_client_state(c) for c in ids]
    # Make the clients differ: one interval of local work (4 slots each).
    states, _ = proc.local_work(states, [4, 4, 4, 4], np.int32(0))
    star, neighbours = 2, [0, 3]
    server_state = collections.OrderedDict(
        star=states[star], neighbours=np.array([0, 3, -1], np.int32), exchange_num=np.int32(0)
    )
    output = proc.next(server_state, [states[j] for j in neighbours])
    new_star = output.state['star']

    x, _ = client_data.read_split_numpy(spec, ids[star], 'train')  # distance_batch covers all of it
    own = [np.asarray(w, np.float64) for w in states[star]['model']]
    theirs = [[np.asarray(w, np.float64) for w in states[j]['model']] for j in neighbours]
    p_own = _softmax(_numpy_logits(own, x))
    d = np.array([((_softmax(_numpy_logits(t, x)) - p_own) ** 2).sum(-1).mean() for t in theirs])
    np.testing.assert_allclose(output.metrics['mean_distance'], d.mean(), rtol=1e-4)
    row = np.asarray(states[star]['connectivity'], np.float64)
    c = min(23 / 100.0, 1 / 3)
    if mode == 'kdpdfl':
        row = _numpy_connectivity(row, neighbours, [1, 1], d, 2.0, 0.5)
        w = row[neighbours] / row[neighbours].sum()
        want = [c * o + (1 - c) * (w[0] * t0 + w[1] * t1) for o, t0, t1 in zip(own, *theirs)]
    else:
        want = [(o + t0 + t1) / 3 for o, t0, t1 in zip(own, *theirs)]
    np.testing.assert_allclose(new_star['connectivity'], row, atol=1e-5)
    for got, expected in zip(new_star['model'], want):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert float(new_star['confidence']) == pytest.approx(c)
    for s in output.client_states:  # the neighbours adopt the star's new model
        for got, expected in zip(s['model'], want):
            np.testing.assert_allclose(got, expected, atol=1e-5)


def test_only_models_of_invited_neighbours_reach_the_star(problem):
    spec, model_fn = problem
    proc = kdpdfl.build_kdpdfl_process(
        spec, model_fn, local_config=local_training.TrainingConfig(1, 8, 0.3), max_neighbours=3
    )
    moved = audit.clients_to_server_values(proc.next)
    assert {uri for uri, _ in moved} == {'federated_sum'}
    shapes = {str(t.member) for _, t in moved}
    # The slot structure: one model per slot (logistic: kernel [4, 3], bias [3]) and the slot mask.
    assert any('float32[3,4,3]' in s and 'float32[3,3]' in s for s in shapes), shapes
    assert 'float32[3]' in ' '.join(shapes)


def test_driver_runs_every_mode(problem, tff_runtime):
    from tff_pfl.program import decentralized

    spec, model_fn = problem
    results = {}
    for mode in ('kdpdfl', 'fedavg', 'local'):
        proc = kdpdfl.build_kdpdfl_process(
            spec,
            model_fn,
            local_config=local_training.TrainingConfig(1, 8, 0.3),
            max_neighbours=2,
            mode=mode,
            distance_batch=16,
        )
        results[mode] = decentralized.run(
            proc, spec.client_ids, intervals=3, exchange_interval=3, seed=0, mean_reachable=2.0, log=lambda line: None
        )
    for result in results.values():
        assert len(result.rounds) == 3 and 0 <= result.summary['personalized_model']['mean'] <= 1
    assert 'exchange_num_neighbours' not in results['local'].rounds[0]
    assert any('exchange_num_neighbours' in r for r in results['kdpdfl'].rounds)
    # Same seed, same draws: the stars of KD-PDFL and FedAvg coincide.
    assert [r.get('star') for r in results['kdpdfl'].rounds] == [r.get('star') for r in results['fedavg'].rounds]


def test_experiment_writes_the_collaboration_graph(tiny_npz, tmp_path):
    from tff_pfl.program import experiment

    out = tmp_path / 'run'
    config = experiment.ExperimentConfig(
        output_dir=str(out),
        algorithm='kdpdfl',
        dataset=f'npz:{tiny_npz}',
        partition='kd_dirichlet',
        num_clients=4,
        kd_split_sizes=(5, 15, 5, 10),
        model='mnist_dnn',
        rounds=3,
        exchange_interval=3,
        kd_mean_neighbours=2.0,
        kd_max_neighbours=2,
        batch_size=8,
        client_learning_rate=0.1,
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    graph = np.loadtxt(out / 'collaboration_graph.csv', delimiter=',', skiprows=1, usecols=range(1, 5))
    assert graph.shape == (4, 4) and (np.diag(graph) == 0).all() and (graph >= 0).all()
    assert (out / 'collaboration_graph.png').stat().st_size > 0
    assert [r['slot'] for r in result.rounds] == [3, 6, 9]
    with pytest.raises(experiment.ConfigError, match='exchange_interval'):
        experiment.ExperimentConfig(output_dir='x', algorithm='kdpdfl', exchange_interval=1).validate()


def test_without_mu_kdpdfl_is_decentralized_fedavg(problem, tff_runtime):
    """mu_1 = mu_2 = 0 keeps W at 1/M; with confidence at its cap 1/(|N| + 1) the star's mix is the plain mean."""
    spec, model_fn = problem
    config = local_training.TrainingConfig(1, 8, 0.3)
    states = None
    outputs = {}
    for mode in ('kdpdfl', 'fedavg'):
        proc = kdpdfl.build_kdpdfl_process(
            spec, model_fn, local_config=config, max_neighbours=3, mu1=0.0, mu2=0.0, c_base=1.0, mode=mode
        )
        if states is None:
            states = [proc.initial_client_state(c) for c in spec.client_ids]
            states, _ = proc.local_work(states, [2, 2, 2, 2], np.int32(0))
        server_state = collections.OrderedDict(
            star=states[1], neighbours=np.array([0, 2, 3], np.int32), exchange_num=np.int32(0)
        )
        outputs[mode] = proc.next(server_state, [states[0], states[2], states[3]]).state['star']
    np.testing.assert_allclose(outputs['kdpdfl']['connectivity'], states[1]['connectivity'])
    for a, b in zip(outputs['kdpdfl']['model'], outputs['fedavg']['model']):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_distances_at_a_hidden_layer(problem, tff_runtime):
    """The MidGetter at a shared hidden layer compares raw activations."""
    spec, _ = problem
    model_fn = functools.partial(models.get('mnist_dnn'), spec.feature_shape, spec.num_classes)
    proc = kdpdfl.build_kdpdfl_process(
        spec,
        model_fn,
        local_config=local_training.TrainingConfig(1, 8, 0.1),
        max_neighbours=2,
        distance_layer=2,
        distance_batch=1000,
    )
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    states, _ = proc.local_work(states, [2, 2, 2, 2], np.int32(0))
    server_state = collections.OrderedDict(
        star=states[0], neighbours=np.array([3, -1], np.int32), exchange_num=np.int32(0)
    )
    output = proc.next(server_state, [states[3]])
    x, _ = client_data.read_split_numpy(spec, spec.client_ids[0], 'train')

    def hidden(state):
        kernel, bias = (np.asarray(w, np.float64) for w in state['model'][:2])
        return np.maximum(x @ kernel + bias, 0.0)

    want = ((hidden(states[3]) - hidden(states[0])) ** 2).sum(-1).mean()
    np.testing.assert_allclose(output.metrics['mean_distance'], want, rtol=1e-4)
    with pytest.raises(ValueError, match='distance_layer'):
        kdpdfl.build_kdpdfl_process(
            spec, model_fn, local_config=local_training.TrainingConfig(1, 8, 0.1), distance_layer=9
        )
