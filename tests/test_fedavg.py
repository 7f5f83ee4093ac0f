"""FedAvg against a small numpy FedAvg, and what crosses from CLIENTS to SERVER."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, local_training
from tff_pfl.data import client_data

SEED = 7
SETTINGS = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class NumpyAdam:
    """Adam as `tff.learning.optimizers.build_adam` states it (its docstring's rule), in float64.

    acc = beta_1 acc + (1 - beta_1) g; s = beta_2 s + (1 - beta_2) g^2;
    w -= lr sqrt(1 - beta_2^t) / (1 - beta_1^t) acc / (sqrt(s) + eps).
    """

    def __init__(self, lr, beta_1=0.9, beta_2=0.999, eps=1e-7):
        self.lr, self.beta_1, self.beta_2, self.eps = lr, beta_1, beta_2, eps
        self.t, self.acc, self.s = 0, None, None

    def step(self, params, grads):
        if self.acc is None:
            self.acc = [np.zeros_like(p) for p in params]
            self.s = [np.zeros_like(p) for p in params]
        self.t += 1
        lr_t = self.lr * np.sqrt(1 - self.beta_2**self.t) / (1 - self.beta_1**self.t)
        self.acc = [a + (g - a) * (1 - self.beta_1) for a, g in zip(self.acc, grads)]
        self.s = [v + (g * g - v) * (1 - self.beta_2) for v, g in zip(self.s, grads)]
        return [p - lr_t * a / (np.sqrt(v) + self.eps) for p, a, v in zip(params, self.acc, self.s)]


def numpy_fedavg_round(weights, spec, client_ids, round_num, settings, client_adam=None, server_adam=None):
    """One FedAvg round of multinomial logistic regression in float64 numpy.

    Only the example order of each epoch is taken from the project (the
    stateless permutation); gradients, SGD steps, the stop after
    `local_steps` steps and weighted averaging are computed here
    independently. `client_adam`: the learning rate of a fresh `NumpyAdam`
    per client instead of SGD; `server_adam`: a `NumpyAdam` kept across
    rounds, stepped with the mean update (initial - trained) as its
    gradient, instead of the server's SGD. Returns the new weights, each
    client's step count and the number of examples the clients' steps saw.
    """
    w, b = (np.asarray(a, np.float64) for a in weights)
    epochs = settings.local_steps or settings.local_epochs
    max_steps = settings.local_steps or np.inf
    batch, lr = settings.batch_size, settings.client_learning_rate
    deltas, counts, steps, seen = [], [], [], 0
    for client_id in client_ids:
        x, y = client_data.read_split_numpy(spec, client_id, 'train')
        x = x.astype(np.float64)
        n = len(y)
        seed = local_training.client_seed(SEED, tf.constant(round_num), tf.constant(client_id))
        perms = local_training.epoch_permutations(seed, epochs, n).numpy()
        cw, cb = w.copy(), b.copy()
        adam = NumpyAdam(client_adam) if client_adam else None
        taken = 0
        for epoch in range(epochs):
            for start in range(0, n, batch):
                if taken == max_steps:
                    break
                idx = perms[epoch, start : start + batch]
                xb, yb = x[idx], y[idx]
                p = _softmax(xb @ cw + cb)
                p[np.arange(len(yb)), yb] -= 1.0
                gw, gb = xb.T @ p / len(yb), p.sum(axis=0) / len(yb)
                if adam is None:
                    cw, cb = cw - lr * gw, cb - lr * gb
                else:
                    cw, cb = adam.step([cw, cb], [gw, gb])
                taken += 1
                seen += len(yb)
        deltas.append((cw - w, cb - b))
        counts.append(n)
        steps.append(taken)
    counts = np.asarray(counts, np.float64)
    mean_dw = sum(c * d[0] for c, d in zip(counts, deltas)) / counts.sum()
    mean_db = sum(c * d[1] for c, d in zip(counts, deltas)) / counts.sum()
    if server_adam is not None:
        return tuple(server_adam.step([w, b], [-mean_dw, -mean_db])), steps, seen
    server_lr = settings.server_learning_rate
    return (w + server_lr * mean_dw, b + server_lr * mean_db), steps, seen


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('fedavg') / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    return spec, model_fn


@pytest.mark.parametrize(
    'settings',
    [
        fedavg.FedAvgSettings(local_epochs=2, batch_size=8, client_learning_rate=0.3),
        fedavg.FedAvgSettings(local_epochs=2, batch_size=8, client_learning_rate=0.3, server_learning_rate=0.5),
        # Steps instead of epochs: fewer than one epoch, and (batch 32) more than one.
        fedavg.FedAvgSettings(local_steps=3, batch_size=8, client_learning_rate=0.3),
        fedavg.FedAvgSettings(local_steps=3, batch_size=32, client_learning_rate=0.3),
    ],
    ids=['epochs', 'server_lr', 'steps', 'steps_over_epochs'],
)
def test_fedavg_matches_numpy(problem, tff_runtime, settings):
    spec, model_fn = problem
    process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=SEED)
    state = process.initialize()
    sampled = [spec.client_ids[0], spec.client_ids[2]]  # a subset, in a given order
    client_states = [process.initial_client_state(c) for c in sampled]
    expected = [np.asarray(a) for a in state['model']]
    for round_num in range(3):
        expected, steps, seen = numpy_fedavg_round(expected, spec, sampled, round_num, settings)
        output = process.next(state, client_states)
        state, client_states = output.state, output.client_states
        for got, want in zip(state['model'], expected):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        assert output.metrics['mean_local_steps'] == np.mean(steps)
        assert output.metrics['num_examples'] == seen
    if settings.local_steps:
        assert steps == [settings.local_steps] * len(sampled)
    assert state['round_num'] == 3
    assert [s['client_id'].decode() for s in client_states] == sampled
    assert all(s['num_participations'] == 3 and s['last_round'] == 2 for s in client_states)
    assert output.metrics['num_clients'] == 2
    if not settings.local_steps:
        assert seen == settings.local_epochs * (37 + 23)


@pytest.mark.parametrize('client_adam, server_adam', [(0.05, None), (None, 0.1), (0.05, 0.1)])
def test_tff_adam_optimizers_change_the_round_as_a_numpy_adam_does(problem, tff_runtime, client_adam, server_adam):
    """`client_optimizer` / `server_optimizer` = `tff.learning.optimizers.build_adam`: three rounds
    equal FedAvg with a numpy Adam in the clients' steps (fresh per client and round) and in the
    server's step (kept across rounds)."""
    spec, model_fn = problem
    settings = fedavg.FedAvgSettings(local_epochs=2, batch_size=8, client_learning_rate=0.3)
    process = fedavg.build_fedavg_process(
        spec,
        model_fn,
        settings,
        client_optimizer=tff.learning.optimizers.build_adam(client_adam) if client_adam else None,
        server_optimizer=tff.learning.optimizers.build_adam(server_adam) if server_adam else None,
        seed=SEED,
    )
    state = process.initialize()
    sampled = [spec.client_ids[0], spec.client_ids[2]]
    client_states = process.initial_client_states(sampled)
    expected = [np.asarray(a, np.float64) for a in state['model']]
    sgd_round = [np.asarray(a, np.float64) for a in state['model']]
    sgd_round, _, _ = numpy_fedavg_round(sgd_round, spec, sampled, 0, settings)
    numpy_server = NumpyAdam(server_adam) if server_adam else None
    for round_num in range(3):
        expected, steps, _ = numpy_fedavg_round(
            expected, spec, sampled, round_num, settings, client_adam=client_adam, server_adam=numpy_server
        )
        state, client_states, metrics = process.next(state, client_states)
        for got, want in zip(state['model'], expected):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
        assert metrics['mean_local_steps'] == np.mean(steps)
        if round_num == 0:  # Adam moved the model somewhere SGD does not
            assert max(np.abs(g - w).max() for g, w in zip(state['model'], sgd_round)) > 1e-3


def test_an_optimizer_that_is_not_tffs_is_refused_naming_the_argument(problem):
    spec, model_fn = problem
    with pytest.raises(TypeError, match=r'^client_optimizer must be a tff.learning.optimizers.Optimizer'):
        fedavg.build_fedavg_process(spec, model_fn, client_optimizer=tf.keras.optimizers.Adam(0.01))
    with pytest.raises(TypeError, match=r'^server_optimizer must be a tff.learning.optimizers.Optimizer'):
        fedavg.build_fedavg_process(spec, model_fn, server_optimizer='adam')


@pytest.mark.parametrize(
    'aggregator, message',
    [
        ('mean', r"^model_aggregator must be a tff.aggregators factory .*, got str 'mean'$"),
        (tff.aggregators.MeanFactory, r'^model_aggregator must be an aggregation factory instance, got the class '),
        (
            lambda: tff.aggregators.MeanFactory(),
            r'^model_aggregator must be a tff.aggregators factory .*, got function',
        ),
    ],
)
def test_an_aggregator_that_is_not_a_tff_factory_instance_is_refused_in_one_line(problem, aggregator, message):
    spec, model_fn = problem
    with pytest.raises(TypeError, match=message) as caught:
        fedavg.build_fedavg_process(spec, model_fn, model_aggregator=aggregator)
    assert '\n' not in str(caught.value)


@pytest.mark.parametrize('settings_cls', [fedavg.FedAvgSettings, fedavg.FedAvgFTSettings])
def test_local_steps_are_exact(problem, tff_runtime, settings_cls):
    """local_steps=3: every client runs exactly 3 SGD steps (37, 50 and 23 examples, batch 8 or 64)."""
    spec, model_fn = problem
    for batch_size in (8, 64):
        settings = settings_cls(local_steps=3, batch_size=batch_size, client_learning_rate=0.3)
        process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=SEED)
        state = process.initialize()
        states = [process.initial_client_state(c) for c in spec.client_ids]
        for _ in range(2):
            state, states, metrics = process.next(state, states)
            assert metrics['mean_local_steps'] == 3.0
    # Epochs (local_steps=0): one epoch is ceil(n / B) steps.
    process = fedavg.build_fedavg_process(spec, model_fn, settings_cls(batch_size=8), seed=SEED)
    _, _, metrics = process.next(process.initialize(), [process.initial_client_state(c) for c in spec.client_ids])
    assert metrics['mean_local_steps'] == pytest.approx(np.mean([5, 7, 3]))


@pytest.mark.parametrize(
    'settings, message',
    [
        (fedavg.FedAvgSettings(local_steps=-1), 'local_steps must be >= 0, got -1'),
        (fedavg.FedAvgSettings(local_epochs=0), 'local_epochs must be >= 1, got 0'),
        (fedavg.FedAvgSettings(batch_size=0), 'batch_size must be >= 1, got 0'),
        (fedavg.FedAvgSettings(client_learning_rate=0.0), 'client_learning_rate must be > 0, got 0.0'),
        (fedavg.FedAvgSettings(server_learning_rate=-1.0), 'server_learning_rate must be > 0, got -1.0'),
        (fedavg.FedAvgSettings(local_epochs=1.5), 'local_epochs must be an integer, got 1.5'),
        (
            fedavg.FedAvgSettings(local_epochs=2, local_steps=3),
            'give local_epochs or local_steps, not both (local_epochs=2, local_steps=3)',
        ),
        (fedavg.FedAvgFTSettings(finetune_epochs=0), 'finetune_epochs must be >= 1, got 0'),
    ],
)
def test_bad_settings_are_refused_in_one_line(problem, settings, message):
    with pytest.raises(settings_lib.SettingsError) as error:
        settings.validate()
    assert str(error.value) == message and '\n' not in message
    spec, model_fn = problem
    with pytest.raises(settings_lib.SettingsError) as error:
        fedavg.build_fedavg_process(spec, model_fn, settings)
    assert str(error.value) == message


def test_settings_defaults_and_finetuning(problem):
    assert fedavg.FedAvgSettings() == fedavg.FedAvgSettings().validate()
    assert fedavg.FedAvgFTSettings().finetune_epochs == 5
    spec, model_fn = problem
    assert fedavg.build_fedavg_process(spec, model_fn).personalize is None
    tuned = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgFTSettings(finetune_epochs=2))
    assert tuned.personalize is not None
    assert 'finetune_val_accuracy' in str(tuned.initial_client_state.type_signature.result)
    with pytest.raises(TypeError, match='FedAvgSettings'):
        fedavg.build_fedavg_process(spec, model_fn, settings_lib.ClientSGD())


def test_evaluate_is_per_client_on_test_split(problem, tff_runtime):
    spec, model_fn = problem
    process = fedavg.build_fedavg_process(spec, model_fn, SETTINGS, seed=SEED)
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
    process = fedavg.build_fedavg_process(spec, model_fn, SETTINGS)
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


def test_the_default_mean_is_meanfactorys_in_one_sum(problem, tff_runtime):
    # The default (None) fuses the example-weighted mean into the round; an explicit
    # MeanFactory() is TFF's own. The same float operations in the same order: equal bits.
    spec, model_fn = problem
    fused = fedavg.build_fedavg_process(spec, model_fn, SETTINGS, seed=SEED)
    tffs = fedavg.build_fedavg_process(
        spec, model_fn, SETTINGS, seed=SEED, model_aggregator=tff.aggregators.MeanFactory()
    )
    assert fused.next.type_signature == tffs.next.type_signature
    # One federated_sum a round (what crosses: the weighted update, the weight, the metric
    # sums), where MeanFactory's round makes three.
    sums = [t for uri, t in audit.clients_to_server_values(fused.next) if uri == 'federated_sum']
    assert len(sums) == 1
    assert [name for name, _ in tff.structure.iter_elements(sums[0].member)] == [
        'weighted_update',
        'weight',
        'metric_sums',
    ]
    assert len([u for u, _ in audit.clients_to_server_values(tffs.next) if u == 'federated_sum']) == 3
    sampled = [spec.client_ids[0], spec.client_ids[2], spec.client_ids[1]]
    runs = []
    for process in (fused, tffs):
        state, client_states = process.initialize(), [process.initial_client_state(c) for c in sampled]
        metrics = []
        for _ in range(3):
            output = process.next(state, client_states)
            state, client_states = output.state, output.client_states
            metrics.append(output.metrics)
        runs.append((state, client_states, metrics))
    for got, want in zip(tf.nest.flatten(runs[0]), tf.nest.flatten(runs[1])):
        np.testing.assert_array_equal(got, want)


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
