"""User-level DP: clipping, noise, adaptive clipping, accounting, the DP round, bad settings."""

import functools
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow_federated as tff
from tensorflow_federated.python.aggregators import differential_privacy

from processes import fedavg, selffl
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import aggregators, audit, privacy
from tff_pfl.program import algorithms, experiment, run_config, training_loop


def _aggregate(dp, values):
    """One aggregation of `values` (one float32 vector per client) by `dp.factory()`; returns (result, state)."""
    process = dp.factory().create(tff.TensorType(np.float32, [len(values[0])]))
    output = process.next(process.initialize(), [np.asarray(v, np.float32) for v in values])
    return np.asarray(output.result), output.state


def test_fixed_clip_scales_only_the_uploads_over_the_clip_and_divides_by_expected_clients(tff_runtime):
    big = np.array([3.0, 4.0, 0.0])  # norm 5: scaled to norm 2
    small = np.array([0.0, 1.0, 1.0])  # norm sqrt(2) < 2: unchanged
    dp = privacy.DPConfig(noise_multiplier=0.0, clients_per_round=4.0, clip=2.0)
    result, _ = _aggregate(dp, [big, small])
    np.testing.assert_allclose(result, (big * 2.0 / 5.0 + small) / 4.0, rtol=1e-6)


def test_noise_stddev_is_noise_multiplier_times_clip_over_expected_clients(tff_runtime):
    dim, z, clip, per_round = 40_000, 1.3, 0.7, 5.0
    dp = privacy.DPConfig(noise_multiplier=z, clients_per_round=per_round, clip=clip)
    result, _ = _aggregate(dp, [np.zeros(dim), np.zeros(dim)])
    want = z * clip / per_round
    # 40,000 draws: the sample stddev is within 2 % of the truth with probability > 0.999 (std error 0.35 %).
    assert np.std(result) == pytest.approx(want, rel=0.02)
    assert abs(np.mean(result)) < 4 * want / math.sqrt(dim)


def test_adaptive_clip_moves_to_the_target_quantile_of_the_norms(tff_runtime):
    norms = np.arange(1.0, 11.0)  # ten clients with norms 1..10: the median lies between 5 and 6
    values = [np.array([n, 0.0], np.float32) for n in norms]
    dp = privacy.DPConfig(noise_multiplier=0.0, clients_per_round=10.0, target_quantile=0.5, initial_clip=0.1)
    process = dp.factory().create(tff.TensorType(np.float32, [2]))
    state = process.initialize()
    clips = []
    for _ in range(80):
        output = process.next(state, values)
        state = output.state
        clips.append(float(output.measurements['dp_query_metrics']['clip']))
    assert clips[0] > 0.1 and clips[10] > clips[0]  # growing while every norm is above it
    assert 5.0 <= clips[-1] <= 6.0 * math.exp(0.2 * 0.5)  # settled at the median (one step of slack)


def test_round_event_is_the_event_the_aggregator_reports(tff_runtime):
    for dp in [
        privacy.DPConfig(noise_multiplier=1.1, clients_per_round=50.0, clip=1.0),
        privacy.DPConfig(noise_multiplier=1.1, clients_per_round=50.0, target_quantile=0.5),
    ]:
        _, state = _aggregate(dp, [np.ones(3)] * 2)
        reported = differential_privacy.extract_dp_event_from_state(state)
        assert _same_event(reported, dp.round_event()), (reported, dp.round_event())


def _same_event(a, b) -> bool:  # the aggregator's parameters are float32
    if isinstance(a, dp_accounting.ComposedDpEvent) and isinstance(b, dp_accounting.ComposedDpEvent):
        return len(a.events) == len(b.events) and all(map(_same_event, a.events, b.events))
    if isinstance(a, dp_accounting.GaussianDpEvent) and isinstance(b, dp_accounting.GaussianDpEvent):
        return a.noise_multiplier == pytest.approx(b.noise_multiplier, rel=1e-6)
    return False


def test_epsilon_equals_dp_accounting_directly_and_grows_with_rounds():
    dp = privacy.DPConfig(noise_multiplier=1.0, clients_per_round=100.0, clip=1.0)
    q, delta = 0.1, 1e-5
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), 50)
    assert privacy.epsilon(dp, q, 50, delta) == pytest.approx(direct.get_epsilon(delta), rel=1e-12)
    series = [privacy.epsilon(dp, q, t, delta) for t in (0, 1, 10, 50, 200)]
    assert series[0] == 0.0 and all(a < b for a, b in zip(series, series[1:]))
    # Everyone in every round: T Gaussian mechanisms compose to one with multiplier z / sqrt(T) (a closed form
    # for the RDP curve alpha T / (2 z^2)); the accountant's epsilon is that curve's.
    full = privacy.epsilon(dp, 1.0, 16, delta)
    assert full == pytest.approx(privacy.epsilon(privacy.DPConfig(0.25, 1.0, clip=1.0), 1.0, 1, delta), rel=1e-9)
    assert privacy.epsilon(privacy.DPConfig(0.0, 1.0, clip=1.0), q, 3, delta) == math.inf


def test_poisson_sampling_draws_each_client_with_probability_q():
    rng = np.random.default_rng(0)
    ids = [f'c{i}' for i in range(200)]
    counts = [len(training_loop.sample_clients(rng, ids, 0.1, poisson=True)) for _ in range(400)]
    # Binomial(200, 0.1): mean 20, variance 18.
    assert np.mean(counts) == pytest.approx(20.0, abs=4 * math.sqrt(18 / 400))
    assert np.var(counts) == pytest.approx(18.0, rel=0.25)
    assert min(counts) < 16 < 24 < max(counts)  # not a fixed size


def _train(process, spec, rounds):
    """`rounds` rounds of every client from the initial state; returns (server state, last metrics)."""
    state = process.initialize()
    clients = [process.initial_client_state(c) for c in spec.client_ids]
    for _ in range(rounds):
        state, clients, metrics = process.next(state, clients)
    return state, metrics


def test_without_noise_and_with_a_loose_clip_the_dp_round_is_the_plain_round(tmp_path, tff_runtime):
    # Equal client sizes: the plain example-weighted mean is the DP round's unweighted mean.
    spec = make_linear_problem(tmp_path / 'data', sizes=(30, 30, 30))
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
    loose = privacy.DPConfig(noise_multiplier=0.0, clients_per_round=3.0, clip=1e6)
    plain = fedavg.build_fedavg_process(spec, model_fn, settings, seed=3)
    private = fedavg.build_fedavg_process(spec, model_fn, settings, model_aggregator=loose.factory(), seed=3)
    states = {name: _train(process, spec, 3)[0]['model'] for name, process in (('plain', plain), ('private', private))}
    for got, want in zip(states['private'], states['plain']):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # And with a tight clip the two differ: the clip is applied.
    tight = privacy.DPConfig(noise_multiplier=0.0, clients_per_round=3.0, clip=1e-3)
    clipped = fedavg.build_fedavg_process(spec, model_fn, settings, model_aggregator=tight.factory(), seed=3)
    state = clipped.initialize()
    state, _, _ = clipped.next(state, [clipped.initial_client_state(c) for c in spec.client_ids])
    moved = np.sqrt(
        sum(np.sum((np.asarray(a) - np.asarray(b)) ** 2) for a, b in zip(state['model'], plain.initialize()['model']))
    )
    assert moved <= 1e-3 + 1e-7


def _selffl_aggregators(dp, size, num_clients):
    value_type, weight_type = tff.TensorType(np.float32, [size]), tff.TensorType(np.float32)
    plain = aggregators.PrecisionWeightedMeanFactory(num_clients).create(value_type, weight_type)
    private = aggregators.PrecisionWeightedMeanFactory(num_clients, dp=dp).create(value_type, weight_type)
    return plain, private


def _own(state):
    return {k: float(state[k]) for k in ('sigma0_sq', 'total_precision', 'mean_sigma_m_sq')}


def test_selffl_dp_record_without_noise_gives_the_plain_precision_weighted_mean(tff_runtime):
    rng = np.random.default_rng(0)
    values = [rng.normal(size=6).astype(np.float32) for _ in range(4)]
    values[0] *= 10.0  # over the clip: the DP round sees it scaled to norm `clip`
    clip = 2.0
    clipped = [v * min(1.0, clip / np.linalg.norm(v)) for v in values]
    # All <= clip^2 (sent whole), and none more than twice as precise as the typical client (no cap).
    sigmas = [np.float32(s) for s in (1.0, 1.5, 2.0, 2.5)]
    dp = privacy.DPConfig(noise_multiplier=0.0, clients_per_round=4.0, clip=clip)
    plain, private = _selffl_aggregators(dp, 6, num_clients=4)
    plain_state, private_state = plain.initialize(), private.initialize()
    for _ in range(3):  # round 1: sigma0 unknown, equal weights; then precision weights
        want = plain.next(plain_state, clipped, sigmas)
        got = private.next(private_state, values, sigmas)
        np.testing.assert_allclose(got.result, want.result, rtol=1e-5, atol=1e-6)
        plain_state, private_state = want.state, got.state
        for key, value in _own(plain_state).items():
            assert _own(private_state)[key] == pytest.approx(value, rel=1e-4), key
    # The record's clip: two vector parts bounded by the clip, three scalars by half of it.
    assert float(private_state['dp'][0].l2_norm_clip) == pytest.approx(clip * math.sqrt(2.75))
    # And the numbers themselves: sigma0^2 is the ddof-1 variance of the clipped values (Eq. 14).
    stacked = np.stack(clipped)
    assert _own(private_state)['sigma0_sq'] == pytest.approx(np.sum((stacked - stacked.mean(0)) ** 2) / 3, rel=1e-4)


def test_selffl_dp_noise_is_z_times_the_record_clip_and_sigma0_is_debiased(tff_runtime):
    dim, clients, z = 40_000, 10, 0.01
    rng = np.random.default_rng(1)
    values = [v * (0.9 / np.linalg.norm(v)) for v in rng.normal(size=(clients, dim)).astype(np.float32)]
    dp = privacy.DPConfig(noise_multiplier=z, clients_per_round=float(clients), clip=1.0)
    _, private = _selffl_aggregators(dp, dim, num_clients=clients)
    out = private.next(private.initialize(), values, [np.float32(1.0)] * clients)
    # Round 1 weighs every client 1: the result is (sum + noise) / (10 + noise' / 0.5), both noises of
    # stddev z sqrt(2.75) (the record's clip).
    noise = np.asarray(out.result) - np.mean(values, axis=0)
    assert np.std(noise) == pytest.approx(z * math.sqrt(2.75) / clients, rel=0.03)
    # The noise adds about dim (z sqrt 2.75)^2 = 11 to |sum v|^2 = 8.1: without removing it the estimate
    # would be (8.1 - 19.1 / 10) / 9 = 0.69 instead of 0.81.
    stacked = np.stack(values)
    want = np.sum((stacked - stacked.mean(0)) ** 2) / (clients - 1)
    assert float(out.state['sigma0_sq']) == pytest.approx(want, abs=0.03)


def test_selffl_dp_round_without_noise_and_a_loose_clip_is_the_plain_round(tmp_path, tff_runtime):
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    settings = selffl.SelfFLSettings(batch_size=8, selffl_default_steps=3, selffl_max_steps=6)
    loose = privacy.DPConfig(noise_multiplier=0.0, clients_per_round=3.0, clip=1e3)
    trained = {}
    for name, dp in (('plain', None), ('private', loose)):
        process = selffl.build_selffl_process(spec, model_fn, settings, dp=dp, seed=3)
        trained[name] = _train(process, spec, 4)[0]
    for got, want in zip(trained['private']['model'], trained['plain']['model']):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert _own(trained['private']['aggregator_state']) == pytest.approx(
        _own(trained['plain']['aggregator_state']), rel=1e-3
    )


def test_local_gaussian_clips_and_adds_fresh_noise_of_stddev_twice_z_clip(tff_runtime):
    dim, clip, z = 20_000, 2.0, 0.5
    value = np.full(dim, 10.0 / math.sqrt(dim), np.float32)  # norm 10: clipped to norm 2

    def on_clients(noise_multiplier):
        @tff.tensorflow.computation(tff.TensorType(np.float32, [dim]))
        def upload(v):
            return privacy.local_gaussian(v, clip, noise_multiplier)

        @tff.federated_computation(tff.FederatedType(tff.TensorType(np.float32, [dim]), tff.CLIENTS))
        def round_(values):
            return tff.federated_map(upload, values)

        return [np.asarray(u) for u in round_([value] * 3)]

    for clipped in on_clients(0.0):
        np.testing.assert_allclose(clipped, value * clip / 10.0, rtol=1e-5)
    noises = [u - value * clip / 10.0 for u in on_clients(z) + on_clients(z)]
    for noise in noises:  # 20,000 draws each: the sample stddev's standard error is 0.5 %
        assert np.std(noise) == pytest.approx(2 * z * clip, rel=0.03)
    # Fresh for every client and every round: no two uploads share their noise.
    correlations = np.corrcoef(np.stack(noises))[np.triu_indices(len(noises), 1)]
    assert np.max(np.abs(correlations)) < 0.05


def test_noised_predictions_are_projected_back_to_distributions():
    from processes import ktpfl

    noised = np.array(
        [[[0.5, -0.2, 1.5], [-1.0, -0.1, 0.0]], [[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]], [[9.0, 9.0, 9.0]] * 2],
        np.float32,
    )
    present = np.array([1.0, 1.0, 0.0], np.float32)
    got = np.asarray(ktpfl.noised_to_distributions(noised, present))
    want = np.array(
        [[[0.25, 0.0, 0.75], [1 / 3, 1 / 3, 1 / 3]], [[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]], [[0.0] * 3] * 2], np.float32
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('name', ['ktpfl', 'ktpfl_homo'])
def test_ktpfl_family_noises_on_the_clients_and_without_noise_is_the_plain_round(name, tmp_path, tff_runtime):
    spec = make_linear_problem(tmp_path / 'data', sizes=(30, 30, 30), public_examples=12)
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    extra = {'architectures': ('logistic',)} if name == 'ktpfl' else {'model': 'logistic'}
    trained = {}
    for label, dp in [
        ('plain', {}),
        ('loose', {'dp_noise_multiplier': 0.0, 'dp_clip': 1e4}),
        ('noised', {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0}),
    ]:
        config = run_config.make_config(
            output_dir='', algorithm=name, num_clients=3, local_epochs=1, batch_size=8, **extra, **dp
        )
        config.validate()
        process = algorithms.build(name, config.settings, spec, model_fn, config)
        # The noise is drawn where the uploads are made: inside the computation mapped over CLIENTS.
        draws = 'RandomStandardNormal' in audit.clients_tensorflow_ops(process.device.phases['share'])
        assert draws == (label == 'noised'), label
        if label != 'noised':  # equal client sizes: DP's unit weights are the plain D_n / D
            trained[label] = _train(process, spec, 2)[0]
    np.testing.assert_allclose(trained['loose']['coefficients'], trained['plain']['coefficients'], rtol=1e-5)
    # Local DP is accounted per client, every round, whatever the sampling.
    local = _config(algorithm=name, dp_noise_multiplier=1.0, dp_clip=1.0, client_fraction=0.5, **extra)
    assert local.dp_sampling_probability() == 1.0
    assert _config(dp_noise_multiplier=1.0, dp_clip=1.0, client_fraction=0.5).dp_sampling_probability() == 0.5


@pytest.mark.parametrize('secure', [False, True])
def test_feddf_dp_round_without_noise_and_a_loose_clip_is_the_plain_round(secure, tmp_path, tff_runtime):
    # Equal client sizes and no server distillation: FedDF is per-architecture FedAvg, and the DP round's
    # unweighted mean of the updates over the expected clients is the plain example-weighted mean.
    spec = make_linear_problem(tmp_path / 'data', sizes=(30, 30, 30), public_examples=12)
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    common = {'architectures': ('logistic', 'mnist_dnn'), 'local_epochs': 1, 'batch_size': 8}
    trained = {}
    for label, extra in [
        ('plain', {}),
        ('loose', {'dp_noise_multiplier': 0.0, 'dp_clip': 1e3, 'secure_aggregation': secure}),
    ]:
        config = run_config.make_config(
            output_dir='', algorithm='feddf', num_clients=3, feddf_distill_epochs=0, **common, **extra
        )
        config.validate()
        process = algorithms.build('feddf', config.settings, spec, model_fn, config)
        trained[label] = _train(process, spec, 2)[0]['prototypes']
    # Architecture 0 (clients 0 and 2) averages two clients, architecture 1 keeps client 1's model.
    atol = 1e-5 if secure else 1e-6
    np.testing.assert_allclose(trained['loose'], trained['plain'], rtol=1e-4, atol=atol)


def _config(**fields):
    return run_config.ExperimentConfig.from_dict({'output_dir': '', 'num_clients': 100, **fields})


@pytest.mark.parametrize(
    'fields, message',
    [
        ({'dp_noise_multiplier': -1.0, 'dp_clip': 1.0}, 'dp_noise_multiplier must be >= 0, got -1.0'),
        ({'dp_noise_multiplier': 1.0, 'dp_clip': 0.0}, 'dp_clip must be > 0, got 0.0'),
        ({'dp_noise_multiplier': 1.0, 'dp_target_quantile': 1.0}, 'dp_target_quantile must be in (0, 1), got 1.0'),
        ({'dp_noise_multiplier': 1.0}, 'give --dp_clip (fixed clipping) or --dp_target_quantile'),
        ({'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'dp_target_quantile': 0.5}, 'give --dp_clip'),
        ({'dp_clip': 1.0}, '--dp_clip needs --dp_noise_multiplier (user-level DP)'),
        ({'dp_target_epsilon': 3.0}, '--dp_target_epsilon needs --dp_noise_multiplier'),
        (
            {'dp_noise_multiplier': 0.0, 'dp_clip': 1.0, 'dp_target_epsilon': 3.0},
            '--dp_target_epsilon needs --dp_noise_multiplier > 0',
        ),
        ({'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'dp_delta': 1.0}, 'dp_delta must be in (0, 1), got 1.0'),
        (
            {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'dp_initial_clip': 0.5},
            '--dp_initial_clip applies to adaptive clipping',
        ),
        (
            {'dp_noise_multiplier': 2.0, 'dp_target_quantile': 0.5, 'client_fraction': 0.1},
            'adaptive clipping cannot reach noise multiplier 2 with 10 expected clients per round',
        ),
        (
            {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'algorithm': 'local'},
            '--dp_noise_multiplier: local uploads nothing but training metrics',
        ),
        (
            {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'algorithm': 'kdpdfl'},
            '--dp_noise_multiplier: kdpdfl does not take user-level DP yet',
        ),
        (
            {'secure_aggregation': True, 'algorithm': 'pfeddf'},
            "--secure_aggregation: FedDF's plain round averages raw parameters and logits",
        ),
        (
            {'dp_noise_multiplier': 1.0, 'dp_target_quantile': 0.5, 'algorithm': 'ktpfl'},
            "the KT-pFL family's DP is local (each client noises its own upload): give --dp_clip",
        ),
        (
            {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'secure_aggregation': True, 'algorithm': 'ktpfl_homo'},
            "--secure_aggregation: the server needs each KT-pFL client's upload on its own (a row of its own)",
        ),
        (
            {'secure_aggregation': True, 'algorithm': 'selffl'},
            "--secure_aggregation: Self-FL's sums need a bounded range",
        ),
        (
            {'dp_noise_multiplier': 1.0, 'dp_target_quantile': 0.5, 'algorithm': 'selffl'},
            "Self-FL's DP record bounds its scalar parts by the clip",
        ),
        (
            {'secure_aggregation': True, 'workers': ('localhost:1', 'localhost:2')},
            '--secure_aggregation runs on one worker',
        ),
    ],
)
def test_bad_privacy_settings_are_one_line(fields, message):
    with pytest.raises(run_config.ConfigError) as error:
        _config(**fields).validate()
    assert message in str(error.value) and '\n' not in str(error.value)


def test_a_target_epsilon_the_schedule_exceeds_is_refused_with_the_epsilon_it_would_reach():
    fields = {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'client_fraction': 0.1, 'dp_delta': 1e-5}
    reach = privacy.epsilon(_config(**fields).dp_mechanism(), 0.1, 100, 1e-5)
    _config(**fields, rounds=100, dp_target_epsilon=reach * 1.01).validate()
    with pytest.raises(run_config.ConfigError, match=f'reach epsilon {reach:.5g} at delta 1e-05'):
        _config(**fields, rounds=100, dp_target_epsilon=reach * 0.99).validate()
    # The default delta is 1 / N^1.1.
    assert _config(**fields).privacy.delta_for(1000) == 1e-5
    assert _config(**{k: v for k, v in fields.items() if k != 'dp_delta'}).privacy.delta_for(1000) == pytest.approx(
        1000**-1.1
    )


def test_a_dp_run_reports_epsilon_after_every_round(tmp_path, tff_runtime):
    out = str(tmp_path / 'run')
    config = run_config.make_config(
        output_dir=out,
        algorithm='persfl',
        num_clients=12,
        rounds=3,
        client_fraction=0.5,
        temperatures=(1.0,),
        imitations=(0.5,),
        distill_epochs=1,
        dp_noise_multiplier=0.5,
        dp_target_quantile=0.5,
        dp_delta=1e-3,
    )
    result = experiment.run_experiment(config, log=lambda line: None)
    dp = config.dp_mechanism(12)
    assert dp.clients_per_round == 6.0
    for row in result.rounds:
        assert row['dp_epsilon'] == pytest.approx(privacy.epsilon(dp, 0.5, row['round'], 1e-3), rel=1e-9)
        assert row['aggregator_dp_query_metrics_clip'] > 0  # the adaptive clip, per round
    with open(f'{out}/metrics.csv') as f:
        assert 'dp_epsilon' in f.readline()
    with open(f'{out}/report.md') as f:
        report = f.read()
    assert "User-level DP (stage 1's model updates (stage 2 stays on the clients)): noise multiplier 0.5" in report
    assert f'epsilon = {result.rounds[-1]["dp_epsilon"]:.4g} at delta = 0.001 after 3 rounds' in report


def test_an_interrupted_dp_run_resumes_from_its_checkpoint_with_its_aggregator_state(tmp_path, monkeypatch):
    # No noise, so that the resumed run can be compared with an uninterrupted one number for number.
    fields = dict(
        algorithm='fedavg',
        num_clients=12,
        rounds=4,
        client_fraction=0.5,
        checkpoint_every=2,
        dp_noise_multiplier=0.0,
        dp_target_quantile=0.5,
    )
    whole = experiment.run_experiment(run_config.make_config(output_dir=str(tmp_path / 'whole'), **fields))
    calls = []
    sample = training_loop.sample_clients

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return sample(*args, **kwargs)

    config = run_config.make_config(output_dir=str(tmp_path / 'cut'), **fields)
    monkeypatch.setattr(training_loop, 'sample_clients', interrupted)
    with pytest.raises(KeyboardInterrupt):
        experiment.run_experiment(config)
    monkeypatch.undo()
    resumed = experiment.run_experiment(config)  # from the round-2 checkpoint, DP query state included
    clip = 'aggregator_dp_query_metrics_clip'
    assert [r[clip] for r in resumed.rounds] == pytest.approx([r[clip] for r in whole.rounds], rel=1e-6)
    assert [r['dp_epsilon'] for r in resumed.rounds] == [r['dp_epsilon'] for r in whole.rounds]
    for got, want in zip(resumed.state['model'], whole.state['model']):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_secure_aggregation_gives_the_plain_round(tmp_path, tff_runtime):
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
    models_after = []
    for aggregator in (None, privacy.secure_mean_factory(max(spec.split_sizes['train']))):
        process = fedavg.build_fedavg_process(spec, model_fn, settings, model_aggregator=aggregator, seed=3)
        state, metrics = _train(process, spec, 2)
        models_after.append(state['model'])
    # The same example-weighted mean, up to the 32-bit quantization of the secure sum's range.
    for secure, plain in zip(models_after[1], models_after[0]):
        np.testing.assert_allclose(secure, plain, atol=1e-5)
    assert metrics['aggregator']['mean_value']['secure_upper_clipped_count'] == 0


@pytest.mark.parametrize('name', sorted(a for a in algorithms.names() if algorithms.get(a).privacy.uploads))
def test_the_audit_reads_secure_and_dp_aggregation_from_the_round(name, tmp_path):
    spec = make_linear_problem(tmp_path / 'data', public_examples=12)
    # The model the algorithm runs on vector data (FedPer, FedRep, LG-FedAvg and FedBN need more than one layer).
    model_name = algorithms.get(name).default_models.get('synthetic', 'logistic')
    model_fn = functools.partial(models.get(model_name), spec.feature_shape, spec.num_classes)
    # The uploads carry at least one whole layer of the model (LG-FedAvg's, its classifier alone).
    layer_bytes = 4 * min(
        sum(int(np.prod(w.shape)) for w in layer.trainable_weights)
        for layer in model_fn().layers
        if layer.trainable_weights
    )
    built = {}
    local = algorithms.get(name).privacy.local
    own = {'architectures': ('logistic',)} if algorithms.get(name).own_architectures else {'model': model_name}
    for label, extra in [
        ('plain', {}),
        ('dp+secure', {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0, 'secure_aggregation': not local}),
    ]:
        config = run_config.make_config(output_dir='', algorithm=name, num_clients=3, **own, **extra)
        config.validate()
        built[label] = algorithms.build(name, config.settings, spec, model_fn, config)
    for label, process in built.items():
        # What crosses from CLIENTS to SERVER as large as a layer of the model (the uploads) and how.
        uploads = {uri for uri, t in audit.clients_to_server_values(process.next) if audit.type_bytes(t) >= layer_bytes}
        if label == 'plain' or local:  # local DP: noised on the clients, summed in plain slots
            assert uploads and not uploads & {'federated_secure_sum_bitwidth'}, uploads
        else:
            assert uploads == {'federated_secure_sum_bitwidth'}, uploads
        dp_state = 'l2_norm_clip' in str(process.next.type_signature.parameter[0])
        assert dp_state == (label != 'plain' and not local)


def test_what_stays_on_the_clients_under_dp_never_crosses(tmp_path):
    """PersFL's stage 2, FedPer's head, Ditto's v and APFL's v and alpha need no noise: they never cross."""
    spec = make_linear_problem(tmp_path / 'data')
    dp = {'dp_noise_multiplier': 1.0, 'dp_clip': 1.0}
    built = {}
    for name, model_name in [
        ('persfl', 'logistic'),
        ('fedper', 'mnist_dnn'),
        ('ditto', 'logistic'),
        ('apfl', 'logistic'),
    ]:
        model_fn = functools.partial(models.get(model_name), spec.feature_shape, spec.num_classes)
        config = run_config.make_config(output_dir='', algorithm=name, num_clients=3, model=model_name, **dp)
        config.validate()
        built[name] = algorithms.build(name, config.settings, spec, model_fn, config)
    uploads = {
        name: ' '.join(str(t) for _, t in audit.clients_to_server_values(process.next))
        for name, process in built.items()
    }
    # PersFL: stage 2 (teacher, grid, student) sends nothing; stage 1 sends one model's update.
    assert audit.clients_to_server_intrinsics(built['persfl'].personalize) == set()
    # FedPer: the base ([4, 100], [100]) crosses, the head ([100, 3], [3]) does not.
    assert 'float32[4,100]' in uploads['fedper'] and 'float32[100,3]' not in uploads['fedper']
    # Ditto and APFL: one model's worth (the global model's update), never the personal v (nor alpha).
    for name in ('ditto', 'apfl', 'persfl'):
        assert uploads[name].count('float32[4,3]') == 1 and 'alpha' not in uploads[name], name


def test_noise_multiplier_for_a_target_epsilon_reaches_it():
    q, rounds, delta = 0.1, 200, 1e-5
    for target in (1.0, 3.0, 8.0):
        z = privacy.noise_multiplier_for(target, q, rounds, delta)
        at = privacy.epsilon(privacy.DPConfig(z, 100.0, clip=1.0), q, rounds, delta)
        below = privacy.epsilon(privacy.DPConfig(z - 1e-3, 100.0, clip=1.0), q, rounds, delta)
        assert at <= target < below, (target, z, at, below)


def test_dp_noise_script_prints_calibrated_multipliers(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks', 'dp_noise.py')
    spec = importlib.util.spec_from_file_location('dp_noise', path)
    dp_noise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dp_noise)
    args = ['--epsilons=2', '--client_fraction=0.1', '--rounds=50', '--num_clients=1000']
    assert dp_noise.main(args) == 0
    line = capsys.readouterr().out.strip()
    z = privacy.noise_multiplier_for(2.0, 0.1, 50, 1000**-1.1, clients_per_round=100.0)
    assert line.startswith(f'epsilon 2: dp_noise_multiplier = {math.ceil(z * 1e4) / 1e4:.4f} (reaches ')
    with pytest.raises(SystemExit) as exited:
        dp_noise.main(['--epsilons=-1', '--client_fraction=0.1', '--rounds=50', '--num_clients=1000'])
    assert exited.value.code == 2


def _uploads(name, spec, model_fn):
    extra = {'architectures': ('logistic',)} if algorithms.get(name).own_architectures else {'model': 'logistic'}
    config = run_config.make_config(output_dir='', algorithm=name, num_clients=3, **extra)
    process = algorithms.build(name, config.settings, spec, model_fn, config)
    phases = process.device.phases if process.device is not None else {'next': process.next}
    if process.device is not None:
        phases = {**phases, 'in_process': process.next}
    return {
        phase: [(uri, str(t.member)) for uri, t in audit.clients_to_server_values(comp)]
        for phase, comp in phases.items()
    }


def test_what_the_algorithms_without_dp_upload(tmp_path):
    """docs/privacy.md's table, read from the rounds: N = 3 clients, P = 12 public examples, C = 3, D = 15."""
    spec = make_linear_problem(tmp_path / 'data', public_examples=12)
    model_fn = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    metrics = '<loss_sum=float32,num_correct=float32,num_examples=float32,num_clients=float32,local_steps=float32>'
    uploads = {name: _uploads(name, spec, model_fn) for name in ('selffl', 'ktpfl', 'ktpfl_homo', 'feddf', 'kdpdfl')}
    (selffl,) = [v for k, v in uploads['selffl'].items() if k != 'in_process']
    assert selffl[0] == (
        'federated_sum',
        '<weighted=<float32[4,3],float32[3]>,precision=float32,value=<float32[4,3],float32[3]>,square=float32,'
        'count=float32,sigma_sum=float32,sigma_count=float32>',
    )
    # KT-pFL: every client's soft predictions, example count and presence in its own slot.
    assert uploads['ktpfl']['share'] == [
        ('federated_sum', 'float32[3,12,3]'),
        ('federated_sum', 'float32[3]'),
        ('federated_sum', 'float32[3]'),
        ('federated_sum', metrics),
    ]
    assert uploads['ktpfl']['distill'] == [('federated_mean', 'float32')]
    assert uploads['ktpfl_homo']['share'][0] == ('federated_sum', 'float32[3,15]')
    # In process, the same values, each client's with its index (the server keeps the round's rows).
    assert uploads['ktpfl']['in_process'][0] == ('federated_aggregate', '<index=int32,value=float32[12,3]>')
    assert uploads['ktpfl_homo']['in_process'][0] == ('federated_aggregate', '<index=int32,value=float32[15]>')
    (feddf,) = [v for k, v in uploads['feddf'].items() if k != 'in_process']
    assert feddf[:3] == [
        ('federated_sum', 'float32[1,15]'),
        ('federated_sum', 'float32[1]'),
        ('federated_mean', 'float32[12,3]'),
    ]
    (kdpdfl,) = [v for k, v in uploads['kdpdfl'].items() if k != 'in_process']
    slots = kdpdfl[1][1]
    assert kdpdfl[0] == ('federated_sum', f'<float32[{slots[8:-1]},4,3],float32[{slots[8:-1]},3]>')
    assert slots.startswith('float32[')


def test_a_weight_the_secure_sum_cannot_hold_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy, 'SECURE_WEIGHT_LIMIT', 10)  # Synthetic(1,1)'s clients have more examples
    out = tmp_path / 'run'
    config = run_config.make_config(output_dir=str(out), num_clients=5, rounds=1, secure_aggregation=True)
    with pytest.raises(run_config.ConfigError, match='more than the secure sum of weights holds \\(10\\)'):
        experiment.run_experiment(config, log=lambda line: None)
    assert not out.exists() and list(tmp_path.iterdir()) == []
