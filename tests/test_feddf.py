"""FedDF / pFedDF: per-architecture averaging, server distillation, what crosses."""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf

from processes import fedavg, feddf, ktpfl_homo
from tff_pfl import models, settings
from tff_pfl.computations import audit, distillation
from tff_pfl.data import pipeline

LOCAL = dict(local_epochs=1, batch_size=16, client_learning_rate=0.1)


def _small(cls=feddf.FedDFSettings, **overrides):
    """FedDF / pFedDF settings for the tiny image data (40 public examples)."""
    values = dict(LOCAL, public_examples=40, public_batch=20)
    values.update(overrides)
    return cls(**values)


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
    proc = feddf.build_feddf_process(spec, _small(architectures=('logistic',), feddf_distill_epochs=0), seed=3)
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    reference = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**LOCAL), seed=3)
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
        _small(
            feddf.PFedDFSettings,
            architectures=('logistic', 'mnist_dnn'),
            feddf_distill_epochs=2,
            public_distill_batch_size=10,
            pfeddf_finetune_epochs=2,
        ),
    )


def test_heterogeneous_round_distils_and_pfeddf_finetunes(spec, heterogeneous, tff_runtime):
    proc = heterogeneous
    assert proc.extras['architectures'] == ('logistic', 'mnist_dnn', 'logistic')
    plain = feddf.build_feddf_process(spec, _small(architectures=('logistic', 'mnist_dnn'), feddf_distill_epochs=0))
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


@pytest.mark.parametrize(
    'cls, values, message',
    [
        (feddf.FedDFSettings, dict(feddf_distill_epochs=-1), 'feddf_distill_epochs must be >= 0'),
        (feddf.FedDFSettings, dict(public_batch=0), 'public_batch must be >= 1'),
        (feddf.FedDFSettings, dict(public_examples=10, public_batch=20), r'public_batch \(20\) must be <='),
        (feddf.FedDFSettings, dict(architectures=('lenet', 'nope')), "unknown model 'nope'"),
        (feddf.FedDFSettings, dict(local_steps=-2), 'local_steps must be >= 0'),
        (feddf.PFedDFSettings, dict(pfeddf_finetune_epochs=0), 'pfeddf_finetune_epochs must be >= 1'),
        (feddf.PFedDFSettings, dict(client_learning_rate=0.0), 'client_learning_rate must be > 0'),
    ],
)
def test_bad_settings(cls, values, message):
    with pytest.raises(settings.SettingsError, match=message) as raised:
        cls(**values).validate()
    assert '\n' not in str(raised.value)


def test_defaults_are_ktpfls_for_all_methods():
    df, pdf = feddf.FedDFSettings(), feddf.PFedDFSettings()
    # KT-pFL, Appendix B.2: "for all the methods" (heterogeneous, EMNIST / Fashion-MNIST).
    assert (df.batch_size, df.local_epochs, df.client_learning_rate) == (128, 20, 0.01)
    assert (df.feddf_distill_epochs, df.public_distill_batch_size, df.public_distill_learning_rate) == (1, 256, 0.01)
    assert (df.public_temperature, df.public_examples, df.public_batch, df.architectures) == (10.0, 3000, None, ())
    assert pdf.pfeddf_finetune_epochs == 5 and not hasattr(df, 'pfeddf_finetune_epochs')


def test_bad_arguments(spec):
    with pytest.raises(settings.SettingsError, match='pfeddf_finetune_epochs'):
        feddf.build_feddf_process(spec, _small(feddf.PFedDFSettings, pfeddf_finetune_epochs=-1))
    with pytest.raises(TypeError, match='FedDFSettings'):
        feddf.build_feddf_process(spec, settings.LocalTraining())
    with pytest.raises(ValueError, match=r'^architectures: resnet_small cannot take') as e:
        feddf.build_feddf_process(_vector_spec(spec), _small(architectures=('resnet_small',)))
    assert '(36,)' in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(ValueError, match=r"^public_batch=30 exceeds the partition's 20 public examples$"):
        feddf.build_feddf_process(_public_size(spec, 20), _small(public_batch=30))


def _vector_spec(spec):
    return dataclasses.replace(spec, feature_shape=(36,))


def _public_size(spec, size):
    return dataclasses.replace(spec, public_size=size)


@pytest.fixture(scope='module')
def vector_problem(tmp_path_factory):
    from tests.conftest import make_linear_problem

    return make_linear_problem(tmp_path_factory.mktemp('feddf_steps') / 'data', public_examples=20)


@pytest.mark.parametrize('cls', [feddf.FedDFSettings, feddf.PFedDFSettings])
def test_local_steps_are_exact(vector_problem, tff_runtime, cls):
    spec = vector_problem
    proc = feddf.build_feddf_process(
        spec, cls(local_steps=3, batch_size=4, public_examples=20, public_batch=15, public_distill_batch_size=10)
    )
    # No --architectures on 4-dim vectors: the vector models, in turn.
    assert proc.extras['architectures'] == ('logistic', 'mnist_dnn', 'logistic')
    assert proc.extras['communication']['logit_bytes_up_per_client'] == 15 * 3 * 4
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    for _ in range(2):
        state, states, metrics = proc.next(state, states)
        # Clients of 37, 50 and 23 examples: an epoch would be 10, 13 and 6 steps of 4.
        assert metrics['mean_local_steps'] == 3.0
        assert metrics['num_examples'] == 3 * 3 * 4
    reported = set(proc.evaluate(state, states)[0])
    assert reported == ({'global_model', 'personalized_model'} if cls is feddf.PFedDFSettings else {'global_model'})


@pytest.mark.parametrize('algorithm', ['pfeddf', 'ktpfl_homo'])
def test_experiment_runs(tiny_npz, tmp_path, algorithm):
    from tff_pfl.program import experiment, run_config

    out = tmp_path / 'run'
    if algorithm == 'pfeddf':
        algorithm_settings = feddf.PFedDFSettings(
            architectures=('logistic', 'mnist_dnn'),
            public_examples=40,
            public_batch=20,
            feddf_distill_epochs=1,
            public_distill_batch_size=10,
            pfeddf_finetune_epochs=1,
            **LOCAL,
        )
    else:
        algorithm_settings = ktpfl_homo.KTpFLHomoSettings(kt_transfer_steps=1, **LOCAL)
    config = run_config.make_config(
        output_dir=str(out),
        algorithm=algorithm,
        dataset=f'npz:{tiny_npz}',
        partition='kt_case2',
        num_clients=4,
        examples_per_class=20,
        rounds=2,
        settings=algorithm_settings,
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
