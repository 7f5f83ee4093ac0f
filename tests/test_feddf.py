"""FedDF / pFedDF: per-architecture averaging, server distillation, what crosses."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from processes import fedavg, feddf
from tff_pfl import models
from tff_pfl.computations import audit, distillation, local_training
from tff_pfl.data import pipeline

CONFIG = local_training.TrainingConfig(1, 16, 0.1)


@pytest.fixture(scope='module')
def spec(tiny_npz, tmp_path_factory):
    return pipeline.prepare(
        str(tmp_path_factory.mktemp('feddf') / 'data'),
        dataset=f'npz:{tiny_npz}',
        partition_name='iid',
        num_clients=3,
        seed=0,
        public_examples=40,
    ).spec


def test_average_prototypes():
    previous = tf.constant([[1.0, 1.0], [5.0, 5.0]])
    sums = tf.constant([[2.0 * 3 + 4.0 * 1, 6.0], [0.0, 0.0]])
    weights = tf.constant([4.0, 0.0])
    got = feddf.average_prototypes(previous, sums, weights).numpy()
    np.testing.assert_allclose(got, [[2.5, 1.5], [5.0, 5.0]])  # architecture 1 had no clients: kept


def test_distill_towards_fits_targets_and_keeps_a_model_equal_to_them():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(64, 5)), tf.float32)
    with models.seeded(0):
        student = models.get('logistic')((5,), 3)
    own = tf.nn.softmax(student(x) / 2.0).numpy()
    before = [w.numpy() for w in student.trainable_weights]
    seed = tf.constant([0, 1], tf.int64)
    kl = distillation.distill_towards(
        student, x, tf.constant(own), temperature=2.0, epochs=2, batch_size=16, learning_rate=0.5, seed=seed
    )
    assert abs(float(kl)) < 1e-5  # already at its targets: zero loss, zero gradient
    for b, w in zip(before, student.trainable_weights):
        np.testing.assert_allclose(w.numpy(), b, atol=1e-6)
    with models.seeded(1):
        teacher = models.get('logistic')((5,), 3)
    targets = tf.nn.softmax(3.0 * teacher(x))  # reachable by the student
    first = distillation.distill_towards(
        student, x, targets, temperature=1.0, epochs=1, batch_size=16, learning_rate=0.5, seed=seed
    )
    last = distillation.distill_towards(
        student, x, targets, temperature=1.0, epochs=30, batch_size=16, learning_rate=0.5, seed=seed
    )
    assert float(last) < 0.3 * float(first)


def _packed(weights):
    return np.concatenate([np.asarray(w).ravel() for w in weights])


def test_without_distillation_one_architecture_is_fedavg(spec, tff_runtime):
    proc = feddf.build_feddf_process(
        spec, ['logistic'] * 3, local_config=CONFIG, server_distill_epochs=0, public_batch=20, seed=3
    )
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    reference = fedavg.build_fedavg_process(spec, model_fn, local_config=CONFIG, seed=3)
    state, ref_state = proc.initialize(), reference.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    ref_states = [reference.initial_client_state(c) for c in spec.client_ids]
    np.testing.assert_allclose(state['prototypes'][0], _packed(ref_state['model']), atol=1e-7)
    for _ in range(2):
        state, states, metrics = proc.next(state, states)
        ref_state, ref_states, ref_metrics = reference.next(ref_state, ref_states)
        np.testing.assert_allclose(state['prototypes'][0], _packed(ref_state['model']), atol=1e-5)
        assert metrics['train_loss'] == pytest.approx(ref_metrics['train_loss'], abs=1e-5)
    got = proc.evaluate(state, states)
    want = reference.evaluate(ref_state, ref_states)
    for g, w in zip(got, want):
        assert g['global_model']['accuracy'] == pytest.approx(w['global_model']['accuracy'])


@pytest.fixture(scope='module')
def heterogeneous(spec):
    return feddf.build_feddf_process(
        spec,
        ['logistic', 'mnist_dnn', 'logistic'],
        local_config=CONFIG,
        server_distill_epochs=2,
        distill_batch_size=10,
        public_batch=20,
        finetune_epochs=2,
    )


def test_heterogeneous_round_distils_and_pfeddf_finetunes(spec, heterogeneous, tff_runtime):
    proc = heterogeneous
    plain = feddf.build_feddf_process(
        spec, ['logistic', 'mnist_dnn', 'logistic'], local_config=CONFIG, server_distill_epochs=0, public_batch=20
    )
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    assert [int(s['architecture']) for s in states] == [0, 1, 0]
    distilled, states_out, metrics = proc.next(state, states)
    averaged, _, plain_metrics = plain.next(state, states)
    assert metrics['server_distill_kl'] > 0 and plain_metrics['server_distill_kl'] == 0
    # Same local training, so the difference is the server's distillation.
    assert metrics['train_loss'] == pytest.approx(plain_metrics['train_loss'])
    assert not np.allclose(distilled['prototypes'], averaged['prototypes'])
    first = proc.evaluate(distilled, states_out)
    again = proc.evaluate(distilled, states_out)
    for a, b in zip(first, again):  # the fine-tuned copy is not kept; evaluation is repeatable
        assert set(a) == {'global_model', 'personalized_model'}
        assert a['personalized_model']['accuracy'] == b['personalized_model']['accuracy']
    assert any(a['personalized_model']['loss'] != a['global_model']['loss'] for a in first)


def test_what_crosses_to_the_server(spec, heterogeneous):
    moved = dict((str(t), uri) for uri, t in audit.clients_to_server_values(heterogeneous.next))
    assert set(moved.values()) <= {'federated_sum', 'federated_mean'}
    # Parameters (per-architecture slots), their weights, the public logits, metric sums.
    joined = ' '.join(moved)
    assert 'float32[2,' in joined and 'float32[20,4]' in joined
    assert 'client_id' not in str(heterogeneous.next.type_signature.result.state)


def test_bad_arguments(spec):
    with pytest.raises(ValueError, match='one architecture per client'):
        feddf.build_feddf_process(spec, ['logistic'], local_config=CONFIG)
    with pytest.raises(ValueError, match='>= 0'):
        feddf.build_feddf_process(spec, ['logistic'] * 3, local_config=CONFIG, finetune_epochs=-1)


@pytest.mark.parametrize('algorithm', ['pfeddf', 'ktpfl_homo'])
def test_experiment_runs(tiny_npz, tmp_path, algorithm):
    from tff_pfl.program import experiment

    out = tmp_path / 'run'
    config = experiment.ExperimentConfig(
        output_dir=str(out),
        algorithm=algorithm,
        dataset=f'npz:{tiny_npz}',
        partition='kt_case2',
        num_clients=4,
        examples_per_class=20,
        rounds=2,
        batch_size=16,
        client_learning_rate=0.1,
        architectures=('logistic', 'mnist_dnn'),
        public_examples=40,
        public_batch=20,
        distill_epochs=1,
        distill_batch_size=10,
        finetune_epochs=1,
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    assert (out / 'communication.csv').exists()
    models_reported = set(result.summary)
    if algorithm == 'pfeddf':
        assert models_reported == {'global_model', 'personalized_model'}
        assert [row['architecture_id'] for row in result.clients] == [0, 1, 0, 1]
    else:
        assert models_reported == {'personalized_model'}
        assert (out / 'knowledge_coefficients.png').exists()
    histogram = np.loadtxt(out / 'partition.csv', delimiter=',', skiprows=1, usecols=range(4, 8))
    for row in histogram:  # kt_case2: two classes per client, examples_per_class of each
        assert sorted(row[row > 0].tolist()) == [20, 20]
