"""KT-pFL: the coefficient updates against numpy, and what crosses to the server."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl
from tff_pfl import models
from tff_pfl.computations import audit, local_training
from tff_pfl.data import pipeline


def _numpy_mix(c, s):
    w = c / c.sum(axis=1, keepdims=True)
    return np.einsum('nm,mpc->npc', w, s)


def _numpy_paper_objective(c, s, sizes, rho, lam):
    t = _numpy_mix(c, s)
    kl = (t * (np.log(np.maximum(t, 1e-8)) - np.log(np.maximum(s, 1e-8)))).sum(-1).mean(-1)
    return lam * (sizes / sizes.sum() * kl).sum() + rho * ((c - 1 / len(c)) ** 2).sum()


def _numeric_gradient(f, c, eps=1e-6):
    grad = np.zeros_like(c)
    for index in np.ndindex(c.shape):
        plus, minus = c.copy(), c.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = (f(plus) - f(minus)) / (2 * eps)
    return grad


@pytest.fixture
def predictions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 4))
    s = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    c = rng.uniform(0.2, 0.5, size=(3, 3))
    return c, s


def test_mix_normalises_rows(predictions):
    c, s = predictions
    got = ktpfl.mix(tf.constant(c, tf.float32), tf.constant(s, tf.float32)).numpy()
    np.testing.assert_allclose(got, _numpy_mix(c, s), rtol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)  # every target is a distribution


def test_paper_update_is_a_gradient_step_of_eq4(predictions):
    c, s = predictions
    sizes = np.array([10.0, 30.0, 60.0])
    f = lambda m: _numpy_paper_objective(m, s, sizes, 0.7, 1.0)  # noqa: E731
    want = np.maximum(c - 0.1 * _numeric_gradient(f, c), 0.0)
    got = ktpfl.paper_update(
        tf.constant(c, tf.float32),
        tf.constant(s, tf.float32),
        tf.constant(sizes, tf.float32),
        learning_rate=0.1,
        rho=0.7,
        imitation=1.0,
    )
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    np.testing.assert_allclose(
        ktpfl.paper_objective(
            tf.constant(c, tf.float32), tf.constant(s, tf.float32), tf.constant(sizes, tf.float32), 0.7, 1.0
        ).numpy(),
        f(c),
        rtol=1e-5,
    )


def test_released_update(predictions):
    c, s = predictions

    def objective(m):
        t = np.einsum('nm,mpc->npc', m, s)
        return (((s - t) ** 2).mean(axis=(1, 2)) + 0.7 * ((m - 1 / 3) ** 2).mean(axis=1)).sum()

    stepped = c - 0.1 * _numeric_gradient(objective, c)
    want = np.exp(5 * stepped) / np.exp(5 * stepped).sum(axis=1, keepdims=True)
    got = ktpfl.released_update(tf.constant(c, tf.float32), tf.constant(s, tf.float32), learning_rate=0.1)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)


def test_similarity_and_topk_coefficients(predictions):
    _, s = predictions
    flat = s.reshape(3, -1)
    cos = flat @ flat.T / np.outer(np.linalg.norm(flat, axis=1), np.linalg.norm(flat, axis=1))
    got = ktpfl.similarity_coefficients(tf.constant(s, tf.float32)).numpy()
    np.testing.assert_allclose(got, cos, rtol=1e-5)
    top2 = ktpfl.similarity_coefficients(tf.constant(s, tf.float32), top_k=2).numpy()
    for n in range(3):
        kept = np.argsort(-cos[n])[:2]
        assert set(np.nonzero(top2[n])[0]) == set(kept) and n in kept
        np.testing.assert_allclose(top2[n][kept], cos[n][kept], rtol=1e-5)


@pytest.mark.parametrize('c_update', ['fedmd', 'similarity', 'topk', 'released'])
def test_baseline_modes_run(tiny_npz, tmp_path, tff_runtime, c_update):
    prepared = pipeline.prepare(
        str(tmp_path / 'data'),
        dataset=f'npz:{tiny_npz}',
        partition_name='iid',
        num_clients=3,
        seed=0,
        public_examples=40,
    )
    proc = ktpfl.build_ktpfl_process(
        prepared.spec,
        ['logistic'] * 3,
        local_config=local_training.TrainingConfig(1, 16, 0.1),
        public_batch=30,
        distill_batch_size=10,
        c_update=c_update,
        top_k=2,
    )
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in prepared.spec.client_ids]
    state, states, metrics = proc.next(state, states)
    c = np.asarray(state['coefficients'])
    if c_update == 'fedmd':
        np.testing.assert_allclose(c, 1 / 3)
    if c_update == 'topk':
        assert ((c > 0).sum(axis=1) == 2).all()
    if c_update == 'released':
        np.testing.assert_allclose(c.sum(axis=1), 1.0, rtol=1e-5)
    assert np.isfinite(metrics['distill_kl'])


@pytest.fixture(scope='module')
def process(tiny_npz, tmp_path_factory):
    prepared = pipeline.prepare(
        str(tmp_path_factory.mktemp('kt') / 'data'),
        dataset=f'npz:{tiny_npz}',
        partition_name='iid',
        num_clients=3,
        seed=0,
        public_examples=40,
    )
    proc = ktpfl.build_ktpfl_process(
        prepared.spec,
        ['logistic', 'mnist_dnn', 'logistic'],
        local_config=local_training.TrainingConfig(1, 16, 0.1),
        public_batch=30,
        distill_batch_size=10,
    )
    return prepared.spec, proc


def test_only_soft_predictions_reach_the_server(process):
    spec, proc = process
    assert 'params' not in str(proc.next.type_signature.result.state)
    moved = audit.clients_to_server_values(proc.next)
    assert {uri for uri, _ in moved} <= {'federated_sum', 'federated_mean'}
    largest = spec.num_clients * 30 * spec.num_classes  # the slot tensor of soft predictions
    for _, type_spec in moved:
        for tensor in (
            tff.structure.flatten(type_spec.member)
            if isinstance(type_spec.member, tff.StructType)
            else [type_spec.member]
        ):
            assert int(np.prod(tensor.shape)) <= largest, type_spec  # no weights (mnist_dnn has 3.6k+)
    assert proc.communication['soft_prediction_bytes_up_per_client'] == 30 * 4 * 4


def test_rounds_train_distil_and_learn_c(process, tff_runtime):
    spec, proc = process
    state = proc.initialize()
    np.testing.assert_allclose(state['coefficients'], np.full((3, 3), 1 / 3))
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    assert [int(s['architecture']) for s in states] == [0, 1, 0]  # sorted names: logistic, mnist_dnn
    before = [np.asarray(s['params']) for s in states]
    for _ in range(2):
        state, states, metrics = proc.next(state, states)
    assert state['round_num'] == 2 and metrics['num_clients'] == 3 and np.isfinite(metrics['distill_kl'])
    assert not np.allclose(state['coefficients'], 1 / 3)
    assert (np.asarray(state['coefficients']) >= 0).all()
    for b, s in zip(before, states):
        assert not np.allclose(b, s['params'])
    # A logistic client's packed vector is zero beyond its own weights.
    logistic_size = 36 * 4 + 4
    assert not np.asarray(states[0]['params'])[logistic_size:].any()
    results = proc.evaluate(state, states)
    assert all(0.0 <= r['personalized_model']['accuracy'] <= 1.0 for r in results)


def test_bad_arguments(process):
    spec, _ = process
    with pytest.raises(ValueError, match='one architecture per client'):
        ktpfl.build_ktpfl_process(spec, ['logistic'], local_config=local_training.TrainingConfig(1, 16, 0.1))
    with pytest.raises(ValueError, match='c_update'):
        ktpfl.build_ktpfl_process(
            spec, ['logistic'] * 3, local_config=local_training.TrainingConfig(1, 16, 0.1), c_update='mine'
        )


def test_experiment_writes_ktpfl_outputs(tiny_npz, tmp_path):
    from tff_pfl.program import experiment

    out = tmp_path / 'run'
    config = experiment.ExperimentConfig(
        output_dir=str(out),
        algorithm='ktpfl',
        dataset=f'npz:{tiny_npz}',
        partition='iid',
        num_clients=3,
        rounds=2,
        batch_size=16,
        client_learning_rate=0.1,
        architectures=('logistic', 'mnist_dnn'),
        public_examples=40,
        public_batch=20,
        distill_epochs=1,
        distill_batch_size=10,
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    assert (out / 'knowledge_coefficients.png').stat().st_size > 0
    assert len((out / 'knowledge_coefficients.csv').read_text().splitlines()) == 4
    assert [row['architecture_id'] for row in result.clients] == [0, 1, 0]
    with pytest.raises(experiment.ConfigError, match='public_examples'):
        experiment.ExperimentConfig(output_dir='x', algorithm='ktpfl').validate()


def _numpy_homogeneous_objective(c, params, sizes, rho, lam):
    mixed = (c / c.sum(axis=1, keepdims=True)) @ params
    distance = 0.5 * ((mixed - params) ** 2).sum(axis=1)
    return lam * (sizes / sizes.sum() * distance).sum() + rho * ((c - 1 / len(c)) ** 2).sum()


def test_homogeneous_update_is_a_gradient_step_of_eq11():
    rng = np.random.default_rng(1)
    c = rng.uniform(0.2, 0.5, size=(3, 3))
    params = rng.normal(size=(3, 7))
    sizes = np.array([5.0, 10.0, 20.0])
    f = lambda m: _numpy_homogeneous_objective(m, params, sizes, 0.6, 1.0)  # noqa: E731
    want = np.maximum(c - 0.05 * _numeric_gradient(f, c), 0.0)
    got = ktpfl.homogeneous_update(
        tf.constant(c, tf.float32),
        tf.constant(params, tf.float32),
        tf.constant(sizes, tf.float32),
        learning_rate=0.05,
        rho=0.6,
        imitation=1.0,
    )
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)


def test_a_row_of_zeros_keeps_the_clients_own_knowledge():
    c = tf.constant([[0.0, 0.0], [1.0, 3.0]])
    np.testing.assert_allclose(ktpfl.mixing_weights(c).numpy(), [[1.0, 0.0], [0.25, 0.75]])


@pytest.fixture(scope='module')
def equal_clients(tmp_path_factory):
    from tests.conftest import make_linear_problem

    spec = make_linear_problem(tmp_path_factory.mktemp('homo') / 'data', sizes=(30, 30, 30))
    return spec, lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)


def test_homogeneous_with_uniform_c_and_full_transfer_is_fedavg(equal_clients, tff_runtime):
    from processes import fedavg

    spec, model_fn = equal_clients
    config = local_training.TrainingConfig(2, 8, 0.3)
    proc = ktpfl.build_ktpfl_homogeneous_process(
        spec,
        model_fn,
        local_config=config,
        transfer_steps=1,
        transfer_learning_rate=1.0,
        coefficient_learning_rate=0.0,
        seed=5,
    )
    reference = fedavg.build_fedavg_process(spec, model_fn, local_config=config, seed=5)
    state, ref_state = proc.initialize(), reference.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    ref_states = [reference.initial_client_state(c) for c in spec.client_ids]
    for _ in range(3):
        state, states, metrics = proc.next(state, states)
        ref_state, ref_states, _ = reference.next(ref_state, ref_states)
        want = np.concatenate([np.asarray(w).ravel() for w in ref_state['model']])
        for s in states:  # every client adopted u_n = the plain mean = FedAvg's model (equal sizes)
            np.testing.assert_allclose(s['params'], want, atol=1e-5)
        assert metrics['transfer_distance'] == pytest.approx(0.0, abs=1e-8)
    np.testing.assert_allclose(state['coefficients'], 1 / 3)


def test_homogeneous_round_against_numpy(equal_clients, tff_runtime):
    spec, model_fn = equal_clients
    proc = ktpfl.build_ktpfl_homogeneous_process(
        spec,
        model_fn,
        local_config=local_training.TrainingConfig(1, 8, 0.3),
        transfer_steps=1,
        transfer_learning_rate=0.5,
        coefficient_learning_rate=0.05,
        rho=0.6,
    )
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    state, states, _ = proc.next(state, states)
    after = np.stack([np.asarray(s['params'], np.float64) for s in states])
    # Round 1 mixes with c_0 = 1/N: w' = w - 0.5 (w - mean w), so mean w' = mean w and w = 2 w' - mean w.
    uploaded = 2 * after - after.mean(axis=0)
    sizes = np.array([30.0, 30.0, 30.0])
    f = lambda m: _numpy_homogeneous_objective(m, uploaded, sizes, 0.6, 1.0)  # noqa: E731
    c0 = np.full((3, 3), 1 / 3)
    want = np.maximum(c0 - 0.05 * _numeric_gradient(f, c0), 0.0)
    np.testing.assert_allclose(state['coefficients'], want, atol=1e-4)
    assert not np.allclose(want, c0)
    assert all(0 <= r['personalized_model']['accuracy'] <= 1 for r in proc.evaluate(state, states))
    moved = audit.clients_to_server_values(proc.next)
    assert any('float32[3,' in str(t) for _, t in moved)  # Appendix C exchanges parameters, by design
