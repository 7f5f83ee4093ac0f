"""Self-FL: each rule against numpy, the TFF process against a numpy iteration,
and the iteration against the closed-form posterior means."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import selffl
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import aggregators, audit
from tff_pfl.reference import selffl_gaussian as reference


def test_aggregator_matches_numpy(tff_runtime):
    value_type = tff.to_type([(np.float32, (3,)), (np.float32, ())])
    process = aggregators.PrecisionWeightedMeanFactory(num_clients=10).create(value_type, tff.TensorType(np.float32))
    rng = np.random.default_rng(0)
    values = [[rng.normal(size=3).astype(np.float32), np.float32(rng.normal())] for _ in range(4)]
    sigma_m_sq = [0.5, 1.0, 2.0, 0.1]
    flat = np.array([np.concatenate([v[0], [v[1]]]) for v in values], np.float64)
    first = process.next(process.initialize(), values, sigma_m_sq)
    # sigma_0^2 unknown: plain mean, variance estimated (trace, ddof 1), no precisions yet.
    np.testing.assert_allclose(np.concatenate([first.result[0], [first.result[1]]]), flat.mean(0), rtol=1e-5)
    np.testing.assert_allclose(first.state['sigma0_sq'], flat.var(0, ddof=1).sum(), rtol=1e-5)
    assert first.state['total_precision'] == 0.0
    second = process.next(first.state, values, sigma_m_sq)
    p = 1.0 / (first.state['sigma0_sq'] + np.array(sigma_m_sq))
    want = (p[:, None] * flat).sum(0) / p.sum()
    np.testing.assert_allclose(np.concatenate([second.result[0], [second.result[1]]]), want, rtol=1e-5)
    np.testing.assert_allclose(second.state['total_precision'], p.sum() * 10 / 4, rtol=1e-5)
    np.testing.assert_allclose(second.state['mean_sigma_m_sq'], np.mean(sigma_m_sq), rtol=1e-6)
    assert second.measurements['num_clients'] == 4


def test_fixed_sigma0_is_kept(tff_runtime):
    process = aggregators.PrecisionWeightedMeanFactory(5, fixed_sigma0_sq=2.0).create(
        tff.TensorType(np.float32), tff.TensorType(np.float32)
    )
    out = process.next(process.initialize(), [1.0, 3.0], [0.0, 2.0])
    np.testing.assert_allclose(out.result, (1 / 2 * 1 + 1 / 4 * 3) / (1 / 2 + 1 / 4), rtol=1e-6)
    assert out.state['sigma0_sq'] == 2.0


@pytest.mark.parametrize(
    'eta, sigma_sq, others', [(0.001, 0.02, 30.0), (0.01, 0.2, 5.0), (0.05, 0.01, 100.0), (0.03, 1e-4, 2.0)]
)
def test_local_steps_match_numpy(eta, sigma_sq, others):
    steps, exact_eta, defined = selffl.local_steps(eta, tf.constant(sigma_sq), tf.constant(others), 40)
    want_steps, rho = reference.local_steps(eta, sigma_sq, others, 40)
    assert int(steps) == want_steps
    assert bool(defined) == (eta / sigma_sq < 1)
    # `steps` quadratic steps of the corrected size contract by exactly rho.
    np.testing.assert_allclose((1 - float(exact_eta) / sigma_sq) ** want_steps, rho, rtol=1e-4)


def test_eq8_where_defined():
    # (1 - eta/sigma^2)^l = S/(1/sigma^2 + S): eta/sigma^2 = 0.1, S = 10, 1/sigma^2 = 10 -> l = log(0.5)/log(0.9) = 6.58
    steps, _, defined = selffl.local_steps(0.01, tf.constant(0.1), tf.constant(10.0), 40)
    assert bool(defined) and int(steps) == 7


def test_network_rule_is_calibrated_on_a_typical_client():
    def steps_for(sigma_sq, others=500.0, typical_sigma_sq=0.04):
        rho = lambda s: others / (1 / s + others)  # noqa: E731
        steps, _, defined = selffl.local_steps(
            0.03,
            tf.constant(sigma_sq),
            tf.constant(others),
            40,
            quadratic=False,
            typical_rho=tf.constant(rho(typical_sigma_sq)),
            default_steps=20,
        )
        assert not bool(defined)
        want = min(max(round(20 * np.log(rho(sigma_sq)) / np.log(rho(typical_sigma_sq))), 1), 40)
        assert int(steps) == want
        return int(steps)

    assert steps_for(0.04) == 20  # the typical client does the baseline's steps
    assert steps_for(0.08) == 10  # twice as uncertain: about half
    assert steps_for(0.02) == 39  # half as uncertain: about twice
    assert steps_for(0.005) == 40  # capped at l_max
    assert steps_for(10.0) == 1


def test_initialization_and_welford():
    init = selffl.initialization([tf.constant([1.0, 2.0])], [tf.constant([3.0, 0.0])], 2.0, 8.0)
    np.testing.assert_allclose(init[0].numpy(), [1.0 - 0.25 * 2.0, 2.0 + 0.25 * 2.0])
    history = np.random.default_rng(1).normal(size=(6, 2, 3))
    count, mean, m2 = tf.constant(0.0), [tf.zeros(3), tf.zeros(3)], tf.constant(0.0)
    for h in history:
        count, mean, m2 = selffl.welford_update(
            count, mean, m2, [tf.constant(h[0], tf.float32), tf.constant(h[1], tf.float32)]
        )
    flat = history.reshape(6, -1)
    np.testing.assert_allclose(float(m2) / (float(count) - 1), flat.var(0, ddof=1).sum(), rtol=1e-5)


def _gaussian_process(spec, **kwargs):
    model_fn = functools.partial(models.gaussian_mean, spec.feature_shape, 1)
    return selffl.build_selffl_process(
        spec,
        model_fn,
        selffl.SelfFLSettings(client_learning_rate=0.001),
        loss='gaussian',
        known_sigma0_sq=1.0,
        gaussian_noise_var=1.0,
        **kwargs,
    )


def test_tff_process_matches_numpy_iteration(tff_runtime, tmp_path):
    samples = reference.generate(20, seed=3)
    spec = reference.write_client_files(str(tmp_path / 'gauss'), samples, seed=3)
    process = _gaussian_process(spec)
    want_personal, want_global = reference.iterate(samples, 6, eta=0.001)
    state = process.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    for round_num in range(6):
        state, states, metrics = process.next(state, states)
        personal = np.array([float(s['personal'][0]) for s in states])
        np.testing.assert_allclose(personal, want_personal[round_num], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(float(state['model'][0]), want_global[round_num], atol=1e-5, rtol=1e-5)
    assert metrics['mean_active'] == 1.0
    theta_fl, _, z = reference.closed_forms(samples)
    assert np.abs(personal - theta_fl).max() < 0.2 * np.abs(theta_fl - z).max()


def test_server_smoothing_moves_the_global_model_by_w_of_the_round_estimate(tff_runtime, tmp_path):
    samples = reference.generate(8, seed=5)
    spec = reference.write_client_files(str(tmp_path / 'gauss'), samples, seed=5)
    states = [None] * len(spec.client_ids)

    def first_round(activity_rate, smoothing=0.0):
        model_fn = functools.partial(models.gaussian_mean, spec.feature_shape, 1)
        settings = selffl.SelfFLSettings(client_learning_rate=0.001, selffl_smoothing=smoothing)
        process = selffl.build_selffl_process(
            spec,
            model_fn,
            settings,
            activity_rate=activity_rate,
            loss='gaussian',
            known_sigma0_sq=1.0,
            gaussian_noise_var=1.0,
        )
        state = process.initialize()
        states[:] = [process.initial_client_state(c) for c in spec.client_ids]
        before = float(state['model'][0])
        return before, float(process.next(state, states)[0]['model'][0])

    before, estimate = first_round(1.0)  # C = 1: the global model becomes the round's estimate
    assert abs(estimate - before) > 1e-3
    for activity_rate, smoothing, w in [(0.25, 0.0, 0.25), (0.25, 0.8, 0.8), (1.0, 0.5, 0.5)]:
        start, after = first_round(activity_rate, smoothing)
        assert start == before
        np.testing.assert_allclose(after, (1 - w) * before + w * estimate, rtol=1e-5, atol=1e-6)


def test_iteration_approaches_the_closed_form_as_m_grows():
    relative = []
    for num_clients in (20, 80, 320, 1280):
        distances, shifts = [], []
        for seed in range(3):
            samples = reference.generate(num_clients, seed)
            theta_fl, theta_g, z = reference.closed_forms(samples)
            personal, global_ = reference.iterate(samples, 30, eta=0.001)
            distances.append(np.abs(personal[-1] - theta_fl).max())
            shifts.append(np.abs(theta_fl - z).max())
            assert abs(global_[-1] - theta_g) < 0.1
        assert np.mean(distances) < 0.1 * np.mean(shifts)
        relative.append(np.mean(distances) / np.mean(shifts))
    assert all(a > b for a, b in zip(relative, relative[1:])), relative


def test_classifier_mode_runs_and_only_sums_cross(tff_runtime, tmp_path):
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    settings = selffl.SelfFLSettings(
        client_learning_rate=0.1, batch_size=8, selffl_max_steps=10, selffl_default_steps=5
    )
    process = selffl.build_selffl_process(spec, model_fn, settings)
    assert audit.clients_to_server_intrinsics(process.next) <= {'federated_sum', 'federated_mean'}
    assert 'personal' not in str(process.next.type_signature.result.state)
    state = process.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    for _ in range(6):
        state, states, metrics = process.next(state, states)
    assert np.isfinite(metrics['train_loss']) and metrics['aggregator']['sigma0_sq'] > 0
    assert metrics['mean_active'] == 1.0
    assert all(1 <= s['local_steps'] <= 10 and s['var_count'] == 6 for s in states)
    # The round metric counts the SGD steps the clients took: their own (Eq. 8) step counts.
    assert metrics['mean_local_steps'] == pytest.approx(np.mean([s['local_steps'] for s in states]))
    results = process.evaluate(state, states)
    assert all(set(r) == {'global_model', 'personalized_model'} for r in results)


def test_bad_arguments(tmp_path):
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    with pytest.raises(ValueError, match='gaussian_noise_var'):
        selffl.build_selffl_process(spec, model_fn, loss='gaussian')
    with pytest.raises(ValueError, match='activity_rate'):
        selffl.build_selffl_process(spec, model_fn, activity_rate=0.0)
    with pytest.raises(TypeError, match='SelfFLSettings'):
        selffl.build_selffl_process(spec, model_fn, settings_lib.LocalTraining())


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(selffl_max_steps=0), 'selffl_max_steps must be >= 1, got 0'),
        (dict(selffl_default_steps=0), 'selffl_default_steps must be >= 1, got 0'),
        (dict(selffl_default_steps=50), 'selffl_default_steps must be <= selffl_max_steps (40), got 50'),
        (dict(warmup_rounds=-1), 'warmup_rounds must be >= 0, got -1'),
        (dict(selffl_smoothing=1.5), 'selffl_smoothing must be in [0, 1] (0: the activity rate), got 1.5'),
        (dict(client_learning_rate=0.0), 'client_learning_rate must be > 0, got 0.0'),
        (dict(batch_size=0), 'batch_size must be >= 1, got 0'),
    ],
)
def test_bad_settings_are_refused_in_one_line(tmp_path, changes, message):
    settings = selffl.SelfFLSettings(**changes)
    with pytest.raises(settings_lib.SettingsError) as error:
        settings.validate()
    assert str(error.value) == message and '\n' not in message
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    with pytest.raises(settings_lib.SettingsError) as error:
        selffl.build_selffl_process(spec, model_fn, settings)
    assert str(error.value) == message


def test_settings_are_the_papers_and_take_no_local_epochs():
    defaults = selffl.SelfFLSettings().validate()
    # §4.2: MNIST eta = 0.03, batch 10; l_max = 40; the baselines' 20 local steps.
    assert (defaults.client_learning_rate, defaults.batch_size) == (0.03, 10)
    assert (defaults.selffl_max_steps, defaults.selffl_default_steps, defaults.warmup_rounds) == (40, 20, 0)
    # Self-FL sets its own steps (Eq. 8): no local_epochs or local_steps to ignore.
    assert not {'local_epochs', 'local_steps'} & set(selffl.SelfFLSettings.field_names())


def test_experiment_writes_selffl_outputs(tiny_npz, tmp_path):
    from tff_pfl.program import experiment, run_config

    out = tmp_path / 'run'
    config = run_config.make_config(
        output_dir=str(out),
        algorithm='selffl',
        dataset=f'npz:{tiny_npz}',
        partition='ds1',
        classes_per_client=2,
        num_clients=4,
        rounds=3,
        client_fraction=0.5,
        settings=selffl.SelfFLSettings(
            batch_size=8, client_learning_rate=0.05, selffl_max_steps=8, selffl_default_steps=4
        ),
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    for name in ('local_steps.png', 'intra_client_variance.png'):
        assert (out / name).stat().st_size > 0, name
    assert {'local_steps', 'sigma_m_sq', 'num_participations'} <= set(result.clients[0])
    assert 'top_10_by_samples' in result.summary['personalized_model']
    assert result.rounds[0]['num_clients'] == 2 and result.rounds[0]['mean_local_steps'] == 4


def test_warm_start_rounds_are_plain(tff_runtime, tmp_path):
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    settings = selffl.SelfFLSettings(
        client_learning_rate=0.1, batch_size=8, selffl_max_steps=10, selffl_default_steps=3, warmup_rounds=3
    )
    process = selffl.build_selffl_process(spec, model_fn, settings)
    state = process.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    active = []
    for _ in range(6):
        state, states, metrics = process.next(state, states)
        active.append(metrics['mean_active'])
        if len(active) <= 3:
            assert metrics['mean_local_steps'] == 3
    assert active[:3] == [0.0, 0.0, 0.0] and active[-1] == 1.0
    # Variances are recorded only after the warm start.
    assert all(s['var_count'] == 3 for s in states)
