"""No silent stall, no silent divergence: the pre-run warnings and the progress lines' tags."""

import dataclasses
import math
import types

import pytest

from tff_pfl import algorithm as algorithm_lib
from tff_pfl.program import algorithms, experiment, health, run_config, run_report, training_loop


def _config(**values):
    return run_config.make_config(output_dir='/tmp/unused', **values).validate()


def _named(warnings, name):
    return [w for w in warnings if w.startswith(f'{name}:') or w.startswith(f'{name} ')]


# --- before round 1: server steps -------------------------------------------------------------


@pytest.mark.parametrize('w, rounds', [(1e-4, 200), (0.01, 60), (0.1, 5), (0.5, 1)])
def test_share_moved_is_the_closed_form(w, rounds):
    assert health.share_moved(w, rounds) == pytest.approx(1 - (1 - w) ** rounds, rel=1e-12)
    assert health.share_moved(1.0, rounds) == 1.0 and health.share_moved(3.0, rounds) == 1.0


def test_selffl_at_the_paper_activity_rate_of_a_million_clients_warns_and_names_the_setting():
    config = _config(algorithm='selffl', num_clients=1_000_000, client_fraction=1e-4, rounds=200)
    (line,) = health.pre_run_warnings(config)
    assert line.startswith('selffl_smoothing:') and 'w = 0.0001' in line and 'client_fraction 0.0001' in line
    assert line.endswith("set selffl_smoothing, e.g. 1 (the round's estimate as it is)")
    # 1 - (1 - 1e-4)^200 = 1.98 % of the way.
    assert f'{100 * (1 - (1 - 1e-4) ** 200):.3g} %' == '1.98 %' and '= 1.98 % of the way in 200 rounds' in line
    config = _config(algorithm='selffl', num_clients=1_000_000, client_fraction=1e-4, rounds=200, selffl_smoothing=0.1)
    assert not health.pre_run_warnings(config)


@pytest.mark.parametrize('rounds', [1, 60, 200])
def test_the_smoothing_warning_fires_below_half_the_way_and_not_above(rounds):
    boundary = 1 - 0.5 ** (1 / rounds)  # 1 - (1 - w)^R = 0.5
    for factor, fires in ((1 - 1e-6, True), (1 + 1e-6, False)):
        w = boundary * factor
        explicit = _config(algorithm='selffl', rounds=rounds, selffl_smoothing=w)
        assert bool(_named(health.pre_run_warnings(explicit), 'selffl_smoothing')) is fires
        # The default w = 0 is the activity rate C = client_fraction.
        implicit = _config(algorithm='selffl', rounds=rounds, num_clients=10**7, client_fraction=w)
        assert health.smoothing_weight(implicit) == w
        assert bool(_named(health.pre_run_warnings(implicit), 'selffl_smoothing')) is fires


@pytest.mark.parametrize('algorithm, name', [('fedavg', 'server_learning_rate'), ('pfedme', 'pfedme_beta')])
def test_a_server_step_that_covers_under_half_the_way_warns(algorithm, name):
    rounds = 100
    boundary = 1 - 0.5 ** (1 / rounds)
    below = health.pre_run_warnings(_config(algorithm=algorithm, rounds=rounds, **{name: boundary * (1 - 1e-6)}))
    above = health.pre_run_warnings(_config(algorithm=algorithm, rounds=rounds, **{name: boundary * (1 + 1e-6)}))
    assert len(_named(below, name)) == 1 and 'raise ' + name in below[0] and not above
    assert not health.pre_run_warnings(_config(algorithm=algorithm))  # the defaults move


# --- before round 1: learning rates ----------------------------------------------------------


def _learning_rates(algorithm):
    settings = algorithms.get(algorithm).settings
    return [
        f.name
        for f in dataclasses.fields(settings)
        if f.name.endswith('learning_rate') and f.name not in health.SERVER_STEPS
    ]


@pytest.mark.parametrize('algorithm', algorithms.names())
def test_every_learning_rate_below_the_floor_warns_naming_itself(algorithm):
    names = _learning_rates(algorithm)
    assert 'client_learning_rate' in names
    assert not health.pre_run_warnings(_config(algorithm=algorithm))
    for name in names:
        at = health.pre_run_warnings(_config(algorithm=algorithm, **{name: health.MIN_LEARNING_RATE}))
        below = health.pre_run_warnings(_config(algorithm=algorithm, **{name: health.MIN_LEARNING_RATE * 0.999}))
        assert not at, (name, at)
        assert len(below) == 1 and below[0].startswith(f'{name} ') and f'raise {name}' in below[0]


# --- before round 1: DP noise against the clip ------------------------------------------------


def _dp(algorithm, z, **values):
    return _config(algorithm=algorithm, dp_noise_multiplier=z, dp_clip=1.0, **values)


@pytest.mark.parametrize(
    'algorithm, d, n, boundary_z',
    [
        # central DP: noise norm z C sqrt(d) / n against the clip C
        ('fedavg', 7_850, 100.0, 100.0 / math.sqrt(7_850)),
        # Self-FL's record: sqrt(2.75) C noise scale, mean over sum(w_m) ~ n / 2
        ('selffl', 7_850, 100.0, 100.0 / (2 * math.sqrt(2.75) * math.sqrt(7_850))),
        # local DP: 2 z C per coordinate of each upload, mean of n: 2 z C sqrt(d / n)
        ('ktpfl_homo', 610, 10.0, 1 / (2 * math.sqrt(610 / 10.0))),
    ],
)
def test_dp_noise_warns_when_its_norm_on_the_mean_exceeds_the_clip(algorithm, d, n, boundary_z):
    upload = [algorithm_lib.Upload(d, n)]
    assert health.dp_noise_ratio(_dp(algorithm, boundary_z), upload[0]) == pytest.approx(1.0)
    above = health.pre_run_warnings(_dp(algorithm, boundary_z * (1 + 1e-6)), upload)
    below = health.pre_run_warnings(_dp(algorithm, boundary_z * (1 - 1e-6)), upload)
    assert len(above) == 1 and above[0].startswith('dp_noise_multiplier ') and not below
    assert f'd = {d:,}' in above[0] and f'n = {n:g}' in above[0]


def test_dp_checks_the_worst_of_several_means_and_skips_without_uploads():
    config = _dp('feddf', 1.0)
    uploads = [algorithm_lib.Upload(100, 20.0, 'logistic'), algorithm_lib.Upload(10_000, 20.0, 'mnist_dnn')]
    (line,) = health.pre_run_warnings(config, uploads)
    assert '(mnist_dnn)' in line and '5 x the norm' in line  # sqrt(10,000) / 20
    assert not health.pre_run_warnings(config) and not health.pre_run_warnings(config, uploads[:1])


def test_dp_uploads_count_the_models_parameters_over_the_expected_clients():
    config = _dp('fedavg', 1.0, client_fraction=0.5, num_clients=30)
    spec = types.SimpleNamespace(num_clients=30, feature_shape=(60,), num_classes=10)
    process = types.SimpleNamespace(extras={})
    assert health.dp_uploads(config, spec, process) == [algorithm_lib.Upload(60 * 10 + 10, 15.0)]
    assert health.dp_uploads(_config(), spec, process) == []


# --- during the run: the progress lines' tags ------------------------------------------------


def _row(round_num, loss=2.0, accuracy=None, model='global_model'):
    row = {'round': round_num, 'train_loss': loss, 'train_accuracy': 0.5, 'round_seconds': 0.1}
    if accuracy is not None:
        row[f'test_{model}_accuracy_mean'] = accuracy
    return row


def test_diverging_against_the_first_round():
    monitor = health.RunMonitor(rounds=10, num_classes=None)
    assert monitor.observe(_row(1, 2.3)) == []
    assert monitor.observe(_row(2, 229.9)) == []  # 100 x 2.3 = 230
    (tag,) = monitor.observe(_row(3, 230.1))
    assert tag == "DIVERGING: train_loss 230, 1e+02x round 1's"
    assert monitor.observe(_row(4, 1.0)) == []
    assert monitor.warnings == [f'round 3: {tag}; the run diverged, last at round 3 (train_loss 230)']


def test_diverging_against_a_uniform_guess_from_round_one():
    bound = health.DIVERGE_UNIFORM * math.log(10)  # 2302.6
    monitor = health.RunMonitor(rounds=3, num_classes=10)
    assert monitor.observe(_row(1, bound * (1 - 1e-6))) == []
    monitor = health.RunMonitor(rounds=3, num_classes=10)
    (tag,) = monitor.observe(_row(1, 1.18e10))
    assert tag == "DIVERGING: train_loss 1.18e+10, 5.1e+09x a uniform guess's ln(10) = 2.3"
    monitor.observe(_row(2, 1.2e10))
    monitor.observe(_row(3, 1.03e10))
    assert monitor.warnings == [f'round 1: {tag}; the run diverged: still at round 3, its last (train_loss 1.03e+10)']
    assert health.RunMonitor(3, 10).observe(_row(1, float('nan'))) == ['DIVERGING: train_loss nan']


@pytest.mark.parametrize('num_classes, margin', [(2, 0.05), (10, 0.05), (100, 0.005)])
def test_stalled_at_chance_from_a_quarter_of_the_rounds(num_classes, margin):
    chance = 1 / num_classes
    assert health.stall_margin(num_classes) == pytest.approx(margin)
    assert health.stall_from_round(200) == 50 and health.stall_from_round(3) == 1 and health.stall_from_round(10) == 3
    monitor = health.RunMonitor(rounds=200, num_classes=num_classes)
    assert monitor.observe(_row(49, accuracy=chance)) == []  # before a quarter of the rounds
    assert monitor.observe(_row(50, accuracy=chance + margin * 1.001)) == []
    (tag,) = monitor.observe(_row(60, accuracy=chance + margin * 0.999))
    assert tag.startswith('STALLED: global model at chance (') and tag.endswith('after 60 of 200 rounds')
    assert monitor.observe(_row(61)) == []  # not evaluated: nothing to say
    assert monitor.warnings == [f'round 60: {tag}']
    monitor.observe(_row(100, accuracy=0.9))
    assert monitor.warnings[1] == 'round 100: global model off chance (90.0 %)'


def test_stall_reads_the_global_model_else_the_first_evaluated_one():
    tag = health.RunMonitor(200, 10).observe(_row(50, accuracy=0.103))
    assert tag == ['STALLED: global model at chance (10.3 %, chance 10.0 %) after 50 of 200 rounds']
    (tag,) = health.RunMonitor(4, 10).observe(_row(1, accuracy=0.1, model='personalized'))
    assert tag.startswith('STALLED: personalized at chance')
    assert health.RunMonitor(4, None).observe(_row(4, accuracy=0.0)) == []


def test_the_progress_line_ends_with_the_tags():
    row = _row(50, 1.2e10)
    plain = training_loop.progress_line('round 50/200', 1, 1, row, {}, 0.0)
    tags = ['DIVERGING: x', 'STALLED: y']
    tagged = training_loop.progress_line('round 50/200', 1, 1, row, {}, 0.0, tags)
    assert tagged == plain + '  DIVERGING: x  STALLED: y' and plain.endswith('ETA 0:00:00')


def test_the_report_has_a_warnings_section_only_with_warnings():
    result = types.SimpleNamespace(warnings=[])
    assert run_report.warning_lines(result) == []
    result.warnings = ['before round 1: a', 'round 3: DIVERGING: b']
    assert run_report.warning_lines(result) == ['', '## Warnings', '', '- before round 1: a', '- round 3: DIVERGING: b']


# --- end to end ------------------------------------------------------------------------------


def test_a_run_whose_loss_explodes_says_it_diverged(tmp_path):
    """lr 1e9 on Synthetic(1,1): a loss of about 1e10 from round 1, finite, so the run trains every round."""
    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'), num_clients=4, rounds=3, client_learning_rate=1e9, checkpoint_every=0
    )
    lines = []
    result = experiment.run_experiment(config, log=lines.append)
    progress = [line for line in lines if line.startswith('round ')]
    assert len(progress) == 3 and all('DIVERGING: train_loss ' in line for line in progress), lines
    assert result.diverged_round is None and len(result.rounds) == 3
    assert len(result.warnings) == 1 and 'the run diverged' in result.warnings[0]
    report = (tmp_path / 'run' / 'report.md').read_text()
    head = report.split('## Test accuracy')[0]
    assert '## Warnings' in head and '- round 1: DIVERGING: train_loss ' in head and 'the run diverged' in head
