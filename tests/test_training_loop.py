"""The shared run loop: sampling, the client-state store, evaluation of every client."""

import dataclasses
import functools

import numpy as np
import pytest

from processes import fedavg
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.data import client_data
from tff_pfl.program import client_states, evaluation, training_loop


def test_sample_clients_is_seeded_and_sized():
    ids = [f'c{i}' for i in range(10)]
    a = [training_loop.sample_clients(np.random.default_rng(3), ids, 0.25) for _ in range(2)]
    assert a[0] == a[1] and len(a[0]) == 3 and a[0] == sorted(a[0])
    assert training_loop.sample_clients(np.random.default_rng(3), ids, 1.0) == ids
    assert len(training_loop.sample_clients(np.random.default_rng(3), ids, 0.01)) == 1


def test_flatten():
    assert evaluation.flatten({'a': {'b': np.float32(1.5)}, 'c': np.int32(2)}) == {'a_b': 1.5, 'c': 2}


@pytest.fixture(scope='module')
def process(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('loop') / 'data', num_clients=3)
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
    return spec, fedavg.build_fedavg_process(spec, model_fn, settings, seed=1)


def _run(process, spec, **kwargs):
    lines = []
    result = training_loop.run(process, spec.client_ids, log=lines.append, **kwargs)
    return result, lines


def test_run_samples_evaluates_everyone_and_is_deterministic(process, tff_runtime):
    spec, proc = process
    result, lines = _run(proc, spec, rounds=4, client_fraction=0.5, seed=5, eval_every=2)
    again, _ = _run(proc, spec, rounds=4, client_fraction=0.5, seed=5, eval_every=2)
    assert [r['train_loss'] for r in result.rounds] == [r['train_loss'] for r in again.rounds]
    # ceil(0.5 * 3) = 2 clients per round; participation is recorded in the store.
    assert all(r['num_clients'] == 2 for r in result.rounds)
    assert sum(s['num_participations'] for s in result.client_states.values()) == 8
    # Every client is evaluated, sampled or not, at rounds 2 and 4 only.
    assert [c['client_id'] for c in result.clients] == list(spec.client_ids)
    evaluated = [r['round'] for r in result.rounds if 'test_global_model_accuracy_mean' in r]
    assert evaluated == [2, 4]
    accuracies = [c['global_model_accuracy'] for c in result.clients]
    assert result.summary['global_model']['mean'] == pytest.approx(np.mean(accuracies))
    assert len(lines) == 4 and lines[-1].startswith('round 4/4') and 'ETA' in lines[-1]
    other, _ = _run(proc, spec, rounds=4, client_fraction=0.5, seed=6, eval_every=0)
    assert [r['train_loss'] for r in other.rounds] != [r['train_loss'] for r in result.rounds]


def test_poisson_rounds_may_be_empty_and_then_change_nothing(process, tff_runtime):
    spec, proc = process
    # q = 0.2 with 3 clients: a round draws nobody with probability 0.8^3 = 0.51.
    result, lines = _run(proc, spec, rounds=8, client_fraction=0.2, seed=2, poisson_sampling=True)
    sizes = [r['num_clients'] for r in result.rounds]
    assert 0 in sizes and any(n > 0 for n in sizes), sizes
    assert len(lines) == 8
    # The rounds that drew nobody did not count as participation, and the sizes vary.
    assert sum(s['num_participations'] for s in result.client_states.values()) == sum(sizes)
    rng = np.random.default_rng([2, 0x5A3D])
    expected = [len(training_loop.sample_clients(rng, spec.client_ids, 0.2, poisson=True)) for _ in range(8)]
    assert sizes == expected
    # Only empty rounds: the model is the initial one.
    rng, rounds = np.random.default_rng([2, 0x5A3D]), 0
    while training_loop.sample_clients(rng, spec.client_ids, 0.2, poisson=True) == []:
        rounds += 1
    assert rounds == 4  # seed 2 draws nobody in its first four rounds
    idle, _ = _run(proc, spec, rounds=rounds, client_fraction=0.2, seed=2, poisson_sampling=True)
    for got, want in zip(idle.state['model'], proc.initialize()['model']):
        np.testing.assert_array_equal(got, want)


def test_store_rejects_a_state_in_the_wrong_slot(process, tff_runtime):
    spec, proc = process
    store = client_states.ClientStateStore(proc, spec.client_ids)
    states = store.get(spec.client_ids[:2])
    with pytest.raises(RuntimeError, match='slot'):
        store.put(spec.client_ids[:2], states[::-1])


def test_sampled_evaluations_score_a_seeded_sample_and_change_no_training_number(tmp_path, tff_runtime):
    """Intermediate evaluations of 3 of 8 clients: the same clients' numbers as a full evaluation, and an interval."""
    spec = make_linear_problem(tmp_path / 'data', num_clients=8, sizes=(37, 50, 23, 30, 41, 28, 33, 45))
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
    proc = fedavg.build_fedavg_process(spec, model_fn, settings, seed=1)
    full, _ = _run(proc, spec, rounds=4, client_fraction=0.5, seed=5, eval_every=2)
    sampled, _ = _run(proc, spec, rounds=4, client_fraction=0.5, seed=5, eval_every=2, eval_clients=3)
    assert [r['train_loss'] for r in sampled.rounds] == [r['train_loss'] for r in full.rounds]
    assert [r.get('eval_clients') for r in sampled.rounds] == [None, 3, None, 8]
    assert 'test_global_model_accuracy_mean_ci95' not in sampled.rounds[3]
    assert sampled.clients == full.clients  # the last round scores every client
    chosen = evaluation.evaluation_sample(5, 2, 8, 3)
    np.testing.assert_array_equal(chosen, evaluation.evaluation_sample(5, 2, 8, 3))
    assert len(set(chosen.tolist())) == 3 and list(chosen) == sorted(chosen)
    assert evaluation.evaluation_sample(5, 2, 8, 8) is None and evaluation.evaluation_sample(5, 2, 8, 0) is None
    # Round 2's sample against a full evaluation of the same clients at round 2.
    store = client_states.ClientStateStore(proc, spec.client_ids)
    rng = np.random.default_rng([5, 0x5A3D])
    state = proc.initialize()
    for _ in range(2):
        state, _ = store.run_round(proc, state, training_loop.sample_clients(rng, spec.client_ids, 0.5))
    everyone = store.evaluate(proc, state)
    accuracies = np.array([float(everyone[i]['global_model']['accuracy']) for i in chosen])
    row = sampled.rounds[1]
    assert row['test_global_model_accuracy_mean'] == pytest.approx(accuracies.mean())
    # Independent closed form: 1.96 s / sqrt(n) * sqrt(1 - n / N).
    expected = 1.959964 * accuracies.std(ddof=1) / np.sqrt(3) * np.sqrt(1 - 3 / 8)
    assert row['test_global_model_accuracy_mean_ci95'] == pytest.approx(expected, rel=1e-6)


def test_diverged_reads_the_rounds_mean_training_loss():
    assert training_loop.diverged({'train_loss': float('nan')}) and training_loop.diverged({'train_loss': np.inf})
    assert not training_loop.diverged({'train_loss': 1e30}) and not training_loop.diverged({'num_clients': 0})


def test_a_diverged_round_is_the_last(tmp_path, tff_runtime):
    """A learning rate of 1e38 overflows the weights in round 1: the run stops there and scores its models."""
    spec = make_linear_problem(tmp_path / 'data', num_clients=3)
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=1e38)
    proc = fedavg.build_fedavg_process(spec, model_fn, settings, seed=1)
    stopped, lines = _run(proc, spec, rounds=4, client_fraction=1.0, seed=5, stop_on_divergence=True)
    assert stopped.diverged_round == 1 and [r['round'] for r in stopped.rounds] == [1]
    assert not np.isfinite(stopped.rounds[0]['train_loss'])
    assert 'test_global_model_accuracy_mean' in stopped.rounds[0]  # evaluated as the last round
    assert [c['client_id'] for c in stopped.clients] == list(spec.client_ids)
    assert lines[0].startswith('round 1: the mean training loss is inf: the run diverged and stops here')
    assert lines[-1].startswith('round 1/4')
    every, _ = _run(proc, spec, rounds=4, client_fraction=1.0, seed=5)
    assert every.diverged_round is None and len(every.rounds) == 4


def _numpy_accuracy(weights, x, y):
    """Logistic regression's accuracy, computed in numpy from its kernel and bias."""
    kernel, bias = (np.asarray(w) for w in weights.trainable)
    return float(np.mean(np.argmax(x.reshape(len(x), -1) @ kernel + bias, axis=1) == y))


def test_the_validation_curve_scores_the_validation_splits_and_changes_no_training_number(tmp_path, tff_runtime):
    """A second process on the validation splits: its numbers are the models' on val; training is untouched."""
    spec = make_linear_problem(tmp_path / 'data', num_clients=4, sizes=(37, 50, 23, 30))
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
    proc = fedavg.build_fedavg_process(spec, model_fn, settings, seed=1)
    val_spec = dataclasses.replace(spec, evaluation_split='val')
    validation = fedavg.build_fedavg_process(val_spec, model_fn, settings, seed=1)
    plain, _ = _run(proc, spec, rounds=3, client_fraction=1.0, seed=2, eval_every=1)
    curved, _ = _run(proc, spec, rounds=3, client_fraction=1.0, seed=2, eval_every=1, validation=validation)
    for a, b in zip(plain.rounds, curved.rounds):
        assert {k: v for k, v in b.items() if not k.startswith('val_') and k != 'round_seconds'} == {
            k: v for k, v in a.items() if k != 'round_seconds'
        }
    weights = proc.get_model_weights(curved.state)
    val, test = [], []
    for row in curved.clients:
        x, y = client_data.read_split_numpy(spec, row['client_id'], 'val')
        val.append(_numpy_accuracy(weights, x, y))
        assert row['global_model_val_accuracy'] == pytest.approx(val[-1], abs=1e-6)
        x, y = client_data.read_split_numpy(spec, row['client_id'], 'test')
        test.append(_numpy_accuracy(weights, x, y))
        assert row['global_model_accuracy'] == pytest.approx(test[-1], abs=1e-6)
    assert val != test  # the two splits differ, so the check can tell them apart
    last = curved.rounds[-1]
    assert last['val_global_model_accuracy_mean'] == pytest.approx(np.mean(val), abs=1e-6)
    sizes = np.array(spec.split_sizes['val'], float)
    assert last['val_global_model_accuracy_weighted_mean'] == pytest.approx(np.average(val, weights=sizes), abs=1e-6)
    assert all('val_global_model_accuracy_mean' in row for row in curved.rounds)


def test_only_test_or_val_is_an_evaluation_split(tmp_path):
    spec = make_linear_problem(tmp_path / 'data', num_clients=3)
    with pytest.raises(ValueError, match="evaluation_split must be 'test' or 'val', got 'train'"):
        dataclasses.replace(spec, evaluation_split='train')


def test_eval_validation_gives_the_serverless_loop_its_validation_curve(tiny_npz, tmp_path, tff_runtime):
    """`eval_validation` through the binary's path: KD-PDFL's loop writes val columns beside the test ones."""
    import csv

    from processes import kdpdfl
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
        rounds=2,
        eval_every=1,
        eval_validation=True,
        settings=kdpdfl.KDPDFLSettings(
            exchange_interval=3, kd_mean_neighbours=2.0, kd_max_neighbours=2, batch_size=8, client_learning_rate=0.1
        ),
    ).validate()
    result = experiment.run_experiment(config, log=lambda line: None)
    for row in result.rounds:
        assert 0 <= row['val_personalized_model_accuracy_mean'] <= 1
    with open(out / 'clients.csv') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(0 <= float(r['personalized_model_val_accuracy']) <= 1 for r in rows)
    with open(out / 'metrics.csv') as f:
        assert 'val_personalized_model_accuracy_mean' in next(csv.reader(f))


def test_a_run_without_validation_splits_trains_and_scores_its_test_splits(tiny_npz, tmp_path, tff_runtime):
    """split_fractions with a validation fraction of 0: no client keeps validation examples, and FedAvg runs."""
    from tff_pfl.program import experiment, run_config

    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        algorithm='fedavg',
        dataset=f'npz:{tiny_npz}',
        partition='ds1',
        classes_per_client=2,
        num_clients=4,
        rounds=2,
        split_fractions=(0.9, 0.0, 0.1),
    ).validate()
    result = experiment.run_experiment(config, log=lambda line: None)
    spec = client_data.load_client_data_spec(str(tmp_path / 'run' / 'client_data'))
    assert set(spec.split_sizes['val']) == {0} and min(spec.split_sizes['test']) > 0
    assert 0 <= result.summary['global_model']['mean'] <= 1
