"""KT-pFL: the coefficient updates against numpy, and what crosses to the server."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl, ktpfl_coefficients, ktpfl_homo
from tests import numpy_reference
from tests.conftest import make_linear_problem
from tff_pfl import models, settings
from tff_pfl.computations import audit
from tff_pfl.data import pipeline


def _small(**overrides):
    """KT-pFL settings for the tiny image data (40 public examples), the old API defaults for c."""
    values = dict(
        local_epochs=1,
        batch_size=16,
        client_learning_rate=0.1,
        public_examples=40,
        public_batch=30,
        public_distill_batch_size=10,
        kt_coefficient_learning_rate=0.1,
        kt_rho=0.7,
    )
    values.update(overrides)
    return ktpfl.KTpFLSettings(**values)


def _numpy_mix(c, s):
    w = c / c.sum(axis=1, keepdims=True)
    return np.einsum('nm,mpc->npc', w, s)


def _numpy_paper_objective(c, s, sizes, rho, lam):
    t = _numpy_mix(c, s)
    kl = (t * (np.log(np.maximum(t, 1e-8)) - np.log(np.maximum(s, 1e-8)))).sum(-1).mean(-1)
    return lam * (sizes / sizes.sum() * kl).sum() + rho * ((c - 1 / len(c)) ** 2).sum()


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
    want = np.maximum(c - 0.1 * numpy_reference.numeric_gradient(f, c), 0.0)
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

    stepped = c - 0.1 * numpy_reference.numeric_gradient(objective, c)
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
        prepared.spec, _small(architectures=('logistic',), kt_c_update=c_update, kt_top_k=2)
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
    proc = ktpfl.build_ktpfl_process(prepared.spec, _small(architectures=('logistic', 'mnist_dnn')))
    return prepared.spec, proc


def test_only_soft_predictions_reach_the_server(process):
    spec, proc = process
    assert 'params' not in str(proc.next.type_signature.result.state)
    moved = audit.clients_to_server_values(proc.next)
    assert {uri for uri, _ in moved} <= {'federated_aggregate', 'federated_sum', 'federated_mean'}
    # Each client's own [P, C] soft predictions with its index, gathered into rows at the server.
    (gathered,) = [t.member for uri, t in moved if uri == 'federated_aggregate']
    assert str(gathered) == '<index=int32,value=float32[30,4]>'
    largest = 30 * spec.num_classes  # one client's soft predictions
    for _, type_spec in moved:
        for tensor in (
            tff.structure.flatten(type_spec.member)
            if isinstance(type_spec.member, tff.StructType)
            else [type_spec.member]
        ):
            assert int(np.prod(tensor.shape)) <= largest, type_spec  # no weights (mnist_dnn has 3.6k+)
    assert proc.extras['communication']['soft_prediction_bytes_up_per_client'] == 30 * 4 * 4
    assert proc.extras['architectures'] == ('logistic', 'mnist_dnn', 'logistic')  # assigned in turn, declared


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


@pytest.mark.parametrize(
    'values, message',
    [
        (dict(kt_c_update='mine'), 'kt_c_update must be one of'),
        (dict(kt_top_k=0), 'kt_top_k must be >= 1'),
        (dict(kt_distill_epochs=-1), 'kt_distill_epochs must be >= 0'),
        (dict(kt_coefficient_learning_rate=-0.1), 'kt_coefficient_learning_rate must be >= 0'),
        (dict(kt_rho=-1.0), 'kt_rho must be >= 0'),
        (dict(kt_imitation=0.0), 'kt_imitation must be > 0'),
        (dict(public_examples=0, public_batch=1), 'public_examples must be >= 1'),
        (dict(public_batch=4000), r'public_batch \(4000\) must be <= public_examples \(3000\)'),
        (dict(public_temperature=0.0), 'public_temperature must be > 0'),
        (dict(public_distill_batch_size=0), 'public_distill_batch_size must be >= 1'),
        (dict(public_distill_learning_rate=0.0), 'public_distill_learning_rate must be > 0'),
        (dict(architectures=('resnet999',)), "architectures: unknown model 'resnet999'"),
        (dict(local_steps=-1), 'local_steps must be >= 0'),
        (dict(batch_size=0), 'batch_size must be >= 1'),
        (dict(kt_top_k=2.5), 'kt_top_k must be an integer'),
        (dict(kt_distill_schedule='sometimes'), 'kt_distill_schedule must be one of after_training, every_epoch'),
        (
            dict(kt_distill_schedule='every_epoch', local_steps=3),
            '^kt_distill_schedule=every_epoch distils after each local epoch: give local_epochs, not local_steps$',
        ),
    ],
)
def test_bad_settings(values, message):
    with pytest.raises(settings.SettingsError, match=message) as raised:
        ktpfl.KTpFLSettings(**values).validate()
    assert '\n' not in str(raised.value)


@pytest.mark.parametrize(
    'values, message',
    [
        (dict(kt_transfer_steps=-1), 'kt_transfer_steps must be >= 0'),
        (dict(kt_transfer_learning_rate=-1.0), 'kt_transfer_learning_rate must be >= 0'),
        (dict(kt_coefficient_learning_rate=-1.0), 'kt_coefficient_learning_rate must be >= 0'),
        (dict(kt_imitation=-1.0), 'kt_imitation must be > 0'),
        (dict(local_epochs=0), 'local_epochs must be >= 1'),
        (dict(kt_distill_schedule='literal'), 'kt_distill_schedule must be one of after_training, every_epoch'),
        (dict(kt_distill_schedule='every_epoch', local_steps=2), 'kt_distill_schedule=every_epoch distils after each'),
    ],
)
def test_bad_homogeneous_settings(values, message):
    with pytest.raises(settings.SettingsError, match=message) as raised:
        ktpfl_homo.KTpFLHomoSettings(**values).validate()
    assert '\n' not in str(raised.value)


def test_paper_defaults():
    kt = ktpfl.KTpFLSettings()
    # Appendix B.2, heterogeneous, EMNIST / Fashion-MNIST; footnote 4.
    assert (kt.batch_size, kt.local_epochs, kt.kt_distill_epochs, kt.public_distill_batch_size) == (128, 20, 1, 256)
    assert (kt.client_learning_rate, kt.public_distill_learning_rate, kt.kt_coefficient_learning_rate) == (0.01,) * 3
    assert (kt.kt_rho, kt.public_temperature, kt.kt_imitation, kt.kt_top_k) == (0.6, 10.0, 1.0, 5)
    assert (kt.public_examples, kt.public_batch, kt.architectures) == (3000, None, ())  # P: all 3000 each round
    homo = ktpfl_homo.KTpFLHomoSettings()
    assert (homo.batch_size, homo.local_epochs, homo.kt_transfer_steps) == (32, 20, 1)
    assert (homo.client_learning_rate, homo.kt_transfer_learning_rate) == (0.01, 0.01)
    assert homo.kt_coefficient_learning_rate == 0.005
    # The sequential reading of Algorithms 1 and 2 (docs/algorithms/ktpfl.md, "Distillation schedule").
    assert kt.kt_distill_schedule == homo.kt_distill_schedule == 'after_training'


def test_bad_arguments(process):
    spec, _ = process
    with pytest.raises(settings.SettingsError, match='kt_c_update'):
        ktpfl.build_ktpfl_process(spec, _small(kt_c_update='mine'))
    with pytest.raises(TypeError, match='KTpFLSettings'):
        ktpfl.build_ktpfl_process(spec, ktpfl_homo.KTpFLHomoSettings())
    # The tiny images are 6x6x1: LeNet's two conv + pool stages need 16x16.
    with pytest.raises(ValueError, match=r'^architectures: lenet cannot take features of shape \(6, 6, 1\)') as e:
        ktpfl.build_ktpfl_process(spec, _small(architectures=('logistic', 'lenet')))
    assert '\n' not in str(e.value)
    with pytest.raises(ValueError, match=r"^public_batch=50 exceeds the partition's 40 public examples$"):
        ktpfl.build_ktpfl_process(spec, _small(public_examples=50, public_batch=50))


@pytest.fixture(scope='module')
def vector_problem(tmp_path_factory):
    return make_linear_problem(tmp_path_factory.mktemp('kt_steps') / 'data', public_examples=20)


@pytest.mark.parametrize('c_update', ['paper', 'fedmd'])
def test_local_steps_are_exact(vector_problem, tff_runtime, c_update):
    spec = vector_problem
    proc = ktpfl.build_ktpfl_process(
        spec,
        ktpfl.KTpFLSettings(
            local_steps=3, batch_size=4, public_examples=20, public_distill_batch_size=10, kt_c_update=c_update
        ),
    )
    # No --architectures on 4-dim vectors: the vector models, in turn.
    assert proc.extras['architectures'] == ('logistic', 'mnist_dnn', 'logistic')
    # No --public_batch: every public example, every round (20 examples x 3 classes x 4 bytes).
    assert proc.extras['communication']['soft_prediction_bytes_up_per_client'] == 20 * 3 * 4
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    for _ in range(2):
        state, states, metrics = proc.next(state, states)
        # Clients of 37, 50 and 23 examples: an epoch would be 10, 13 and 6 steps of 4.
        assert metrics['mean_local_steps'] == 3.0
        assert metrics['num_examples'] == 3 * 3 * 4


def test_experiment_writes_ktpfl_outputs(tiny_npz, tmp_path):
    from tff_pfl.program import experiment, run_config

    out = tmp_path / 'run'
    config = run_config.make_config(
        output_dir=str(out),
        algorithm='ktpfl',
        dataset=f'npz:{tiny_npz}',
        partition='iid',
        num_clients=3,
        rounds=2,
        settings=ktpfl.KTpFLSettings(
            local_epochs=1,
            batch_size=16,
            client_learning_rate=0.1,
            architectures=('logistic', 'mnist_dnn'),
            public_examples=40,
            public_batch=20,
            public_distill_batch_size=10,
        ),
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    assert (out / 'knowledge_coefficients.png').stat().st_size > 0
    assert len((out / 'knowledge_coefficients.csv').read_text().splitlines()) == 4
    assert [row['architecture_id'] for row in result.clients] == [0, 1, 0]
    with pytest.raises(run_config.ConfigError, match='public_examples'):
        run_config.make_config(
            output_dir='x', algorithm='ktpfl', settings=ktpfl.KTpFLSettings(public_examples=0)
        ).validate()
    run_config.make_config(output_dir='x', algorithm='ktpfl').validate()  # the defaults need no flag


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
    want = np.maximum(c - 0.05 * numpy_reference.numeric_gradient(f, c), 0.0)
    got = ktpfl_homo.homogeneous_update(
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
    np.testing.assert_allclose(ktpfl_coefficients.mixing_weights(c).numpy(), [[1.0, 0.0], [0.25, 0.75]])


@pytest.fixture(scope='module')
def equal_clients(tmp_path_factory):

    spec = make_linear_problem(tmp_path_factory.mktemp('homo') / 'data', sizes=(30, 30, 30))
    return spec, lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)


def test_homogeneous_with_uniform_c_and_full_transfer_is_fedavg(equal_clients, tff_runtime):
    from processes import fedavg

    spec, model_fn = equal_clients
    local = dict(local_epochs=2, batch_size=8, client_learning_rate=0.3)
    proc = ktpfl_homo.build_ktpfl_homogeneous_process(
        spec,
        model_fn,
        ktpfl_homo.KTpFLHomoSettings(
            kt_transfer_steps=1, kt_transfer_learning_rate=1.0, kt_coefficient_learning_rate=0.0, **local
        ),
        seed=5,
    )
    reference = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**local), seed=5)
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
    proc = ktpfl_homo.build_ktpfl_homogeneous_process(
        spec,
        model_fn,
        ktpfl_homo.KTpFLHomoSettings(
            local_epochs=1,
            batch_size=8,
            client_learning_rate=0.3,
            kt_transfer_steps=1,
            kt_transfer_learning_rate=0.5,
            kt_coefficient_learning_rate=0.05,
            kt_rho=0.6,
        ),
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
    want = np.maximum(c0 - 0.05 * numpy_reference.numeric_gradient(f, c0), 0.0)
    np.testing.assert_allclose(state['coefficients'], want, atol=1e-4)
    assert not np.allclose(want, c0)
    assert all(0 <= r['personalized_model']['accuracy'] <= 1 for r in proc.evaluate(state, states))
    moved = audit.clients_to_server_values(proc.next)
    # Appendix C exchanges parameters, by design: each client's whole [D] vector with its index.
    num_params = after.shape[1]
    assert ('federated_aggregate', f'{{<index=int32,value=float32[{num_params}]>}}@CLIENTS') in [
        (uri, str(t)) for uri, t in moved
    ]


def test_homogeneous_local_steps_are_exact(tmp_path, tff_runtime):

    spec = make_linear_problem(tmp_path / 'data')  # clients of 37, 50 and 23 examples
    model_fn = lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)  # noqa: E731
    proc = ktpfl_homo.build_ktpfl_homogeneous_process(
        spec, model_fn, ktpfl_homo.KTpFLHomoSettings(local_steps=3, batch_size=4)
    )
    assert (
        'architectures' not in proc.extras
        and proc.extras['communication']['parameter_bytes_up_per_client'] == (4 * 3 + 3) * 4
    )
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    for _ in range(2):
        state, states, metrics = proc.next(state, states)
        assert metrics['mean_local_steps'] == 3.0
        assert metrics['num_examples'] == 3 * 3 * 4
    with pytest.raises(TypeError, match='KTpFLHomoSettings'):
        ktpfl_homo.build_ktpfl_homogeneous_process(spec, model_fn, ktpfl.KTpFLSettings())
