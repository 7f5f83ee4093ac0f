"""KD-PDFL: the star's exchange against numpy (each reading of step and mix), neighbour draws, the driver, settings."""

import collections
import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf

from processes import kdpdfl, kdpdfl_exchange
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, template
from tff_pfl.data import client_data

# One slot of local work in these tests: one epoch of batch 8 at learning rate 0.3.
SLOT = dict(local_epochs=1, batch_size=8, client_learning_rate=0.3)


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
    got = kdpdfl_exchange.output_distances(tf.constant(own), tf.constant(theirs)).numpy()
    np.testing.assert_allclose(got, want)


def _numpy_connectivity(row, ids, present, d, mu1, mu2, step='norm'):
    row = row.copy()
    grad = np.array([(mu1 * d[k] - mu2 * (1 - row.sum())) if present[k] else 0.0 for k in range(len(ids))])
    if step == 'norm':
        norm = np.linalg.norm(grad)
        if norm == 0:
            return row
        eta = np.full(len(ids), 1 / norm)
    else:  # eta_ij = 1 / |grad h_ij|; an entry with zero gradient does not move
        eta = np.array([1 / abs(g) if g else 0.0 for g in grad])
    for k, j in enumerate(ids):
        if present[k]:
            row[j] = max(0.0, row[j] - eta[k] * grad[k])
    return row


@pytest.mark.parametrize('step', kdpdfl_exchange.STEPS)
@pytest.mark.parametrize('mu1,mu2', [(1.0, 1.0), (5.0, 0.1), (0.0, 2.0), (0.0, 0.0)])
def test_connectivity_update_eq2(mu1, mu2, step):
    row = np.array([0.2, 0.0, 0.2, 0.2, 0.2, 0.2], np.float32)  # client 1 is the star: w_ii = 0
    ids, present = np.array([0, 4, 5, -1], np.int32), np.array([1, 1, 1, 0], np.float32)
    d = np.array([0.05, 0.4, 0.9, 0.0], np.float32)
    got = kdpdfl_exchange.connectivity_update(
        tf.constant(row), tf.constant(ids), tf.constant(present), tf.constant(d), mu1=mu1, mu2=mu2, step=step
    ).numpy()
    np.testing.assert_allclose(got, _numpy_connectivity(row, ids, present, d, mu1, mu2, step), atol=1e-6)
    assert got[1] == 0 and got[2] == row[2] and got[3] == row[3]  # the star and non-neighbours untouched
    if mu1 == mu2 == 0:
        np.testing.assert_array_equal(got, row)


def test_the_elementwise_step_moves_each_weight_by_one():
    """eta_ij = 1/|grad h_ij|: w_ij <- max(0, w_ij - sign(grad h_ij)); a zero gradient leaves w_ij alone."""
    row = np.array([0.25, 0.0, 0.125, 0.125, 0.25], np.float32)  # client 1 is the star; sum 0.75: grad g = -0.25
    ids, present = np.array([0, 2, 3, 4], np.int32), np.ones(4, np.float32)
    d = np.array([0.5, 1.0, 0.25, 0.0], np.float32)  # mu1 = mu2 = 1: grad h = d - 0.25 = [0.25, 0.75, 0, -0.25]
    got = kdpdfl_exchange.connectivity_update(
        tf.constant(row), tf.constant(ids), tf.constant(present), tf.constant(d), mu1=1.0, mu2=1.0, step='elementwise'
    ).numpy()
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 0.125, 1.25])  # down 1 (floored), -, unchanged, up 1
    unit = kdpdfl_exchange.connectivity_update(
        tf.constant(row), tf.constant(ids), tf.constant(present), tf.constant(d), mu1=1.0, mu2=1.0, step='norm'
    ).numpy()
    grad = d - 0.25
    np.testing.assert_allclose(unit[ids], np.maximum(0.0, row[ids] - grad / np.linalg.norm(grad)), atol=1e-6)
    with pytest.raises(ValueError, match=r"^step must be one of norm, elementwise, got 'unit'$"):
        kdpdfl_exchange.connectivity_update(
            tf.constant(row), tf.constant(ids), tf.constant(present), tf.constant(d), mu1=1.0, mu2=1.0, step='unit'
        )


def test_footprints_overwrite_only_this_exchanges_senders():
    old = [np.arange(5 * 2, dtype=np.float32).reshape(5, 2)]
    held = np.array([1, 0, 0, 1, 0], np.float32)
    slots = [np.array([[10.0, 11.0], [12.0, 13.0], [0.0, 0.0]], np.float32)]  # slot 3 empty
    ids, present = np.array([3, 4, -1], np.int32), np.array([1, 1, 0], np.float32)
    kept, now_held = kdpdfl_exchange.keep_footprints(
        [tf.constant(old[0])], tf.constant(held), [tf.constant(slots[0])], tf.constant(ids), tf.constant(present)
    )
    np.testing.assert_array_equal(kept[0], [[0, 1], [2, 3], [4, 5], [10, 11], [12, 13]])
    np.testing.assert_array_equal(now_held, [1, 0, 0, 1, 1])


def test_confidence_and_mix():
    assert float(kdpdfl_exchange.confidence(30, 4, 100.0)) == pytest.approx(0.2)  # min(0.3, 1/5)
    assert float(kdpdfl_exchange.confidence(10, 4, 100.0)) == pytest.approx(0.1)
    own = [tf.constant([1.0, 1.0])]
    theirs = [tf.constant([[3.0, 3.0], [7.0, 7.0], [100.0, 100.0]])]
    mixed = kdpdfl_exchange.star_mix(own, theirs, tf.constant([1.0, 3.0, 0.0]), 0.25)[0].numpy()
    np.testing.assert_allclose(mixed, 0.25 * 1 + 0.75 * (0.25 * 3 + 0.75 * 7))
    alone = kdpdfl_exchange.star_mix(own, theirs, tf.constant([0.0, 0.0, 0.0]), 0.25)[0].numpy()
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


def _settings(mode, **changes):
    """The settings of `mode` with the test's slot of local work and `changes`."""
    return kdpdfl.MODE_SETTINGS[mode](**{**SLOT, **changes})


def _numpy_star(spec, states, star, neighbours, *, mu1, mu2, step, c_base=100.0, footprints=None):
    """One KD-PDFL exchange at the star in numpy; the distance batch covers its whole training split.

    `footprints`: None for kd_mix='exchange', else the star's {client index: model}, updated in place.
    Returns the star's new row, new model, confidence and distances.
    """
    x, _ = client_data.read_split_numpy(spec, spec.client_ids[star], 'train')
    own = [np.asarray(w, np.float64) for w in states[star]['model']]
    theirs = {j: [np.asarray(w, np.float64) for w in states[j]['model']] for j in neighbours}
    p_own = _softmax(_numpy_logits(own, x))
    d = np.array([((_softmax(_numpy_logits(theirs[j], x)) - p_own) ** 2).sum(-1).mean() for j in neighbours])
    c = min(len(x) / c_base, 1 / (len(neighbours) + 1))
    row = np.asarray(states[star]['connectivity'], np.float64)
    row = _numpy_connectivity(row, neighbours, [1] * len(neighbours), d, mu1, mu2, step)
    if footprints is not None:  # this exchange's models overwrite their footprints; the star mixes all it holds
        footprints.update(theirs)
        theirs = footprints
    w = {j: row[j] for j in theirs}
    total = sum(w.values())
    if total == 0:
        return row, own, c, d
    mix = [sum(w[j] / total * theirs[j][k] for j in theirs) for k in range(len(own))]
    return row, [c * o + (1 - c) * m for o, m in zip(own, mix)], c, d


@pytest.mark.parametrize(
    'mode,changes',
    [('kdpdfl', {}), ('kdpdfl', dict(kd_step='elementwise')), ('fedavg', {})],
    ids=['kdpdfl', 'kdpdfl-elementwise', 'fedavg'],
)
def test_exchange_against_numpy(problem, tff_runtime, mode, changes):
    spec, model_fn = problem
    if mode == 'kdpdfl':
        settings = _settings(
            mode, kd_max_neighbours=3, kd_mu1=2.0, kd_mu2=0.5, kd_c_base=100.0, kd_distance_batch=1000, **changes
        )
    else:
        settings = _settings(mode, kd_max_neighbours=3)
    proc = kdpdfl.build_kdpdfl_process(spec, model_fn, settings)
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

    if mode == 'kdpdfl':
        row, want, c, d = _numpy_star(spec, states, star, neighbours, mu1=2.0, mu2=0.5, step=settings.kd_step)
        np.testing.assert_allclose(output.metrics['mean_distance'], d.mean(), rtol=1e-4)
        assert c == min(23 / 100.0, 1 / 3)
    else:  # no distances, no W: the plain mean, the star's own share 1 / (|N| + 1)
        assert 'mean_distance' not in output.metrics
        c = 1 / 3
        row = np.asarray(states[star]['connectivity'])
        own, t0, t1 = ([np.asarray(w, np.float64) for w in states[j]['model']] for j in (star, *neighbours))
        want = [(o + a + b) / 3 for o, a, b in zip(own, t0, t1)]
    assert 'footprints' not in new_star and 'num_footprints' not in output.metrics  # kd_mix='exchange'
    np.testing.assert_allclose(new_star['connectivity'], row, atol=1e-5)
    for got, expected in zip(new_star['model'], want):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert float(new_star['confidence']) == pytest.approx(c)
    assert float(output.metrics['confidence']) == pytest.approx(c)
    for s in output.client_states:  # the neighbours adopt the star's new model
        for got, expected in zip(s['model'], want):
            np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize('step', kdpdfl_exchange.STEPS)
def test_footprint_exchanges_against_numpy(problem, tff_runtime, step):
    """kd_mix='footprints': the star mixes every client's latest model it has received, from any exchange."""
    spec, model_fn = problem
    settings = _settings(
        'kdpdfl', kd_max_neighbours=3, kd_mu1=2.0, kd_mu2=0.5, kd_distance_batch=1000, kd_mix='footprints', kd_step=step
    )
    proc = kdpdfl.build_kdpdfl_process(spec, model_fn, settings)
    num_clients = len(spec.client_ids)
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    assert np.asarray(states[0]['footprints'][0]).shape == (num_clients, 4, 3)  # logistic: kernel [4, 3]
    states, _ = proc.local_work(states, [4] * num_clients, np.int32(0))
    footprints = {i: {} for i in range(num_clients)}  # the numpy stars' footprints
    # Star 2 meets 0 and 3, later 1 alone (mixing 0's and 3's footprints of the first exchange), then 3 again.
    schedule = [(2, [0, 3]), (0, [2]), (2, [1]), (2, [3])]
    for exchange_num, (star, neighbours) in enumerate(schedule):
        invitation = np.full(3, -1, np.int32)
        invitation[: len(neighbours)] = neighbours
        server_state = collections.OrderedDict(
            star=states[star], neighbours=invitation, exchange_num=np.int32(exchange_num)
        )
        output = proc.next(server_state, [states[j] for j in neighbours])
        row, want, c, _ = _numpy_star(
            spec, states, star, neighbours, mu1=2.0, mu2=0.5, step=step, footprints=footprints[star]
        )
        new_star = output.state['star']
        np.testing.assert_allclose(new_star['connectivity'], row, atol=1e-5)
        for got, expected in zip(new_star['model'], want):
            np.testing.assert_allclose(got, expected, atol=1e-5)
        assert float(new_star['confidence']) == pytest.approx(c)
        held = sorted(footprints[star])
        np.testing.assert_array_equal(new_star['footprints_held'], [float(j in held) for j in range(num_clients)])
        assert float(output.metrics['num_footprints']) == len(held)
        for j in range(num_clients):
            for got, kept in zip(new_star['footprints'], footprints[star].get(j, [0.0, 0.0])):
                np.testing.assert_allclose(np.asarray(got)[j], np.broadcast_to(kept, np.shape(got)[1:]), atol=1e-6)
        if exchange_num == 2:  # the footprints of 0 and 3 are older than their models now
            assert not np.allclose(footprints[2][0][0], states[0]['model'][0])
        for j, s in zip(neighbours, output.client_states):  # a neighbour's own footprints do not change
            np.testing.assert_array_equal(s['footprints_held'], states[j]['footprints_held'])
        states[star] = new_star
        for j, s in zip(neighbours, output.client_states):
            states[j] = s
        states, _ = proc.local_work(states, [1] * num_clients, np.int32(exchange_num + 1))
    assert float(states[0]['footprints_held'][2]) == 1.0 and footprints[0].keys() == {2}


@pytest.mark.parametrize('mix', kdpdfl.MIXES)
def test_only_models_of_invited_neighbours_reach_the_star(problem, mix):
    """With kd_mix='footprints' too: the footprints stay in the star's own state; neighbours upload their model."""
    spec, model_fn = problem
    proc = kdpdfl.build_kdpdfl_process(spec, model_fn, _settings('kdpdfl', kd_max_neighbours=3, kd_mix=mix))
    moved = audit.clients_to_server_values(proc.next)
    assert {uri for uri, _ in moved} == {'federated_sum'}
    shapes = {str(t.member) for _, t in moved}
    # The slot structure: one model per slot (logistic: kernel [4, 3], bias [3]) and the slot mask.
    assert any('float32[3,4,3]' in s and 'float32[3,3]' in s for s in shapes), shapes
    assert 'float32[3]' in ' '.join(shapes)
    assert not any('float32[4,4,3]' in s for s in shapes), shapes  # no [M, ...] footprints (M = 4)


def _process(spec, model_fn, mode, **changes):
    """A process of `mode` with the test's slot of local work."""
    return kdpdfl.build_kdpdfl_process(spec, model_fn, _settings(mode, **changes))


def test_driver_runs_every_mode(problem, tff_runtime):
    from tff_pfl.program import decentralized

    spec, model_fn = problem
    results = {}
    for mode in ('kdpdfl', 'fedavg', 'local'):
        if mode == 'local':
            settings = _settings(mode, exchange_interval=3)
        else:
            settings = _settings(mode, kd_max_neighbours=2, kd_mean_neighbours=2.0, exchange_interval=3)
        if mode == 'kdpdfl':
            settings = dataclasses.replace(settings, kd_distance_batch=16)
        proc = kdpdfl.build_kdpdfl_process(spec, model_fn, settings)
        assert isinstance(proc, template.ServerlessProcess) and proc.mode == mode
        assert proc.max_neighbours == (1 if mode == 'local' else 2)
        # Declared outputs only: nothing is assigned to the process after construction.
        assert [k for k in vars(proc) if not k.startswith('_')] == []
        results[mode] = decentralized.run(
            proc, spec.client_ids, intervals=3, seed=0, log=lambda line: None, **settings.loop_arguments()
        )
    for result in results.values():
        assert len(result.rounds) == 3 and 0 <= result.summary['personalized_model']['mean'] <= 1
    assert 'exchange_num_neighbours' not in results['local'].rounds[0]
    assert any('exchange_num_neighbours' in r for r in results['kdpdfl'].rounds)
    # Same seed, same draws: the stars of KD-PDFL and FedAvg coincide.
    assert [r.get('star') for r in results['kdpdfl'].rounds] == [r.get('star') for r in results['fedavg'].rounds]
    with pytest.raises(ValueError, match='mean_reachable'):
        decentralized.run(_process(spec, model_fn, 'fedavg'), spec.client_ids, intervals=1, exchange_interval=3, seed=0)


@pytest.mark.parametrize('mode', kdpdfl.MODES)
def test_a_slot_of_local_work_is_exactly_local_steps_sgd_steps(problem, tff_runtime, mode):
    """local_steps = L: every client that trains takes L SGD steps per slot, whatever its data size."""
    spec, model_fn = problem
    # Batch 32: the 23-example client has one batch per epoch, the 50-example one two.
    proc = _process(spec, model_fn, mode, local_steps=3, batch_size=32)
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    trained, metrics = proc.local_work(states, [4, 0, 2, 3], np.int32(0))
    assert float(metrics['mean_local_steps']) == 3.0  # per slot
    assert float(metrics['mean_local_slots']) == 3.0  # (4 + 2 + 3) / 3: the client without slots does not count
    assert int(metrics['num_clients']) == 3
    for before, after in zip(states[1]['model'], trained[1]['model']):
        np.testing.assert_array_equal(before, after)  # no slot, no training
    for before, after in zip(states[2]['model'], trained[2]['model']):
        assert not np.allclose(before, after)


def test_the_driver_runs_both_readings(problem, tff_runtime):
    from tff_pfl.program import decentralized

    spec, model_fn = problem
    settings = _settings(
        'kdpdfl', kd_max_neighbours=2, kd_mean_neighbours=2.0, exchange_interval=3, kd_step='elementwise'
    )
    settings = dataclasses.replace(settings, kd_mix='footprints')
    result = decentralized.run(
        kdpdfl.build_kdpdfl_process(spec, model_fn, settings),
        spec.client_ids,
        intervals=4,
        seed=0,
        log=lambda line: None,
        **settings.loop_arguments(),
    )
    assert 0 <= result.summary['personalized_model']['mean'] <= 1
    held = [r['exchange_num_footprints'] for r in result.rounds if 'exchange_num_footprints' in r]
    assert held and all(1 <= n <= 3 for n in held)
    assert sum(float(np.sum(s['footprints_held'])) for s in result.client_states.values()) >= len(held)


def test_the_driver_reports_local_steps_per_slot(problem, tff_runtime):
    from tff_pfl.program import decentralized

    spec, model_fn = problem
    settings = _settings('kdpdfl', local_steps=3, kd_max_neighbours=2, kd_mean_neighbours=2.0, exchange_interval=4)
    result = decentralized.run(
        kdpdfl.build_kdpdfl_process(spec, model_fn, settings),
        spec.client_ids,
        intervals=3,
        exchange_interval=settings.exchange_interval,
        seed=1,
        mean_reachable=settings.kd_mean_neighbours,
        log=lambda line: None,
    )
    assert any(row.get('num_neighbours') for row in result.rounds)
    for row in result.rounds:
        assert row['mean_local_steps'] == 3.0
        # The star and its neighbours (if it reached any) train 2 slots fewer: gather and broadcast.
        neighbours = row.get('num_neighbours', 0)
        exchanging = 1 + neighbours if neighbours else 0
        want_slots = (4 * len(spec.client_ids) - 2 * exchanging) / len(spec.client_ids)
        assert row['mean_local_slots'] == pytest.approx(want_slots)


def test_experiment_writes_the_collaboration_graph(tiny_npz, tmp_path):
    from tff_pfl.program import experiment, run_config

    out = tmp_path / 'run'
    config = run_config.make_config(
        output_dir=str(out),
        algorithm='kdpdfl',
        dataset=f'npz:{tiny_npz}',
        partition='kd_dirichlet',
        num_clients=4,
        kd_split_sizes=(5, 15, 5, 10),
        model='mnist_dnn',
        rounds=3,
        settings=kdpdfl.KDPDFLSettings(
            exchange_interval=3, kd_mean_neighbours=2.0, kd_max_neighbours=2, batch_size=8, client_learning_rate=0.1
        ),
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    graph = np.loadtxt(out / 'collaboration_graph.csv', delimiter=',', skiprows=1, usecols=range(1, 5))
    assert graph.shape == (4, 4) and (np.diag(graph) == 0).all() and (graph >= 0).all()
    assert (out / 'collaboration_graph.png').stat().st_size > 0
    assert [r['slot'] for r in result.rounds] == [3, 6, 9]
    with pytest.raises(run_config.ConfigError, match='exchange_interval'):
        run_config.make_config(
            output_dir='x', algorithm='kdpdfl', settings=kdpdfl.KDPDFLSettings(exchange_interval=1)
        ).validate()


def test_without_mu_kdpdfl_is_decentralized_fedavg(problem, tff_runtime):
    """mu_1 = mu_2 = 0 keeps W at 1/M; with confidence at its cap 1/(|N| + 1) the star's mix is the plain mean."""
    spec, model_fn = problem
    states = None
    outputs = {}
    for mode in ('kdpdfl', 'fedavg'):
        if mode == 'kdpdfl':
            settings = _settings(mode, kd_max_neighbours=3, kd_mu1=0.0, kd_mu2=0.0, kd_c_base=1.0)
        else:
            settings = _settings(mode, kd_max_neighbours=3)
        proc = kdpdfl.build_kdpdfl_process(spec, model_fn, settings)
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
    settings = _settings(
        'kdpdfl', client_learning_rate=0.1, kd_max_neighbours=2, kd_distance_layer=2, kd_distance_batch=1000
    )
    proc = kdpdfl.build_kdpdfl_process(spec, model_fn, settings)
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
    with pytest.raises(ValueError, match=r'^kd_distance_layer=9 is not a layer of the model: it has 3 layers'):
        kdpdfl.build_kdpdfl_process(spec, model_fn, dataclasses.replace(settings, kd_distance_layer=9))


def test_the_loop_takes_from_each_mode_only_what_it_has():
    assert kdpdfl.ServerlessLocalSettings(exchange_interval=4).loop_arguments() == dict(
        exchange_interval=4, mean_reachable=None, finetune_from=None
    )
    assert kdpdfl.KDPDFLSettings(kd_mean_neighbours=3.0).loop_arguments() == dict(
        exchange_interval=5, mean_reachable=3.0, finetune_from=None
    )
    assert kdpdfl.ServerlessFedAvgSettings().loop_arguments()['finetune_from'] is None
    assert kdpdfl.ServerlessFedAvgPlusSettings(finetune_from_slot=40).loop_arguments() == dict(
        exchange_interval=5, mean_reachable=5.0, finetune_from=40
    )


def test_each_mode_has_exactly_the_settings_it_uses():
    names = {mode: set(cls.field_names()) for mode, cls in kdpdfl.MODE_SETTINGS.items()}
    plus = set(kdpdfl.ServerlessFedAvgPlusSettings.field_names())
    weight_update = {'kd_mu1', 'kd_mu2', 'kd_c_base', 'kd_distance_batch', 'kd_distance_layer', 'kd_step', 'kd_mix'}
    exchange = {'kd_mean_neighbours', 'kd_max_neighbours', 'kd_broadcast'}
    local_work = {'batch_size', 'client_learning_rate', 'local_epochs', 'local_steps', 'exchange_interval'}
    assert names['local'] == local_work
    assert names['fedavg'] == local_work | exchange
    assert plus == local_work | exchange | {'finetune_from_slot'}
    assert names['kdpdfl'] == local_work | exchange | weight_update
    for cls in (*kdpdfl.MODE_SETTINGS.values(), kdpdfl.ServerlessFedAvgPlusSettings):
        assert issubclass(cls, kdpdfl.ServerlessSettings)
        assert cls().validate() == cls()


@pytest.mark.parametrize(
    'cls,changes,message',
    [
        (kdpdfl.ServerlessLocalSettings, dict(exchange_interval=1), 'exchange_interval must be >= 2'),
        (kdpdfl.ServerlessLocalSettings, dict(local_steps=-1), 'local_steps must be >= 0'),
        (kdpdfl.ServerlessLocalSettings, dict(local_steps=2.5), 'local_steps must be an integer'),
        (kdpdfl.ServerlessFedAvgSettings, dict(kd_mean_neighbours=0.0), 'kd_mean_neighbours must be > 0'),
        (kdpdfl.ServerlessFedAvgSettings, dict(kd_max_neighbours=0), 'kd_max_neighbours must be >= 1'),
        (kdpdfl.ServerlessFedAvgSettings, dict(kd_broadcast='shout'), 'kd_broadcast must be one of adopt, keep'),
        (kdpdfl.ServerlessFedAvgPlusSettings, dict(finetune_from_slot=-5), 'finetune_from_slot must be >= 0'),
        (kdpdfl.KDPDFLSettings, dict(kd_mu1=-1.0), 'kd_mu1 must be >= 0'),
        (kdpdfl.KDPDFLSettings, dict(kd_mu2=-0.5), 'kd_mu2 must be >= 0'),
        (kdpdfl.KDPDFLSettings, dict(kd_c_base=0.0), 'kd_c_base must be > 0'),
        (kdpdfl.KDPDFLSettings, dict(kd_distance_batch=0), 'kd_distance_batch must be >= 1'),
        (kdpdfl.KDPDFLSettings, dict(kd_distance_layer=0), 'kd_distance_layer must be -1'),
        (kdpdfl.KDPDFLSettings, dict(kd_step='unit'), "^kd_step must be one of norm, elementwise, got 'unit'$"),
        (kdpdfl.KDPDFLSettings, dict(kd_mix='all'), "^kd_mix must be one of exchange, footprints, got 'all'$"),
    ],
)
def test_bad_settings_are_refused_in_one_line(cls, changes, message):
    with pytest.raises(settings_lib.SettingsError, match=message) as caught:
        cls(**changes).validate()
    assert '\n' not in str(caught.value)


def test_the_settings_type_is_the_mode_and_other_settings_are_refused(problem):
    spec, model_fn = problem
    assert {mode: kdpdfl.mode_of(cls()) for mode, cls in kdpdfl.MODE_SETTINGS.items()} == {
        'kdpdfl': 'kdpdfl',
        'fedavg': 'fedavg',
        'local': 'local',
    }
    assert kdpdfl.mode_of(kdpdfl.ServerlessFedAvgPlusSettings()) == 'fedavg'
    assert kdpdfl.build_kdpdfl_process(spec, model_fn, kdpdfl.ServerlessLocalSettings()).mode == 'local'
    with pytest.raises(TypeError, match=r'^build_kdpdfl_process takes KDPDFLSettings, .* got LocalTraining$'):
        kdpdfl.build_kdpdfl_process(spec, model_fn, settings_lib.LocalTraining())
    with pytest.raises(settings_lib.SettingsError, match='kd_c_base must be > 0'):
        kdpdfl.build_kdpdfl_process(spec, model_fn, kdpdfl.KDPDFLSettings(kd_c_base=-1.0))
