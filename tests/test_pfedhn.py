"""pFedHN: the hypernetwork's step (a vector-Jacobian product) against numpy's closed form, a whole round against
numpy, the generated models of every model the project has, both output layouts, what crosses to the server, and
the settings."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import pfedhn, pfedhn_network
from tests import numpy_reference as ref
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit

SEED = 3
# Local training of the round tests: 3 steps of batch 8 at learning rate 0.2.
LOCAL = dict(pfedhn_local_steps=3, batch_size=8, client_learning_rate=0.2)


# An independent numpy hypernetwork with one hidden layer (dense layout): forward and the closed-form VJP.


def _numpy_generate(phi, indices):
    v = phi['embeddings'][indices]
    w1, b1 = phi['mlp']
    pre = v @ w1 + b1
    a = np.maximum(pre, 0.0)
    norm = np.linalg.norm(a, axis=1, keepdims=True)
    f = a / norm  # unit-norm features
    heads = phi['heads']
    theta = np.concatenate([f @ h + c for h, c in zip(heads[::2], heads[1::2])], axis=1)
    return theta, (v, pre, f, norm)


def _numpy_gradient(phi, ids, deltas):
    """d/dphi of sum_k w_k <theta_k(phi), -delta_k>, w_k = 1 / (real rows), by the chain rule written out."""
    real = ids >= 0
    g = -deltas * (real / max(real.sum(), 1))[:, None]  # the output gradient of each row
    indices = np.maximum(ids, 0)
    _, (v, pre, f, norm) = _numpy_generate(phi, indices)
    heads = phi['heads']
    grads_heads, df, offset = [], np.zeros_like(f), 0
    for h, _ in zip(heads[::2], heads[1::2]):
        size = h.shape[1]
        part = g[:, offset : offset + size]
        grads_heads += [f.T @ part, part.sum(axis=0)]  # dtheta/dH_t = f, dtheta/dc_t = 1
        df += part @ h.T
        offset += size
    da = (df - f * np.sum(f * df, axis=1, keepdims=True)) / norm  # through a / ||a||
    dpre = da * (pre > 0)
    w1, _ = phi['mlp']
    dv = dpre @ w1.T
    d_embeddings = np.zeros_like(phi['embeddings'])
    np.add.at(d_embeddings, indices, dv)
    return {'embeddings': d_embeddings, 'mlp': [v.T @ dpre, dpre.sum(axis=0)], 'heads': grads_heads}


def _as_numpy(phi):
    return tf.nest.map_structure(lambda t: np.asarray(t, np.float64), phi)


SHAPES = [(4, 3), (3,), (3, 2), (2,)]  # a tiny two-layer target of 23 parameters


@pytest.fixture
def tiny():
    hyper = pfedhn_network.HyperNetwork(SHAPES, 5, embedding_dim=3, hidden_units=6, hidden_layers=1, seed=1)
    phi = hyper.initial()
    # Heads and biases away from their initial zeros, so that every term of the chain rule counts.
    rng = np.random.default_rng(0)
    phi = tf.nest.map_structure(lambda t: t + tf.constant(rng.normal(size=t.shape) * 0.3, tf.float32), phi)
    return hyper, phi


def test_generation_against_numpy(tiny):
    hyper, phi = tiny
    indices = np.array([4, 0, 2])
    want, _ = _numpy_generate(_as_numpy(phi), indices)
    np.testing.assert_allclose(hyper.generate(phi, tf.constant(indices, tf.int32)).numpy(), want, rtol=1e-5, atol=1e-6)


def test_the_step_is_the_vjp_in_closed_form(tiny):
    """(grad_phi theta)^T (-delta), averaged over the real rows; an empty row (-1) adds nothing, and the embeddings
    of clients outside the round get no gradient."""
    hyper, phi = tiny
    ids = np.array([1, 3, -1], np.int32)
    deltas = np.random.default_rng(2).normal(size=(3, hyper.num_params)).astype(np.float32)
    got = hyper.gradient(phi, tf.constant(ids), tf.constant(deltas))
    want = _numpy_gradient(_as_numpy(phi), ids, deltas.astype(np.float64))
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got['embeddings'].numpy()[[0, 2, 4]], 0.0)


def test_a_linear_hypernetworks_step_moves_each_model_by_its_delta():
    """A head on one fixed unit feature (theta = f H + c, ||f|| = 1) is linear in phi: one SGD step of rate alpha
    along the VJP moves theta by alpha (||f||^2 + 1) delta for one client: the closed form of J J^T."""
    hyper = pfedhn_network.HyperNetwork(SHAPES, 2, embedding_dim=2, hidden_units=4, hidden_layers=1, seed=0)
    phi = hyper.initial()
    delta = np.random.default_rng(3).normal(size=(1, hyper.num_params)).astype(np.float32)
    grads = hyper.gradient(phi, tf.constant([0]), tf.constant(delta))
    f = hyper._features(phi['mlp'], tf.gather(phi['embeddings'], [0])).numpy()
    alpha = 0.1
    heads = [h - alpha * g for h, g in zip(phi['heads'], grads['heads'])]  # the heads' step alone
    moved = hyper.generate(dict(phi, heads=heads), tf.constant([0])) - hyper.generate(phi, tf.constant([0]))
    np.testing.assert_allclose(moved.numpy(), alpha * (np.sum(f**2) + 1) * delta, rtol=1e-4, atol=1e-6)


def test_the_chunked_step_is_the_gradient_of_the_squared_distance_to_the_trained_models():
    """Independently of the VJP form: (grad theta)^T (theta - theta_tilde) is the gradient of
    1/2 ||theta(phi) - theta_tilde||^2 (theta_tilde held fixed), here by a GradientTape of that loss."""
    hyper = pfedhn_network.HyperNetwork(
        SHAPES, 4, embedding_dim=2, hidden_units=5, hidden_layers=2, layout='chunked', chunk_size=7, seed=2
    )
    phi = hyper.initial()
    ids = tf.constant([2, 0])
    deltas = tf.constant(np.random.default_rng(4).normal(size=(2, hyper.num_params)), tf.float32)
    trained = hyper.generate(phi, ids) + deltas
    leaves = tf.nest.flatten(phi)
    with tf.GradientTape() as tape:
        tape.watch(leaves)
        loss = 0.5 * tf.reduce_sum(tf.square(hyper.generate(phi, ids) - trained)) / 2.0
    want = tape.gradient(loss, phi)
    got = hyper.gradient(phi, ids, deltas)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), tf.convert_to_tensor(w).numpy(), rtol=1e-4, atol=1e-6)


def _input_shape(name):
    return {'char_gru': (12,), 'gaussian_mean': (1,), 'logistic': (784,), 'mnist_dnn': (784,)}.get(name, (32, 32, 3))


@pytest.mark.parametrize('name', models.names())
def test_generated_weights_have_every_models_shapes_in_both_layouts(name):
    """For every model of the project: the chunked layout (and the dense one, where it fits) writes exactly its
    parameters, which unpack into its weight tensors; the kernels come out at their Glorot scale."""
    with tf.Graph().as_default():
        shapes = [tuple(v.shape) for v in models.get(name)(_input_shape(name), 10).trainable_weights]
    settings = pfedhn.PFedHNSettings(pfedhn_chunk_size=50_000)
    layouts = ['chunked'] + (['dense'] if settings.layout(shapes) == 'dense' else [])
    for layout in layouts:
        hyper = pfedhn_network.HyperNetwork(shapes, 6, embedding_dim=2, layout=layout, chunk_size=50_000, seed=0)
        theta = hyper.generate(hyper.initial(), tf.constant([0, 5])).numpy()
        assert theta.shape == (2, sum(int(np.prod(s)) for s in shapes)), layout
        offset = 0
        for shape in shapes:
            size = int(np.prod(shape))
            part = theta[:, offset : offset + size].reshape(2, *shape)
            offset += size
            std = pfedhn_network.glorot_std(shape)
            if std and size >= 500:  # enough draws to measure a scale
                assert 0.6 * std < part.std() < 1.5 * std, (layout, shape, part.std(), std)
            elif not std and layout == 'dense':
                assert not part.any()  # biases start at zero, as Keras's do


def test_the_round_zero_model_is_a_sane_initialization(tmp_path):
    """At round 0 a generated fedavg-style target looks like Keras's own initialization: per-tensor scale within
    a factor of Keras's Glorot draw, different clients different models, finite logits of a moderate size."""
    with tf.Graph().as_default():
        shapes = [tuple(v.shape) for v in models.mnist_dnn((784,), 10).trainable_weights]
    hyper = pfedhn.PFedHNSettings().hypernetwork(shapes, 20, seed=0)
    assert hyper.layout == 'dense'
    theta = hyper.generate(hyper.initial(), tf.range(20)).numpy()
    kernel = theta[:, : 784 * 100]
    np.testing.assert_allclose(kernel.std(axis=1), pfedhn_network.glorot_std((784, 100)), rtol=0.1)
    assert np.corrcoef(theta[0], theta[1])[0, 1] < 0.99  # each client its own model
    x = np.random.default_rng(0).uniform(size=(64, 784))
    weights = [theta[0][:78400].reshape(784, 100), theta[0][78400:78500], theta[0][78500:79500].reshape(100, 10)]
    logits = np.maximum(x @ weights[0] + weights[1], 0) @ weights[2] + theta[0][79500:]
    assert np.isfinite(logits).all() and np.abs(logits).mean() < 5.0


@pytest.mark.parametrize('name', ['mnist_dnn', 'persfl_cnn', 'fedavg_cnn'])
def test_both_layouts_write_the_same_parameter_count_and_state_sizes_are_reported(name):
    """|phi| of each layout from the sizes formula equals the built hypernetwork's; fedavg_cnn's dense heads would
    take over 600 MB, its chunked ones (with their base) under 12 MB."""
    with tf.Graph().as_default():
        shapes = [tuple(v.shape) for v in models.get(name)((28, 28, 1), 10).trainable_weights]
    settings = pfedhn.PFedHNSettings()
    sizes = settings.sizes(shapes, 20)
    num_params = sum(int(np.prod(s)) for s in shapes)
    for layout in pfedhn_network.LAYOUTS:
        hyper = pfedhn.PFedHNSettings(pfedhn_layout=layout).hypernetwork(shapes, 20, seed=0)
        assert hyper.num_params == num_params
        assert hyper.parameter_count() == sizes[layout], layout
    if name == 'fedavg_cnn':
        assert num_params == 1_663_370
        assert 4 * sizes['dense'] > 600e6 and 4 * sizes['chunked'] < 12e6
        assert settings.layout(shapes) == 'chunked'
        hyper = settings.hypernetwork(shapes, 20, seed=0)
        assert hyper.generate(hyper.initial(), tf.constant([3])).shape == (1, num_params)
    else:
        assert settings.layout(shapes) == 'dense'


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    """Three clients of a tiny linear task (37, 50 and 23 examples) and multinomial logistic regression."""
    spec = make_linear_problem(tmp_path_factory.mktemp('pfedhn') / 'data')
    return spec, functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)


def _numpy_local_steps(spec, client_id, theta, config, round_num, dim, classes):
    x, y = ref.read(spec, client_id)
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, len(y), config.epochs, config.batch_size)
    start = [theta[: dim * classes].reshape(dim, classes), theta[dim * classes :]]
    trained = ref.sgd(start, x, y, config, batch, ref.num_steps(config, per_epoch))
    return np.concatenate([np.ravel(t) for t in trained])


def test_a_round_against_numpy(problem, tff_runtime):
    """Two of three clients: theta_i = h(v_i), K local SGD steps from it, delta theta_i, and the server's SGD step
    phi <- phi - alpha mean_i (grad_phi theta_i)^T (-delta theta_i), all against numpy."""
    spec, model_fn = problem
    settings = pfedhn.PFedHNSettings(
        **LOCAL, pfedhn_hidden_layers=1, pfedhn_hidden_units=6, pfedhn_optimizer='sgd', pfedhn_learning_rate=0.5
    )
    process = pfedhn.build_pfedhn_process(spec, model_fn, settings, seed=SEED)
    dim, classes = spec.feature_shape[0], spec.num_classes
    state = process.initialize()
    phi = _as_numpy(state['hypernetwork'])
    ids = list(spec.client_ids)
    sampled = [0, 2]
    states = [process.initial_client_state(ids[k]) for k in sampled]
    new_state, updated, metrics = process.next(state, states)
    theta, _ = _numpy_generate(phi, np.array(sampled))
    config = settings.training_config()
    deltas = np.stack(
        [_numpy_local_steps(spec, ids[k], theta[r], config, 0, dim, classes) - theta[r] for r, k in enumerate(sampled)]
    )
    grads = _numpy_gradient(phi, np.array(sampled), deltas)
    want = tf.nest.map_structure(lambda p, g: p - 0.5 * g, phi, grads)
    for got, expected in zip(tf.nest.flatten(new_state['hypernetwork']), tf.nest.flatten(want)):
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)
    assert new_state['round_num'] == 1
    assert [s['num_participations'] for s in updated] == [1, 1] and [s['client_index'] for s in updated] == sampled
    seen = 0
    for k in sampled:  # the examples of the K = 3 batches of each client's stream (the last of an epoch may be short)
        x, y = ref.read(spec, ids[k])
        per_epoch, batch = ref.batch_stream(SEED, ids[k], 0, len(y), config.epochs, config.batch_size)
        seen += sum(len(batch(i)) for i in range(ref.num_steps(config, per_epoch)))
    assert metrics['num_clients'] == 2 and metrics['num_examples'] == seen == 24 + 23
    assert metrics['mean_delta_norm'] == pytest.approx(np.mean(np.linalg.norm(deltas, axis=1)), rel=1e-4)
    # The personalized model evaluated is h(v_i) of the new phi, the paper's.
    evaluation = process.evaluate(new_state, [process.initial_client_state(c) for c in ids])
    theta_new, _ = _numpy_generate(_as_numpy(new_state['hypernetwork']), np.arange(3))
    for k, result in enumerate(evaluation):
        x, y = ref.read(spec, ids[k], 'test')
        params = [theta_new[k][: dim * classes].reshape(dim, classes), theta_new[k][dim * classes :]]
        assert result['personalized_model']['accuracy'] == pytest.approx(ref.accuracy(params, x, y), abs=1e-6)


def test_only_presence_deltas_and_metric_sums_reach_the_server(problem):
    """The round's uploads: a presence slot per client, each client's delta theta_i with its index, and the scalar
    training metrics; evaluation uploads the presence slots only. No raw data, no labels."""
    spec, model_fn = problem
    process = pfedhn.build_pfedhn_process(spec, model_fn, pfedhn.PFedHNSettings(**LOCAL))
    num_params = (spec.feature_shape[0] + 1) * spec.num_classes
    moved = [(uri, str(t)) for uri, t in audit.clients_to_server_values(process.next)]
    assert moved[0] == ('federated_sum', '{float32[3]}@CLIENTS')
    assert ('federated_aggregate', f'{{<index=int32,value=float32[{num_params}]>}}@CLIENTS') in moved
    scalars = [sent for uri, sent in moved[1:] if uri == 'federated_sum']
    assert scalars and all(s.startswith('{<') and '[' not in s for s in scalars), scalars
    assert len(moved) == 1 + 1 + len(scalars)
    assert [(u, str(t)) for u, t in audit.clients_to_server_values(process.evaluate)] == [
        ('federated_sum', '{float32[3]}@CLIENTS')
    ]
    assert process.extras['communication']['parameter_bytes_up_per_client'] == 4 * num_params


def test_tuned_evaluation_trains_the_generated_model_first(problem, tff_runtime):
    spec, model_fn = problem
    generated = pfedhn.build_pfedhn_process(spec, model_fn, pfedhn.PFedHNSettings(**LOCAL), seed=SEED)
    tuned = pfedhn.build_pfedhn_process(
        spec, model_fn, pfedhn.PFedHNSettings(**LOCAL, pfedhn_evaluate='tuned'), seed=SEED
    )
    states = generated.initial_client_states(spec.client_ids)
    before = [r['personalized_model']['loss'] for r in generated.evaluate(generated.initialize(), states)]
    after = [r['personalized_model']['loss'] for r in tuned.evaluate(tuned.initialize(), states)]
    assert np.mean(after) < np.mean(before)


def test_a_round_takes_at_most_its_capacity(problem, tff_runtime):
    spec, model_fn = problem
    process = pfedhn.build_pfedhn_process(spec, model_fn, pfedhn.PFedHNSettings(**LOCAL), max_clients_per_round=2)
    states = process.initial_client_states(spec.client_ids)
    process.next(process.initialize(), states[:2])
    with pytest.raises(Exception, match='more clients in the round than its capacity'):
        process.next(process.initialize(), states)


@pytest.mark.parametrize(
    'values, message',
    [
        (dict(pfedhn_local_steps=0), 'pfedhn_local_steps must be >= 1, got 0'),
        (dict(pfedhn_embedding_dim=-1), 'pfedhn_embedding_dim must be >= 0, got -1'),
        (dict(pfedhn_hidden_units=0), 'pfedhn_hidden_units must be >= 1, got 0'),
        (dict(pfedhn_hidden_layers=0), 'pfedhn_hidden_layers must be >= 1, got 0'),
        (dict(pfedhn_layout='sparse'), "pfedhn_layout must be one of auto, dense, chunked, got 'sparse'"),
        (dict(pfedhn_chunk_size=0), 'pfedhn_chunk_size must be >= 1, got 0'),
        (dict(pfedhn_chunk_embedding_dim=0), 'pfedhn_chunk_embedding_dim must be >= 1, got 0'),
        (dict(pfedhn_optimizer='rmsprop'), "pfedhn_optimizer must be one of sgd, sgdm, adam, got 'rmsprop'"),
        (dict(pfedhn_learning_rate=0.0), 'pfedhn_learning_rate must be > 0, got 0.0'),
        (dict(pfedhn_evaluate='best'), "pfedhn_evaluate must be one of generated, tuned, got 'best'"),
        (dict(batch_size=0), 'batch_size must be >= 1, got 0'),
    ],
)
def test_bad_settings_are_refused_in_one_line(values, message):
    with pytest.raises(settings_lib.SettingsError) as raised:
        pfedhn.PFedHNSettings(**values).validate()
    assert str(raised.value) == message


def test_the_paper_defaults():
    settings = pfedhn.PFedHNSettings()
    assert settings.embedding_dim(20) == 6 and settings.embedding_dim(100) == 26  # 1 + N / 4
    assert (settings.pfedhn_hidden_layers, settings.pfedhn_hidden_units, settings.pfedhn_local_steps) == (3, 100, 50)
    assert settings.pfedhn_evaluate == 'generated'
    assert (settings.pfedhn_optimizer, settings.pfedhn_learning_rate) == ('adam', 0.001)
    assert settings.training_config().max_steps == 50


def test_the_builder_refuses_what_it_cannot_use_in_one_line(problem):
    spec, model_fn = problem
    with pytest.raises(ValueError, match=r'^build_pfedhn_process takes no model_aggregator: ') as raised:
        pfedhn.build_pfedhn_process(spec, model_fn, model_aggregator=tff.aggregators.MeanFactory())
    assert '\n' not in str(raised.value)
    with pytest.raises(TypeError, match='^build_pfedhn_process takes PFedHNSettings, got ClientSGD$'):
        pfedhn.build_pfedhn_process(spec, model_fn, settings_lib.ClientSGD())


def test_a_sampled_run_through_the_training_binarys_code(tiny_npz, tmp_path):
    """Half the clients a round, two rounds, on tiny images: the run's rounds, clients.csv and the evaluation."""
    import csv

    from tff_pfl.program import experiment, run_config

    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        algorithm='pfedhn',
        dataset=f'npz:{tiny_npz}',
        partition='iid',
        num_clients=4,
        client_fraction=0.5,
        rounds=2,
        eval_every=0,
        model='logistic',
        pfedhn_local_steps=2,
    ).validate()
    result = experiment.run_experiment(config, log=lambda line: None)
    assert [r['num_clients'] for r in result.rounds] == [2, 2]
    assert 0.0 <= result.summary['personalized_model']['mean'] <= 1.0
    with open(tmp_path / 'run' / 'clients.csv') as f:
        taken = [int(row['rounds_taken_part']) for row in csv.DictReader(f)]
    assert sum(taken) == 4 and len(taken) == 4
