"""KT-pFL with partial participation (the paper's Table 2): a sampled block of c, sampled clients only."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl, ktpfl_homo, ktpfl_rounds
from tests import numpy_reference
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import audit
from tff_pfl.data import client_data
from tff_pfl.program import client_states, experiment, run_config, training_loop

SIZES = (37, 50, 23, 30)  # four clients
PUBLIC = 20
TEMPERATURE = 2.0


# Independent numpy references: the paper's objectives written over the sampled clients S only.


def _restricted(matrix, sampled):
    return matrix[np.ix_(sampled, sampled)]


def _kl_objective(c_s, s_s, sizes_s, rho, lam, num_clients):
    """Eq. 4 over S: lam sum_{n in S} D_n/D_S KL(sum_{m in S} c~[n, m] s_m || s_n) + rho ||c_S - 1/N||^2."""
    w = c_s / c_s.sum(axis=1, keepdims=True)
    t = np.einsum('nm,mpc->npc', w, s_s)
    kl = (t * (np.log(np.maximum(t, 1e-8)) - np.log(np.maximum(s_s, 1e-8)))).sum(-1).mean(-1)
    return lam * (sizes_s / sizes_s.sum() * kl).sum() + rho * ((c_s - 1 / num_clients) ** 2).sum()


def _distance_objective(c_s, w_s, sizes_s, rho, lam, num_clients):
    """Eq. 11 over S, with L_dis(a, b) = 1/2 ||a - b||^2."""
    mixed = (c_s / c_s.sum(axis=1, keepdims=True)) @ w_s
    distance = 0.5 * ((mixed - w_s) ** 2).sum(axis=1)
    return lam * (sizes_s / sizes_s.sum() * distance).sum() + rho * ((c_s - 1 / num_clients) ** 2).sum()


def _block_step(objective, c, sampled, learning_rate):
    """The step of `objective` (a function of the S x S block) on the block; c elsewhere as it was."""
    c = np.asarray(c, np.float64)  # numeric gradients need float64
    c_s = _restricted(c, sampled)
    want = c.copy()
    want[np.ix_(sampled, sampled)] = np.maximum(
        c_s - learning_rate * numpy_reference.numeric_gradient(objective, c_s), 0.0
    )
    return want


def _slots(values, sampled):
    """Upload slots as the server receives them: absent clients' rows are zero."""
    out = np.zeros_like(values)
    out[sampled] = values[sampled]
    return out


@pytest.fixture
def round_values():
    rng = np.random.default_rng(7)
    c = rng.uniform(0.05, 0.5, size=(5, 5))
    logits = rng.normal(size=(5, 6, 3)) * 2
    s = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    params = rng.normal(size=(5, 8))
    sizes = rng.integers(10, 60, size=5).astype(np.float64)
    return c, s, params, sizes


def _present(sampled, n=5):
    present = np.zeros(n, np.float32)
    present[sampled] = 1.0
    return present


def test_mix_uses_only_the_sampled_clients(round_values):
    c, s, params, _ = round_values
    sampled = [0, 2, 3]
    present = tf.constant(_present(sampled))
    targets = ktpfl.mix(tf.constant(c, tf.float32), tf.constant(_slots(s, sampled), tf.float32), present).numpy()
    c_s = _restricted(c, sampled)
    want = np.einsum('nm,mpc->npc', c_s / c_s.sum(axis=1, keepdims=True), s[sampled])
    np.testing.assert_allclose(targets[sampled], want, rtol=1e-5)
    np.testing.assert_allclose(targets[sampled].sum(-1), 1.0, rtol=1e-5)  # distributions over S's predictions
    assert not targets[[1, 4]].any()  # no target is formed for an absent client
    # The homogeneous mix takes the sampled clients' rows only (K = 4 rows for 3 clients: one empty row).
    ids = tf.constant([0, 2, 3, -1])
    rows = np.concatenate([params[sampled], np.zeros((1, params.shape[1]))])
    mixed = ktpfl_homo.personalized_parameters(tf.constant(c, tf.float32), tf.constant(rows, tf.float32), ids).numpy()
    np.testing.assert_allclose(mixed[:3], (c_s / c_s.sum(axis=1, keepdims=True)) @ params[sampled], atol=1e-5)
    assert not mixed[3].any()


def test_sampled_block_takes_the_papers_step_and_nothing_else_moves(round_values):
    c, s, params, sizes = round_values
    sampled = [0, 2, 3]
    inputs = dict(
        coefficients=tf.constant(c, tf.float32),
        weights=tf.constant(_slots(sizes, sampled), tf.float32),
        present=tf.constant(_present(sampled)),
        learning_rate=0.1,
        rho=0.6,
    )
    got = ktpfl.paper_update(predictions=tf.constant(_slots(s, sampled), tf.float32), imitation=4.0, **inputs).numpy()
    want = _block_step(lambda m: _kl_objective(m, s[sampled], sizes[sampled], 0.6, 4.0, 5), c, sampled, 0.1)
    np.testing.assert_allclose(got, want, atol=1e-5)
    outside = _present(sampled)[:, None] * _present(sampled)[None, :] == 0
    np.testing.assert_array_equal(got[outside], np.float32(c)[outside])  # bit for bit
    assert not np.allclose(got[~outside], np.float32(c)[~outside])
    del inputs['present']  # the homogeneous step reads who took part from its rows' ids
    got = ktpfl_homo.homogeneous_update(
        params=tf.constant(params[[3, 0, 2]], tf.float32), ids=tf.constant([3, 0, 2]), imitation=1.0, **inputs
    ).numpy()
    want = _block_step(lambda m: _distance_objective(m, params[sampled], sizes[sampled], 0.6, 1.0, 5), c, sampled, 0.1)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(got[outside], np.float32(c)[outside])


def test_every_client_present_is_the_full_participation_round_bit_for_bit(round_values):
    """A presence vector of ones gives the unmasked code path's numbers exactly, eagerly and in a graph."""
    c, s, params, sizes = (tf.constant(v, tf.float32) for v in round_values)
    ones, every_id = tf.ones([5]), tf.range(5)
    steps = dict(learning_rate=0.3, rho=0.6)

    def both(present, ids):
        return [
            ktpfl.mix(c, s, present),
            ktpfl_homo.personalized_parameters(c, params, ids),
            ktpfl.paper_update(c, s, sizes, imitation=100.0, present=present, **steps),
            ktpfl_homo.homogeneous_update(c, params, sizes, imitation=1.0, ids=ids, **steps),
        ]

    for run in (lambda f, *a: f(*a), lambda f, *a: tf.function(f)(*a)):
        unmasked = run(lambda: both(None, None))
        masked = run(both, ones, every_id)
        for a, b in zip(unmasked, masked):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    return make_linear_problem(tmp_path_factory.mktemp('partial') / 'data', len(SIZES), SIZES, public_examples=PUBLIC)


def _store_round(proc, store, state, sampled_ids):
    before = {c: s for c, s in zip(store.ids(), store.all())}
    state, metrics = store.run_round(proc, state, sampled_ids)
    return state, metrics, before


def _assert_states_equal(a, b):
    for x, y in zip(tff.structure.flatten(a), tff.structure.flatten(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_ktpfl_round_with_half_of_the_clients(spec, tff_runtime):
    settings = ktpfl.KTpFLSettings(
        architectures=('logistic',),
        local_steps=2,
        batch_size=8,
        client_learning_rate=0.3,
        public_examples=PUBLIC,
        public_temperature=TEMPERATURE,
        kt_distill_epochs=0,  # the returned weights are the ones that made the uploaded predictions
        kt_coefficient_learning_rate=0.5,
        kt_rho=0.6,
    )
    proc = ktpfl.build_ktpfl_process(spec, settings, seed=1)
    ids = list(spec.client_ids)
    store = client_states.ClientStateStore(proc, ids)
    state = proc.initialize()
    state, _ = store.run_round(proc, state, ids)  # every client: c leaves 1/N
    c1 = np.asarray(state['coefficients'])
    assert np.ptp(c1) > 1e-4
    sampled_ids = training_loop.sample_clients(np.random.default_rng(3), ids, 0.5)  # the run loop's sampling
    assert len(sampled_ids) == 2
    sampled = sorted(ids.index(c) for c in sampled_ids)
    state, metrics, before = _store_round(proc, store, state, sampled_ids)
    c2 = np.asarray(state['coefficients'])
    assert metrics['num_clients'] == 2 and int(state['round_num']) == 2
    # Unsampled clients: state untouched; sampled: one more participation.
    after = dict(zip(store.ids(), store.all()))
    for i, client in enumerate(ids):
        if i in sampled:
            assert int(after[client]['num_participations']) == 2 and int(after[client]['last_round']) == 1
        else:
            _assert_states_equal(after[client], before[client])
    # c outside the sampled block: bit for bit as after round 1.
    block = np.zeros((4, 4), bool)
    block[np.ix_(sampled, sampled)] = True
    np.testing.assert_array_equal(c2[~block], c1[~block])
    # The block: Eq. 7's step over S, from the sampled clients' predictions on round 2's public batch.
    x = client_data.read_public_batch(spec, PUBLIC, 1, tf.constant(1)).numpy().reshape(PUBLIC, -1)
    dim, classes = x.shape[1], spec.num_classes
    s = np.zeros((4, PUBLIC, classes))
    for i in sampled:
        w = np.asarray(after[ids[i]]['params'], np.float64)
        logits = (
            x @ w[: dim * classes].reshape(dim, classes) + w[dim * classes : dim * classes + classes]
        ) / TEMPERATURE
        s[i] = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    sizes = np.array(SIZES, np.float64)
    lam = 1.0 * TEMPERATURE**2  # Eq. 4's KL term carries T^2 (docs/algorithms/ktpfl.md)
    want = _block_step(lambda m: _kl_objective(m, s[sampled], sizes[sampled], 0.6, lam, 4), c1, sampled, 0.5)
    np.testing.assert_allclose(c2[block], want[block], atol=2e-5)
    assert not np.allclose(c2[block], c1[block])


def test_ktpfl_homo_with_a_sample_mixes_only_the_sample(spec, tff_runtime):
    """eta_2 = 1, R = 1, c at 1/N: a sampled client adopts the plain mean of the sampled clients' uploads."""
    model_fn = lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)  # noqa: E731
    local = dict(local_steps=2, batch_size=8, client_learning_rate=0.3, kt_transfer_steps=1)

    def one_round(**values):
        proc = ktpfl_homo.build_ktpfl_homogeneous_process(
            spec, model_fn, ktpfl_homo.KTpFLHomoSettings(**local, **values)
        )
        states = [proc.initial_client_state(c) for c in spec.client_ids]
        output = proc.next(proc.initialize(), [states[1], states[3]])
        return output, proc

    uploaded, _ = one_round(kt_transfer_learning_rate=0.0, kt_coefficient_learning_rate=0.05)  # no transfer
    adopted, proc = one_round(kt_transfer_learning_rate=1.0, kt_coefficient_learning_rate=0.0)
    w = np.stack([np.asarray(s['params'], np.float64) for s in uploaded.client_states])
    for s in adopted.client_states:
        np.testing.assert_allclose(s['params'], w.mean(axis=0), atol=1e-6)  # FedAvg over the sample
    np.testing.assert_array_equal(adopted.state['coefficients'], np.full((4, 4), np.float32(0.25)))
    # The c step of the first process: the block of clients 1 and 3 against numpy, the rest still 1/N.
    c0 = np.full((4, 4), 0.25)
    sizes = np.array([SIZES[1], SIZES[3]], np.float64)
    want = _block_step(lambda m: _distance_objective(m, w, sizes, 0.6, 1.0, 4), c0, [1, 3], 0.05)
    np.testing.assert_allclose(uploaded.state['coefficients'], want, atol=1e-5)
    assert np.asarray(uploaded.state['coefficients'])[[0, 2]].tolist() == [[0.25] * 4] * 2
    assert adopted.metrics['num_clients'] == 2
    assert proc.extras['communication']['parameter_bytes_up_per_client'] == (4 * 3 + 3) * 4


def test_rows_of_the_round_clients_and_back():
    values = np.arange(5 * 2, dtype=np.float32).reshape(5, 2) + 1
    present = tf.constant([0.0, 1.0, 0.0, 1.0, 1.0])
    ids, rows = ktpfl_rounds.compact(present, tf.constant(values), capacity=4)
    assert ids.numpy().tolist() == [1, 3, 4, -1]
    np.testing.assert_array_equal(rows.numpy(), np.concatenate([values[[1, 3, 4]], np.zeros((1, 2))]))
    np.testing.assert_array_equal(ktpfl_rounds.presence(ids, 5).numpy(), present.numpy())
    back = ktpfl_rounds.rows_by_client(ids, rows, 5).numpy()
    np.testing.assert_array_equal(back, values * present.numpy()[:, None])
    with pytest.raises(tf.errors.InvalidArgumentError, match='more clients in the round than its capacity'):
        ktpfl_rounds.compact(present, tf.constant(values), capacity=2)


def test_gather_steps_append_merge_and_sort_by_index(tff_runtime):
    """The server's rows: any arrival order, split over two partial aggregates or not, gives rows by index."""
    zero, accumulate, merge, report = ktpfl_rounds.gather_steps(tff.TensorType(np.float32, (2,)), capacity=4)
    value = {7: [7.0, 0.5], 2: [2.0, 0.25], 5: [5.0, 1.0]}

    def upload(i):
        return collections.OrderedDict(index=np.int32(i), value=np.float32(value[i]))

    def accumulated(indices):
        a = zero()
        for i in indices:
            a = accumulate(a, upload(i))
        return a

    want_ids = [2, 5, 7, -1]
    want_values = np.array([value[2], value[5], value[7], [0.0, 0.0]], np.float32)
    for rows in (report(accumulated([7, 2, 5])), report(merge(accumulated([5]), accumulated([7, 2])))):
        assert list(rows['ids']) == want_ids
        np.testing.assert_array_equal(rows['values'], want_values)
    empty = report(merge(accumulated([]), accumulated([])))
    assert list(empty['ids']) == [-1] * 4 and not np.asarray(empty['values']).any()
    with pytest.raises(Exception, match='more clients in the round than its capacity'):
        merge(accumulated([7, 2, 5]), accumulated([7, 2]))


def test_a_round_of_capacity_k_equals_the_round_of_capacity_n(spec, tff_runtime):
    """K = 2 rows for a sample of 2 of 4 clients: the same round as with N rows; 3 clients do not fit."""
    model_fn = lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)  # noqa: E731
    homo = ktpfl_homo.KTpFLHomoSettings(
        local_steps=2,
        batch_size=8,
        client_learning_rate=0.3,
        kt_transfer_learning_rate=0.5,
        kt_coefficient_learning_rate=0.05,
    )
    hetero = ktpfl.KTpFLSettings(
        architectures=('logistic',),
        local_steps=2,
        batch_size=8,
        public_examples=PUBLIC,
        kt_coefficient_learning_rate=0.5,
    )
    builders = (
        lambda k: ktpfl_homo.build_ktpfl_homogeneous_process(spec, model_fn, homo, max_clients_per_round=k),
        lambda k: ktpfl.build_ktpfl_process(spec, hetero, max_clients_per_round=k),
    )
    for build in builders:
        outputs = []
        for capacity in (None, 2):
            proc = build(capacity)
            states = [proc.initial_client_state(c) for c in spec.client_ids]
            state = proc.initialize()
            for sample in ([3, 1], [0, 2], [2, 3]):  # the order the clients arrive in does not matter
                state, new_states, metrics = proc.next(state, [states[i] for i in sample])
                for i, new in zip(sample, new_states):
                    states[i] = new
            outputs.append((state, states, metrics))
            if capacity == 2:
                with pytest.raises(Exception, match='more clients in the round than its capacity'):
                    proc.next(state, states[:3])
        (state_n, states_n, metrics_n), (state_k, states_k, metrics_k) = outputs
        np.testing.assert_allclose(state_k['coefficients'], state_n['coefficients'], rtol=0, atol=1e-7)
        assert not np.allclose(state_k['coefficients'], 0.25)
        for a, b in zip(states_k, states_n):
            np.testing.assert_allclose(a['params'], b['params'], rtol=0, atol=1e-6)
        assert metrics_k['num_clients'] == metrics_n['num_clients'] == 2


def test_the_server_holds_k_rows_of_parameters(spec):
    """With K = 2 of N = 4, the homogeneous round's server mixes [2, D] parameters, not [4, D]."""
    model_fn = lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)  # noqa: E731
    proc = ktpfl_homo.build_ktpfl_homogeneous_process(
        spec, model_fn, ktpfl_homo.KTpFLHomoSettings(), max_clients_per_round=2
    )
    num_params = 4 * 3 + 3
    (personalized,) = [t.member for uri, t in audit.clients_to_server_values(proc.next) if uri == 'federated_aggregate']
    assert str(personalized) == f'<index=int32,value=float32[{num_params}]>'
    server_rows = str(proc.device.phases['distill'].type_signature.parameter[0].member)
    assert f'targets=<ids=int32[2],values=float32[2,{num_params}]>' in server_rows
    with pytest.raises(ValueError, match=r'max_clients_per_round must be in \[1, 4\], got 5'):
        ktpfl_homo.build_ktpfl_homogeneous_process(
            spec, model_fn, ktpfl_homo.KTpFLHomoSettings(), max_clients_per_round=5
        )


def test_only_soft_predictions_cross_with_or_without_sampling(spec):
    """The round's type does not depend on the sample: predictions, sizes, presence and metric sums cross."""
    proc = ktpfl.build_ktpfl_process(
        spec, ktpfl.KTpFLSettings(architectures=('logistic', 'mnist_dnn'), public_examples=PUBLIC, public_batch=10)
    )
    moved = audit.clients_to_server_values(proc.next)
    assert {uri for uri, _ in moved} <= {'federated_aggregate', 'federated_sum', 'federated_mean'}
    shapes = sorted(
        tuple(t.shape)
        for _, type_spec in moved
        for t in (
            tff.structure.flatten(type_spec.member)
            if isinstance(type_spec.member, tff.StructType)
            else [type_spec.member]
        )
    )
    # A client's own [P, C] soft predictions and its index (gathered), [N] sizes, [N] presence;
    # scalars: the index, metric sums and the distillation loss. Nothing of size N x P x C leaves a client.
    (gathered,) = [t.member for uri, t in moved if uri == 'federated_aggregate']
    assert str(gathered) == '<index=int32,value=float32[10,3]>'
    assert (10, 3) in shapes and shapes.count((4,)) == 2
    assert all(s in ((10, 3), (4,), ()) for s in shapes), shapes  # no weights (mnist_dnn: thousands)


def test_program_runs_ktpfl_with_client_fraction(tiny_npz, tmp_path, tff_runtime):
    # tff_runtime: result.client_states makes a never-sampled client's initial state by a TFF call
    # after run_experiment's own runtime has closed (training_loop.RunResult); without it the test
    # passed only when an earlier test of its pytest worker had opened the session's runtime.
    for algorithm, settings in (
        ('ktpfl', ktpfl.KTpFLSettings(local_steps=2, architectures=('logistic',), public_examples=40, public_batch=20)),
        ('ktpfl_homo', ktpfl_homo.KTpFLHomoSettings(local_steps=2)),
    ):
        config = run_config.make_config(
            output_dir=str(tmp_path / algorithm),
            algorithm=algorithm,
            dataset=f'npz:{tiny_npz}',
            partition='iid',
            num_clients=4,
            rounds=3,
            client_fraction=0.5,
            model=None if algorithm == 'ktpfl' else 'logistic',
            settings=settings,
        )
        result = experiment.run_experiment(config, log=lambda line: None)
        participations = [int(s['num_participations']) for s in result.client_states.values()]
        assert sum(participations) == 3 * 2  # ceil(0.5 x 4) clients in each of 3 rounds
        assert all(r['num_clients'] == 2 for r in result.rounds)
    with pytest.raises(run_config.ConfigError, match='^--kt_c_update=released needs every client every round'):
        run_config.make_config(
            output_dir='x', algorithm='ktpfl', client_fraction=0.5, settings=ktpfl.KTpFLSettings(kt_c_update='released')
        ).validate()
    run_config.make_config(output_dir='x', algorithm='ktpfl_homo', client_fraction=0.1).validate()


def test_the_process_holds_the_most_clients_a_round_of_the_run_takes():
    def bound(**fields):
        return run_config.make_config(output_dir='x', algorithm='ktpfl_homo', **fields).max_clients_per_round(100)

    assert bound(client_fraction=0.1) == 10 == training_loop.clients_per_round(100, 0.1)
    assert bound(client_fraction=0.25) == 25 and bound(client_fraction=0.001) == 1 and bound() == 100
    # Poisson sampling (DP with a fraction) draws any number of clients.
    assert bound(client_fraction=0.1, dp_noise_multiplier=1.0, dp_clip=1.0) == 100
    sampled = training_loop.sample_clients(np.random.default_rng(0), [str(i) for i in range(100)], 0.1)
    assert len(sampled) == 10
