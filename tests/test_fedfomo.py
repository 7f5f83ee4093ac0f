"""FedFomo: the first-order weights and update against numpy, the epsilon-greedy candidates, the affinity matrix P,
what crosses to the server, a run through the training binary's code, and the settings."""

import functools
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedfomo
from tests import numpy_reference as ref
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, device_state

SEED = 3
# Local training of the round tests: 2 epochs of batch 8 at learning rate 0.2.
LOCAL = dict(local_epochs=2, batch_size=8, client_learning_rate=0.2)


# Independent numpy references of the client's step.


def _numpy_weights(own_loss, candidate_losses, distances):
    """w_j = max(0, (L(own) - L(j)) / ||theta_j - own||), 0 for a model equal to own; and normalised by the sum."""
    raw = np.array([max(0.0, own_loss - loss) / d if d > 0 else 0.0 for loss, d in zip(candidate_losses, distances)])
    total = raw.sum()
    return raw, (raw / total if total > 0 else np.zeros_like(raw))


def test_the_weights_and_the_update_against_numpy():
    rng = np.random.default_rng(0)
    own = rng.normal(size=7)
    candidates = rng.normal(size=(5, 7))
    candidates[3] = own  # equal to theta_i^{t-1}: no direction, weight 0
    own_loss = 1.0
    losses = np.array([0.4, 1.3, 0.9, 0.2, 0.1])  # the second is worse: weight 0
    valid = np.array([True, True, True, True, False])  # the last slot is empty
    distances = np.linalg.norm(candidates - own, axis=1)
    raw, weights = fedfomo.fomo_weights(
        tf.constant(own_loss), tf.constant(losses, tf.float32), tf.constant(distances, tf.float32), tf.constant(valid)
    )
    want_raw, want = _numpy_weights(own_loss, losses[:4], distances[:4])
    np.testing.assert_allclose(raw.numpy(), [*want_raw, 0.0], rtol=1e-5)
    np.testing.assert_allclose(weights.numpy(), [*want, 0.0], rtol=1e-5)
    assert want_raw[1] == 0 and want_raw[3] == 0 and want.sum() == pytest.approx(1.0)
    moved = fedfomo.fomo_update(
        tf.constant(own, tf.float32), tf.constant(candidates, tf.float32), tf.constant(weights)
    ).numpy()
    np.testing.assert_allclose(moved, own + sum(w * (c - own) for w, c in zip(want, candidates[:4])), atol=1e-5)


def test_signed_gains_against_numpy():
    """The authors' increments of P: the gains before clipping, over the absolute value of their sum."""
    losses = np.array([0.4, 1.3, 0.9, 0.7])
    distances = np.array([2.0, 0.5, 0.0, 1.0])
    valid = np.array([True, True, True, False])
    got = fedfomo.signed_gains(
        tf.constant(1.0), tf.constant(losses, tf.float32), tf.constant(distances, tf.float32), tf.constant(valid)
    ).numpy()
    gains = np.array([(1.0 - 0.4) / 2.0, (1.0 - 1.3) / 0.5, 0.0, 0.0])
    np.testing.assert_allclose(got, gains / abs(gains.sum()), rtol=1e-5)
    assert got[1] < 0  # a worse model lowers P_ij


def test_no_better_candidate_keeps_the_own_model():
    own = np.arange(4, dtype=np.float32)
    candidates = np.stack([own + 1.0, own - 2.0])
    _, weights = fedfomo.fomo_weights(
        tf.constant(0.5), tf.constant([0.6, 0.5]), tf.constant([2.0, 4.0]), tf.constant([True, True])
    )
    np.testing.assert_array_equal(weights.numpy(), [0.0, 0.0])
    np.testing.assert_array_equal(fedfomo.fomo_update(own, candidates, weights).numpy(), own)


def _candidates(affinity, available, count, epsilon, seed):
    return fedfomo.choose_candidates(
        tf.constant(affinity, tf.float32),
        tf.constant(available),
        count=count,
        epsilon=epsilon,
        seed=tf.constant([seed, 0], tf.int64),
    ).numpy()


def test_greedy_candidates_are_the_highest_affinities_among_the_held_models():
    """epsilon = 0: row i holds the M clients j != i of highest P_ij whose model the server holds, best first."""
    rng = np.random.default_rng(2)
    affinity = rng.permutation(36).reshape(6, 6).astype(np.float32)
    available = np.array([True, True, False, True, True, True])
    chosen = _candidates(affinity, available, 3, 0.0, seed=5)
    for i in range(6):
        pool = [j for j in range(6) if j != i and available[j]]
        want = sorted(pool, key=lambda j: -affinity[i, j])[:3]
        assert list(chosen[i]) == want, i
    # A pool smaller than M: all of it, then empty slots.
    few = _candidates(affinity, np.array([True, False, False, False, False, True]), 3, 0.0, seed=5)
    assert list(few[0]) == [5, -1, -1]
    assert list(few[1]) == [*sorted([0, 5], key=lambda j: -affinity[1, j]), -1]
    assert list(few[2]) == [*sorted([0, 5], key=lambda j: -affinity[2, j]), -1]


def test_candidate_choice_is_fixed_by_the_seed_and_explores_with_epsilon():
    rng = np.random.default_rng(3)
    affinity = rng.normal(size=(8, 8)).astype(np.float32)
    available = np.ones(8, bool)
    first = _candidates(affinity, available, 3, 0.3, seed=11)
    np.testing.assert_array_equal(first, _candidates(affinity, available, 3, 0.3, seed=11))
    draws = np.stack([_candidates(affinity, available, 3, 1.0, seed=s) for s in range(60)])
    for i in range(8):
        rows = draws[:, i]
        assert all(len(set(r)) == 3 and i not in r for r in rows)  # distinct others
        assert set(rows.ravel()) == set(range(8)) - {i}  # every other client is drawn some time
    # Exploring slots are drawn at random: with epsilon = 1 the top-M set is only sometimes the choice.
    top = [set(np.argsort(-np.where(np.eye(8, dtype=bool)[i], -np.inf, affinity[i]))[:3]) for i in range(8)]
    share = np.mean([set(draws[s, i]) == top[i] for s in range(60) for i in range(8)])
    assert share < 0.2  # 1 / C(7, 3) = 0.029 expected
    greedy = _candidates(affinity, available, 3, 0.0, seed=11)
    assert all(set(greedy[i]) == top[i] for i in range(8))


def test_ties_in_affinity_are_broken_at_random():
    """Before any weight, P is zero: the greedy candidates differ from seed to seed, not the lowest indices."""
    chosen = {tuple(_candidates(np.zeros((6, 6)), np.ones(6, bool), 2, 0.0, seed=s)[0]) for s in range(20)}
    assert len(chosen) > 3


def test_the_epsilon_schedule():
    settings = fedfomo.FedFomoSettings()
    assert [round(float(settings.epsilon_at(t)), 6) for t in (0, 1, 5, 6, 9)] == [0.3, 0.25, 0.05, 0.0, 0.0]
    assert float(fedfomo.FedFomoSettings(fedfomo_epsilon_decay=0.0).epsilon_at(100)) == pytest.approx(0.3)


def test_an_affinity_row_puts_each_weight_in_its_candidates_column():
    row = fedfomo.affinity_row(tf.constant([3, 0, -1]), tf.constant([0.25, 0.75, 0.0]), 5).numpy()
    np.testing.assert_array_equal(row, [0.75, 0, 0, 0.25, 0])


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    """Three clients of a tiny linear task (37, 50 and 23 examples each split) and multinomial logistic regression."""
    spec = make_linear_problem(tmp_path_factory.mktemp('fedfomo') / 'data')
    return spec, functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)


def _unpack(packed, dim, classes):
    packed = np.asarray(packed, np.float64)
    return [packed[: dim * classes].reshape(dim, classes), packed[dim * classes :]]


def _pack(params):
    return np.concatenate([p.ravel() for p in params])


def _numpy_client_round(spec, client_id, own, candidates, config, round_num, dim, classes):
    """The paper's client step in numpy: validation losses, w_ij, the move, local SGD from there."""
    x_val, y_val = ref.read(spec, client_id, 'val')
    loss = lambda packed: ref.loss_and_grads(_unpack(packed, dim, classes), x_val, y_val)[0]  # noqa: E731
    raw, weights = _numpy_weights(
        loss(own), [loss(c) for c in candidates], [np.linalg.norm(c - own) for c in candidates]
    )
    start = own + sum(w * (c - own) for w, c in zip(weights, candidates))
    x, y = ref.read(spec, client_id)
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, len(y), config.epochs, config.batch_size)
    trained = ref.sgd(_unpack(start, dim, classes), x, y, config, batch, ref.num_steps(config, per_epoch))
    return _pack(trained), raw, weights


def _numpy_signed(spec, client_id, own, candidates, dim, classes):
    x_val, y_val = ref.read(spec, client_id, 'val')
    loss = lambda packed: ref.loss_and_grads(_unpack(packed, dim, classes), x_val, y_val)[0]  # noqa: E731
    gains = np.array([(loss(own) - loss(c)) / np.linalg.norm(c - own) for c in candidates])
    return gains / abs(gains.sum())


@pytest.mark.parametrize('affinity', ['normalized', 'raw', 'signed'])
def test_three_rounds_against_numpy(problem, tff_runtime, affinity):
    """M = N - 1 = 2, so every client's candidates are the other two (whatever epsilon): round 1 is local SGD
    from theta^0 (the store is empty); round 2 weighs the round-1 models; round 3 takes clients 0 and 2 only. The
    store, P (the weights summed over the rounds) and the metrics follow."""
    spec, model_fn = problem
    settings = fedfomo.FedFomoSettings(**LOCAL, fedfomo_candidates=2, fedfomo_affinity=affinity)
    process = fedfomo.build_fedfomo_process(spec, model_fn, settings, seed=SEED)
    ids = list(spec.client_ids)
    dim, classes = spec.feature_shape[0], spec.num_classes
    config = settings.training_config()
    state = process.initialize()
    states = [process.initial_client_state(c) for c in ids]
    w0 = np.asarray(states[0]['params'], np.float64)

    state, states, metrics = process.next(state, states)
    for client_id, s in zip(ids, states):
        want, _, _ = _numpy_client_round(spec, client_id, w0, [], config, 0, dim, classes)
        np.testing.assert_allclose(s['params'], want, atol=2e-5, rtol=2e-4)
    assert metrics['mean_candidates'] == 0 and metrics['mean_kept_own_model'] == 1
    np.testing.assert_array_equal(state['uploaded'], [1, 1, 1])
    np.testing.assert_array_equal(state['affinity'], np.zeros((3, 3)))

    want_affinity = np.zeros((3, 3))
    for round_num, sampled in ((1, [0, 1, 2]), (2, [0, 2])):
        store = np.asarray(state['models'], np.float64)
        np.testing.assert_allclose(store, [np.asarray(s['params']) for s in states], atol=0)
        kept = 0
        results = {}
        for k in sampled:
            others = [j for j in range(3) if j != k]
            results[k] = _numpy_client_round(spec, ids[k], store[k], store[others], config, round_num, dim, classes)
            raw, weights = results[k][1:]
            if affinity == 'signed':
                want_affinity[k, others] += _numpy_signed(spec, ids[k], store[k], store[others], dim, classes)
            else:
                want_affinity[k, others] += raw if affinity == 'raw' else weights
            kept += int(not weights.any())
        state, updated, metrics = process.next(state, [states[k] for k in sampled])
        for k, s in zip(sampled, updated):
            np.testing.assert_allclose(s['params'], results[k][0], atol=2e-5, rtol=2e-4)
            states[k] = s
        np.testing.assert_allclose(state['affinity'], want_affinity, rtol=1e-4, atol=1e-6)
        assert metrics['mean_candidates'] == 2 and metrics['num_clients'] == len(sampled)
        assert metrics['mean_kept_own_model'] == pytest.approx(kept / len(sampled))
        assert state['round_num'] == round_num + 1
    assert states[1]['num_participations'] == 2 and states[0]['num_participations'] == 3
    assert want_affinity.any()  # some candidate helped: the test exercised the move
    evaluation = process.evaluate(state, states)
    assert all(e['personalized_model']['accuracy'] >= 0.6 for e in evaluation)  # it learns the linear task


def _numpy_own_candidate_round(spec, client_id, own, reference, candidates, config, round_num, dim, classes):
    """The authors' reading in numpy: theta_i^{t-1} first among the candidates, every gain and distance from r_i,
    the move from r_i (all zero: r_i), local SGD from there. Returns the trained model, the move's end (the next
    r_i), and the raw weights, normalised weights and signed increments of the M + 1 models."""
    x_val, y_val = ref.read(spec, client_id, 'val')
    loss = lambda packed: ref.loss_and_grads(_unpack(packed, dim, classes), x_val, y_val)[0]  # noqa: E731
    pool = [own, *candidates]
    distances = [np.linalg.norm(c - reference) for c in pool]
    raw, weights = _numpy_weights(loss(reference), [loss(c) for c in pool], distances)
    start = reference + sum(w * (c - reference) for w, c in zip(weights, pool))
    gains = np.array([(loss(reference) - loss(c)) / d if d > 0 else 0.0 for c, d in zip(pool, distances)])
    signed = gains / abs(gains.sum()) if gains.sum() != 0 else np.zeros_like(gains)
    x, y = ref.read(spec, client_id)
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, len(y), config.epochs, config.batch_size)
    trained = ref.sgd(_unpack(start, dim, classes), x, y, config, batch, ref.num_steps(config, per_epoch))
    return _pack(trained), start, raw, weights, signed


@pytest.mark.parametrize('affinity', ['normalized', 'raw', 'signed'])
def test_three_rounds_with_the_own_model_as_a_candidate_against_numpy(problem, tff_runtime, affinity):
    """`fedfomo_own_candidate`: as `test_three_rounds_against_numpy`, with theta_i^{t-1} one more candidate and
    every gain measured from r_i, the model the client started its previous local training from (theta^0 before
    its first round). Round 1 moves nowhere (theta_i = r_i = theta^0: distance 0); round 2 weighs the trained
    theta_i^1 and the others' against theta^0, so the own model's gain is not zero by construction; round 3 takes
    clients 0 and 2. The client states (theta_i and r_i), P (the others' columns only) and the metrics follow."""
    spec, model_fn = problem
    settings = fedfomo.FedFomoSettings(
        **LOCAL, fedfomo_candidates=2, fedfomo_affinity=affinity, fedfomo_own_candidate=True
    )
    process = fedfomo.build_fedfomo_process(spec, model_fn, settings, seed=SEED)
    ids = list(spec.client_ids)
    dim, classes = spec.feature_shape[0], spec.num_classes
    config = settings.training_config()
    state = process.initialize()
    states = [process.initial_client_state(c) for c in ids]
    w0 = np.asarray(states[0]['params'], np.float64)
    np.testing.assert_array_equal(states[0]['reference'], states[0]['params'])  # r_i = theta^0 at first
    references = {k: w0 for k in range(3)}

    want_affinity = np.zeros((3, 3))
    own_weights, other_weights = [], []
    for round_num, sampled in ((0, [0, 1, 2]), (1, [0, 1, 2]), (2, [0, 2])):
        store = np.asarray(state['models'], np.float64)
        results, kept, own_sum = {}, 0, 0.0
        for k in sampled:
            others = [j for j in range(3) if j != k] if round_num else []
            own = np.asarray(states[k]['params'], np.float64)
            results[k] = _numpy_own_candidate_round(
                spec, ids[k], own, references[k], list(store[others]), config, round_num, dim, classes
            )
            _, _, raw, weights, signed = results[k]
            want_affinity[k, others] += dict(normalized=weights, raw=raw, signed=signed)[affinity][1:]
            kept += int(not weights[1:].any())
            own_sum += weights[0]
            own_weights.append(weights[0])
            other_weights.extend(weights[1:])
        state, updated, metrics = process.next(state, [states[k] for k in sampled])
        for k, s in zip(sampled, updated):
            np.testing.assert_allclose(s['params'], results[k][0], atol=2e-5, rtol=2e-4)
            np.testing.assert_allclose(s['reference'], results[k][1], atol=2e-5, rtol=2e-4)
            states[k], references[k] = s, np.asarray(s['reference'], np.float64)
        np.testing.assert_allclose(state['affinity'], want_affinity, rtol=1e-4, atol=1e-6)
        assert metrics['mean_kept_own_model'] == pytest.approx(kept / len(sampled))
        assert metrics['mean_own_weight'] == pytest.approx(own_sum / len(sampled), rel=1e-4, abs=1e-6)
        assert metrics['mean_candidates'] == (2 if round_num else 0)
    np.testing.assert_array_equal(np.asarray(states[1]['reference']), references[1])
    # The test exercised the reading: the own model took some weight, another client's model some other.
    assert max(own_weights) > 0 and max(other_weights) > 0
    assert 0 < max(own_weights[3:]) < 1  # a mix of the own model and others' after round 1
    evaluation = process.evaluate(state, states)
    assert all(e['personalized_model']['accuracy'] >= 0.6 for e in evaluation)


def test_the_own_candidate_is_off_by_default_and_keeps_the_client_state(problem):
    """Without the setting the client state has no r_i and the metrics no own weight: the paper's update."""
    spec, model_fn = problem
    assert fedfomo.FedFomoSettings().fedfomo_own_candidate is False
    plain = fedfomo.build_fedfomo_process(spec, model_fn, fedfomo.FedFomoSettings(**LOCAL))
    own = fedfomo.build_fedfomo_process(spec, model_fn, fedfomo.FedFomoSettings(**LOCAL, fedfomo_own_candidate=True))
    num_params = (spec.feature_shape[0] + 1) * spec.num_classes
    plain_state = plain.initial_client_state.type_signature.result
    own_state = own.initial_client_state.type_signature.result
    assert 'reference' not in str(plain_state) and f'reference=float32[{num_params}]' in str(own_state)
    assert 'own_weight' not in str(plain.next.type_signature.result[2])
    assert 'mean_own_weight' in str(own.next.type_signature.result[2])
    # What crosses to the server is the same, with one more scalar metric sum: r_i stays on the client.
    moved = sorted((uri, str(t)) for uri, t in audit.clients_to_server_values(own.next))
    assert moved[0] == ('federated_aggregate', f'{{<index=int32,value=float32[{num_params}]>}}@CLIENTS')
    assert ('federated_sum', '{float32[3,3]}@CLIENTS') in moved and len(moved) == 3
    rest = [sent for _, sent in moved[1:] if sent != '{float32[3,3]}@CLIENTS']
    assert len(rest) == 1 and 'own_weight=float32' in rest[0] and '[' not in rest[0], rest


def test_only_each_clients_model_weights_and_metric_sums_reach_the_server(problem):
    """The paper's exchange: each client's theta_i^t with its index (the server's store), its weights w_ij (its row
    of P's increments) and scalar metric sums; nothing of the client's data."""
    spec, model_fn = problem
    process = fedfomo.build_fedfomo_process(spec, model_fn, fedfomo.FedFomoSettings(**LOCAL))
    num_params = (spec.feature_shape[0] + 1) * spec.num_classes
    moved = sorted((uri, str(t)) for uri, t in audit.clients_to_server_values(process.next))
    assert moved[0] == ('federated_aggregate', f'{{<index=int32,value=float32[{num_params}]>}}@CLIENTS')
    assert ('federated_sum', '{float32[3,3]}@CLIENTS') in moved
    rest = [sent for uri, sent in moved[1:] if sent != '{float32[3,3]}@CLIENTS']
    assert len(rest) == 1 and rest[0].startswith('{<') and '[' not in rest[0], rest  # the metric sums: scalars
    assert len(moved) == 3
    assert process.extras['communication']['parameter_bytes_up_per_client'] == num_params * 4 + 2 * 4
    # The device form sends the same model in the client's row of an [N, D] sum, its presence, its row of P's.
    uploads = [str(t) for phase in process.device.phases.values() for _, t in audit.clients_to_server_values(phase)]
    assert {f'{{float32[3,{num_params}]}}@CLIENTS', '{int32[3]}@CLIENTS', '{float32[3,3]}@CLIENTS'} <= set(uploads)
    assert not any(
        uri == 'federated_aggregate'
        for phase in process.device.phases.values()
        for uri, _ in audit.clients_to_server_values(phase)
    )


@pytest.mark.parametrize('own_candidate', [False, True])
def test_the_device_form_gives_the_in_process_rounds(problem, tmp_path, tff_runtime, own_candidate):
    """Three rounds (all, two, all clients) in process and as the device form's phase: the same server state,
    metrics and client states (with the own candidate, r_i too), bit for bit."""
    spec, model_fn = problem
    settings = fedfomo.FedFomoSettings(**LOCAL, fedfomo_candidates=1, fedfomo_own_candidate=own_candidate)
    process = fedfomo.build_fedfomo_process(spec, model_fn, settings)
    device = process.device
    assert list(device.phases) == ['next']
    ids = list(spec.client_ids)
    os.makedirs(tmp_path / 'states')
    devices = {c: device_state.device_input(c, str(tmp_path / 'states')) for c in ids}
    states = {c: process.initial_client_state(c) for c in ids}
    state, device_server = process.initialize(), device.initialize()
    for sampled in (ids, ids[1:], ids):
        output = process.next(state, [states[c] for c in sampled])
        states.update(zip(sampled, output.client_states))
        device_server, metrics = device_state.run_round(device, device_server, [devices[c] for c in sampled])
        for name in output.state:
            np.testing.assert_array_equal(output.state[name], device_server[name])
        assert list(output.metrics) == list(metrics)
        for name in metrics:
            np.testing.assert_array_equal(output.metrics[name], metrics[name])
        for c in ids:
            on_device = device_state.load(devices[c]['state_file'], states[c])
            for name in on_device:
                np.testing.assert_array_equal(np.asarray(states[c][name]), np.asarray(on_device[name]))
        state = output.state
    assert output.metrics['mean_candidates'] == 1
    assert ('mean_own_weight' in output.metrics) == own_candidate


def test_the_server_state_is_the_store_of_n_models_and_p(problem):
    spec, model_fn = problem
    process = fedfomo.build_fedfomo_process(spec, model_fn, fedfomo.FedFomoSettings(**LOCAL))
    num_params = (spec.feature_shape[0] + 1) * spec.num_classes
    state_type = process.initialize.type_signature.result.member
    assert str(state_type) == (
        f'<models=float32[3,{num_params}],uploaded=int32[3],affinity=float32[3,3],round_num=int32>'
    )
    assert process.extras['server_state_bytes'] == audit.type_bytes(state_type)


def test_a_sampled_run_writes_the_affinity_matrix_and_each_clients_rounds(tiny_npz, tmp_path):
    """Through the training binary's code, half the clients a round: P's heatmap and CSV, the store's shape, and
    clients.csv's rounds taken part."""
    import csv

    from tff_pfl.program import experiment, run_config

    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        algorithm='fedfomo',
        dataset=f'npz:{tiny_npz}',
        partition='iid',
        num_clients=4,
        client_fraction=0.5,
        rounds=3,
        eval_every=0,
        model='logistic',
        local_steps=2,
    ).validate()
    result = experiment.run_experiment(config, log=lambda line: None)
    assert np.asarray(result.state['affinity']).shape == (4, 4)
    assert np.asarray(result.state['models']).shape[0] == 4
    assert (np.asarray(result.state['affinity']) >= 0).all()
    assert (tmp_path / 'run' / 'affinity.png').exists()
    with open(tmp_path / 'run' / 'clients.csv') as f:
        taken = [int(row['rounds_taken_part']) for row in csv.DictReader(f)]
    assert sum(taken) == 3 * 2 and len(taken) == 4
    assert sum(np.asarray(result.state['uploaded'])) == sum(t > 0 for t in taken)


@pytest.mark.parametrize(
    'values, message',
    [
        (dict(fedfomo_candidates=0), 'fedfomo_candidates must be >= 1, got 0'),
        (dict(fedfomo_epsilon=1.5), 'fedfomo_epsilon must be in [0, 1], got 1.5'),
        (dict(fedfomo_epsilon_decay=-0.1), 'fedfomo_epsilon_decay must be >= 0, got -0.1'),
        (dict(fedfomo_affinity='sum'), "fedfomo_affinity must be one of normalized, raw, signed, got 'sum'"),
        (dict(local_epochs=0), 'local_epochs must be >= 1, got 0'),
    ],
)
def test_bad_settings_are_refused_in_one_line(values, message):
    with pytest.raises(settings_lib.SettingsError) as raised:
        fedfomo.FedFomoSettings(**values).validate()
    assert str(raised.value) == message


def test_the_builder_refuses_what_it_cannot_use_in_one_line(problem, tmp_path):
    spec, model_fn = problem
    for keyword, value in [
        ('server_optimizer', tff.learning.optimizers.build_sgdm(1.0)),
        ('model_aggregator', tff.aggregators.MeanFactory()),
    ]:
        with pytest.raises(ValueError, match=rf'^build_fedfomo_process takes no {keyword}: ') as raised:
            fedfomo.build_fedfomo_process(spec, model_fn, **{keyword: value})
        assert '\n' not in str(raised.value)
    with pytest.raises(TypeError, match='^build_fedfomo_process takes FedFomoSettings, got LocalTraining$'):
        fedfomo.build_fedfomo_process(spec, model_fn, settings_lib.LocalTraining())
    from tff_pfl.data import client_data_writer

    x = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
    splits = [{'train': np.arange(4), 'val': np.arange(4, 6), 'test': np.arange(6, 8)}]
    splits.append({'train': np.arange(8, 11), 'val': np.arange(0), 'test': np.arange(11, 12)})
    no_val = client_data_writer.write_client_data(str(tmp_path / 'noval'), x, np.zeros(12, np.int32), 3, splits)
    with pytest.raises(ValueError, match="^FedFomo's weights of the candidate models reads each client's validation"):
        fedfomo.build_fedfomo_process(no_val, model_fn)


def test_dp_and_secure_aggregation_are_refused_in_one_line():
    from tff_pfl.program import run_config

    for values in (dict(dp_noise_multiplier=0.5, dp_clip=1.0), dict(secure_aggregation=True)):
        config = run_config.make_config(output_dir='x', algorithm='fedfomo', **values)
        with pytest.raises(run_config.ConfigError) as refused:
            config.validate()
        line = str(refused.value)
        assert line.endswith(f'fedfomo {fedfomo.NO_PRIVACY}') and '\n' not in line
