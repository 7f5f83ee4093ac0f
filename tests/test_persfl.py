"""PersFL: teacher selection against numpy, personalization, what stays at CLIENTS."""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow_federated as tff

from processes import persfl
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, distillation
from tff_pfl.data import client_data
from tff_pfl.program import client_states, run_config, training_loop

SETTINGS = persfl.PersFLSettings(
    local_epochs=1,
    batch_size=8,
    client_learning_rate=0.5,
    distill_epochs=2,
    distill_batch_size=8,
    distill_learning_rate=0.1,
    temperatures=(1.0, 5.0),
    imitations=(0.0, 0.5, 1.0),
)


def _val_loss(weights, spec, client_id):
    x, y = client_data.read_split_numpy(spec, client_id, 'val')
    z = x.astype(np.float64) @ weights[0] + weights[1]
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -np.mean(log_p[np.arange(len(y)), y])


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('persfl') / 'data', num_clients=3)
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    return spec, model_fn


def _build(problem, soft_loss='kl', **changes):
    """PersFL ('kl') or PersFL-GD ('ce'): the variant is the settings type."""
    spec, model_fn = problem
    settings = dataclasses.replace(SETTINGS, **changes)
    if soft_loss == 'ce':
        settings = persfl.PersFLGDSettings(**dataclasses.asdict(settings))
    assert settings.soft_loss == soft_loss
    return persfl.build_persfl_process(spec, model_fn, settings, seed=3)


def test_the_soft_loss_is_the_settings_type_and_its_reduction():
    assert persfl.PersFLSettings().soft_loss == 'kl'
    assert persfl.PersFLGDSettings().soft_loss == 'ce'
    assert persfl.PersFLSettings(soft_reduction='elements').soft_loss == 'kl_elements'
    assert persfl.PersFLGDSettings(soft_reduction='elements').soft_loss == 'ce_elements'
    message = "^soft_reduction must be 'examples' or 'elements', got 'mean'$"
    with pytest.raises(settings_lib.SettingsError, match=message):
        persfl.PersFLSettings(soft_reduction='mean').validate()


def test_teacher_selection_matches_numpy(problem, tff_runtime):
    spec, _ = problem
    process = _build(problem)
    state = process.initialize()
    store = client_states.ClientStateStore(process, spec.client_ids)
    expected = {c: (np.inf, -1, None) for c in spec.client_ids}  # loss, round, weights
    rng = np.random.default_rng(0)
    for round_num in range(6):
        sampled = training_loop.sample_clients(rng, spec.client_ids, 0.5)
        global_weights = [np.asarray(w, np.float64) for w in state['model']]
        for c in sampled:  # Algorithm 1, lines 5-9, recomputed here
            loss = _val_loss(global_weights, spec, c)
            if loss < expected[c][0]:
                expected[c] = (loss, round_num, global_weights)
        output = process.next(state, store.get(sampled))
        state = output.state
        store.put(sampled, output.client_states)
        for c, client_state in zip(store.ids(), store.all()):
            loss, teacher_round, weights = expected[c]
            assert client_state['teacher_round'] == teacher_round
            if weights is not None:
                np.testing.assert_allclose(client_state['teacher_loss'], loss, rtol=1e-5)
                np.testing.assert_allclose(client_state['teacher'][0], weights[0], atol=1e-6)
                np.testing.assert_allclose(client_state['personalized'][0], weights[0], atol=1e-6)
    # Some clients skipped rounds; their teachers stayed (checked every round above).
    assert any(s['num_participations'] < 6 for s in store.all())

    personalized = process.personalize(state, store.all())
    final_weights = [np.asarray(w, np.float64) for w in state['model']]
    for c, before, after in zip(store.ids(), store.all(), personalized):
        # The final global model is a candidate too.
        final_loss = _val_loss(final_weights, spec, c)
        want_round = 6 if final_loss < expected[c][0] else expected[c][1]
        assert after['teacher_round'] == want_round
        # The chosen candidate is the best on validation (first on ties) ...
        best = int(np.argmax(after['grid_val_accuracy']))
        assert (after['temperature'], after['imitation']) == process.extras['grid_candidates'][best]
        assert after['personalized_val_accuracy'] == after['grid_val_accuracy'][best]
        # ... and its validation accuracy is what numpy measures for its weights.
        x, y = client_data.read_split_numpy(spec, c, 'val')
        accuracy = np.mean(np.argmax(x @ after['personalized'][0] + after['personalized'][1], 1) == y)
        np.testing.assert_allclose(after['personalized_val_accuracy'], accuracy, rtol=1e-6)
        assert after['num_participations'] == before['num_participations']

    results = process.evaluate(state, personalized)
    assert all(set(r) == {'global_model', 'personalized_model'} for r in results)


def test_final_teacher_ablation(problem, tff_runtime):
    spec, _ = problem
    process = _build(problem, teacher='final')
    state = process.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    for _ in range(3):
        state, states, _ = process.next(state, states)
    assert all(s['teacher_round'] == 2 for s in states)  # the latest model, not the best
    states = process.personalize(state, states)
    assert all(s['teacher_round'] == 3 for s in states)  # the final global model
    for s in states:
        np.testing.assert_allclose(s['teacher'][0], state['model'][0])


def test_teachers_and_personalized_models_stay_at_clients(problem):
    process = _build(problem, soft_loss='ce')
    next_type = process.next.type_signature
    assert 'teacher' not in str(next_type.result.state) and 'personalized' not in str(next_type.result.state)
    assert 'teacher' not in str(next_type.result.metrics)
    assert next_type.result.client_states.placement is tff.CLIENTS
    assert audit.clients_to_server_intrinsics(process.next) <= {
        'federated_sum',
        'federated_mean',
        'federated_weighted_mean',
    }
    personalize_type = process.personalize.type_signature
    assert personalize_type.result.placement is tff.CLIENTS
    assert audit.clients_to_server_intrinsics(process.personalize) == set()


@pytest.mark.parametrize('soft_loss', ['kl', 'ce'])
def test_local_steps_are_exact_and_the_grid_is_declared(problem, tff_runtime, soft_loss):
    """Stage 1 with local_steps=3: every sampled client runs exactly 3 SGD steps."""
    spec, _ = problem
    process = _build(problem, soft_loss=soft_loss, local_steps=3, batch_size=16)
    state = process.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    for _ in range(2):
        state, states, metrics = process.next(state, states)
        assert metrics['mean_local_steps'] == 3.0
    # The grid is a declared output of the constructor, not an attribute set afterwards.
    assert 'grid_candidates' not in vars(process)
    candidates = distillation.grid_candidates(SETTINGS.temperatures, SETTINGS.imitations)
    assert process.extras['grid_candidates'] == tuple(candidates)


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(local_steps=-2), 'local_steps must be >= 0, got -2'),
        (dict(distill_epochs=0), 'distill_epochs must be >= 1, got 0'),
        (dict(distill_batch_size=0), 'distill_batch_size must be >= 1, got 0'),
        (dict(distill_learning_rate=0.0), 'distill_learning_rate must be > 0, got 0.0'),
        (dict(temperatures=()), 'temperatures must be positive numbers, got []'),
        (dict(temperatures=(1.0, 0.0)), 'temperatures must be positive numbers, got [1.0, 0.0]'),
        (dict(imitations=(0.5, 1.5)), 'imitations must be numbers in [0, 1], got [0.5, 1.5]'),
        (dict(teacher='best'), "teacher must be 'optimal' or 'final', got 'best'"),
        (dict(distill_search='random'), "distill_search must be 'grid' or 'halving', got 'random'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(problem, changes, message):
    settings = dataclasses.replace(SETTINGS, **changes)
    with pytest.raises(settings_lib.SettingsError) as error:
        settings.validate()
    assert str(error.value) == message and '\n' not in message
    with pytest.raises(settings_lib.SettingsError) as error:
        _build(problem, **changes)
    assert str(error.value) == message


def test_halving_personalizes_with_a_grid_student(problem, tff_runtime):
    """Stage 2 by successive halving: the chosen student is the grid's student of the same candidate."""
    spec, _ = problem
    chosen = {}
    for search in ('grid', 'halving'):
        process = _build(problem, distill_search=search, temperatures=(1.0, 2.0, 5.0), imitations=(0.0, 0.25, 0.5))
        state = process.initialize()
        states = [process.initial_client_state(c) for c in spec.client_ids]
        state, states, _ = process.next(state, states)
        chosen[search] = process.personalize(state, states)
    candidates = distillation.grid_candidates((1.0, 2.0, 5.0), (0.0, 0.25, 0.5))
    agree = 0
    for grid, halving in zip(chosen['grid'], chosen['halving']):
        # Seven candidates, rungs of 7 -> 3 -> 1: the survivor is trained exactly like the grid's candidate.
        pick = candidates.index((float(halving['temperature']), float(halving['imitation'])))
        assert float(halving['personalized_val_accuracy']) == pytest.approx(float(grid['grid_val_accuracy'][pick]))
        if pick == candidates.index((float(grid['temperature']), float(grid['imitation']))):
            agree += 1
            for a, b in zip(halving['personalized'], grid['personalized']):
                np.testing.assert_allclose(a, b, atol=1e-6)
    assert agree >= 1


def test_bad_arguments(problem):
    spec, model_fn = problem
    with pytest.raises(TypeError, match='PersFLSettings'):
        persfl.build_persfl_process(spec, model_fn, settings_lib.LocalTraining())


def test_defaults_are_the_papers_grid():
    defaults = persfl.PersFLSettings().validate()
    assert defaults.temperatures == (1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0)
    assert defaults.imitations == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert defaults.teacher == 'optimal'
    assert len(distillation.grid_candidates(defaults.temperatures, defaults.imitations)) == 23


def test_experiment_writes_persfl_outputs(tiny_npz, tmp_path):
    from tff_pfl.program import experiment

    out = tmp_path / 'run'
    config = run_config.make_config(
        output_dir=str(out),
        algorithm='persfl_gd',
        dataset=f'npz:{tiny_npz}',
        partition='ds1',
        classes_per_client=2,
        num_clients=3,
        rounds=2,
        settings=persfl.PersFLGDSettings(
            batch_size=8,
            client_learning_rate=0.1,
            distill_epochs=1,
            temperatures=(1.0, 4.0),
            imitations=(0.0, 0.5, 1.0),
        ),
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    for name in (
        'teacher_rounds.png',
        'chosen_temperature.png',
        'chosen_imitation.png',
        'distillation_grid.png',
        'distillation_grid.csv',
    ):
        assert (out / name).stat().st_size > 0, name
    assert set(result.summary) == {'global_model', 'personalized_model'}
    row = result.clients[0]
    assert {'teacher_round', 'temperature', 'imitation', 'personalized_val_accuracy'} <= set(row)
    assert 0 <= row['teacher_round'] <= 2
    report = (out / 'report.md').read_text()
    assert 'personalized_model' in report and 'distillation_grid.png' in report
    assert 'personalize_seconds' in (out / 'metrics.csv').read_text().splitlines()[0]
