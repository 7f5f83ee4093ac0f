"""tff-pfl-bench's tuning protocol: the format, the trials, the choice on validation, its files and report."""

import copy
import csv
import dataclasses
import json
import os
import shutil
import types

import pytest

from tff_pfl.program import experiment
from tff_pfl_bench import (
    bench_aggregate,
    bench_layout,
    bench_parse,
    bench_record,
    bench_report,
    bench_run,
    bench_suite,
    tuning,
)

# Two partitions, FedAvg, Ditto and Local, seeds 0-2; no tuning.
PLAIN = """
name = "plain"
[defaults]
dataset = "synthetic"
num_clients = 3
rounds = 3
eval_every = 1
batch_size = 16
seeds = [0, 1, 2]
[[partitions]]
name = "natural"
partition = "natural"
[[partitions]]
name = "IID"
partition = "iid"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
[algorithms.overrides]
client_learning_rate = 0.3
[[algorithms]]
name = "Ditto"
algorithm = "ditto"
model = "personalized_model"
[[algorithms]]
name = "Local"
algorithm = "local"
"""

_CSV = 'client_id,train_examples,val_examples,test_examples\nc0,10,5,5\nc1,12,6,6\nc2,8,4,4\n'
_COMMUNICATION = {'has_personalize': False, 'bytes_down_per_client': 8, 'bytes_up_per_client': 8}


# ----------------------------------------------------------------------------
# A run's validation curve, its validation-selected round and its best round on test.


def _rows(model, val, test):
    rows = []
    for i, (v, t) in enumerate(zip(val, test), start=1):
        row = {'round': i, 'round_seconds': 0.5, f'test_{model}_accuracy_mean': t}
        if v is not None:
            row[f'val_{model}_accuracy_mean'] = v
        rows.append(row)
    return rows


def _result(rows, model):
    last = rows[-1][f'test_{model}_accuracy_mean']
    clients = [{'client_id': f'c{i}', f'{model}_accuracy': last, f'{model}_num_examples': 5} for i in range(3)]
    summary = {model: {'mean': last, 'std': 0.0, 'worst_10': last}}
    return types.SimpleNamespace(rounds=rows, clients=clients, summary=summary, diverged_round=None)


def test_selected_round_and_best_round_on_test_by_hand():
    curve = [{'round': r, 'accuracy': a} for r, a in [(5, 0.5), (10, 0.7), (15, 0.9), (20, 0.9)]]
    val = [{'round': r, 'accuracy': a} for r, a in [(5, float('nan')), (10, 0.8), (15, 0.8), (20, 0.6)]]
    # The highest validation mean, the earliest of equals, never a NaN; the test accuracy at that round.
    assert bench_record.selected_round(curve, val) == {'round': 10, 'val_accuracy': 0.8, 'test_accuracy': 0.7}
    assert bench_record.best_test_round(curve) == {'round': 15, 'test_accuracy': 0.9}
    assert bench_record.selected_round(curve, []) is None and bench_record.best_test_round([]) is None
    assert bench_record.selected_round([], val)['test_accuracy'] is None


def test_the_record_keeps_the_validation_curve_and_the_selected_round():
    suite = bench_parse.parse_suite(PLAIN, 'plain.toml')
    run = suite.select(seeds=[0], algorithms=['FedAvg'], partitions=['natural'])[0]
    config = suite.config(run.partition, run.algorithm, 0, 'x')
    rows = _rows('global_model', [0.3, 0.6, 0.5], [0.4, 0.5, 0.8])
    record = bench_record.run_record(suite, run, config, _result(rows, 'global_model'), 1.0, _COMMUNICATION, _CSV)
    assert record['val_curve'] == [
        {'round': 1, 'accuracy': 0.3},
        {'round': 2, 'accuracy': 0.6},
        {'round': 3, 'accuracy': 0.5},
    ]
    assert record['selected'] == {'round': 2, 'val_accuracy': 0.6, 'test_accuracy': 0.5}
    assert record['best_test_round'] == {'round': 3, 'test_accuracy': 0.8}
    # Without val keys (a run without eval_validation): no validation curve, no selected round.
    rows = _rows('global_model', [None] * 3, [0.4, 0.5, 0.8])
    record = bench_record.run_record(suite, run, config, _result(rows, 'global_model'), 1.0, _COMMUNICATION, _CSV)
    assert record['val_curve'] == [] and record['selected'] is None
    # A model made by a final personalize stage: only the last round is that model, as for the test curve.
    ditto = suite.select(seeds=[0], algorithms=['Ditto'], partitions=['natural'])[0]
    rows = _rows('personalized_model', [0.9, 0.2, 0.4], [0.1, 0.2, 0.3])
    communication = dict(_COMMUNICATION, has_personalize=True, personalize_bytes_down_per_client=0)
    communication['personalize_bytes_up_per_client'] = 0
    config = suite.config(ditto.partition, ditto.algorithm, 0, 'x')
    record = bench_record.run_record(
        suite, ditto, config, _result(rows, 'personalized_model'), 1.0, communication, _CSV
    )
    assert record['val_curve'] == [{'round': 3, 'accuracy': 0.4}] and record['curve'] == [{'round': 3, 'accuracy': 0.3}]
    assert record['selected'] == {'round': 3, 'val_accuracy': 0.4, 'test_accuracy': 0.3}


# ----------------------------------------------------------------------------
# Aggregation and the report.


def _aggregate_record(suite, algorithm, seed, selected, best, test=0.5):
    run = next(r for r in suite.runs() if (r.partition.name, r.algorithm.name, r.seed) == ('natural', algorithm, seed))
    model = run.algorithm.model
    return {
        'run': run,
        'seed': seed,
        'summary': {model: {'mean': test, 'std': 0.0, 'worst_10': test}},
        'clients': [{'client_id': 'c0', 'accuracy': test, 'num_examples': 5}],
        'rounds': 3,
        'rounds_to_target': None,
        'communication': {},
        'seconds': 60.0,
        'partition_csv': _CSV,
        'selected': selected,
        'best_test_round': best,
    }


def test_summary_and_report_give_the_test_accuracy_at_the_validation_selected_round():
    suite = bench_parse.parse_suite(PLAIN, 'plain.toml')
    records = [
        _aggregate_record(
            suite,
            'FedAvg',
            0,
            {'round': 2, 'val_accuracy': 0.6, 'test_accuracy': 0.7},
            {'round': 3, 'test_accuracy': 0.9},
        ),
        _aggregate_record(
            suite,
            'FedAvg',
            1,
            {'round': 3, 'val_accuracy': 0.5, 'test_accuracy': 0.8},
            {'round': 1, 'test_accuracy': 0.85},
        ),
        _aggregate_record(suite, 'Local', 0, None, {'round': 3, 'test_accuracy': 0.9}),  # no validation curve
    ]
    fedavg, local = bench_aggregate.aggregate(suite, records)
    assert fedavg['selected_test_accuracy_mean'] == pytest.approx(75.0)
    assert fedavg['selected_test_accuracy_std_over_seeds'] == pytest.approx(10 / 2**0.5)
    assert fedavg['selected_round_mean'] == pytest.approx(2.5)
    assert fedavg['best_test_accuracy_mean_optimistic'] == pytest.approx(87.5)
    assert fedavg['accuracy_mean'] == pytest.approx(50.0)  # the last round's, as before
    assert all(local[column] is None for column in tuning.SUMMARY_COLUMNS)
    # Records written before these fields: blank, as committed results are.
    old = {k: v for k, v in records[2].items() if k not in ('selected', 'best_test_round')}
    assert all(bench_aggregate.aggregate(suite, [old])[0][c] is None for c in tuning.SUMMARY_COLUMNS)
    text = bench_report.render_report(suite, '/tmp/x', records, [fedavg, local], [], [])
    assert '## Test accuracy at the validation-selected round (%)' in text
    assert (
        '| algorithm | partition | runs | last round | validation-selected round | selected round | '
        'best round on test (optimistic) |' in text
    )
    assert '| FedAvg | natural | 2/3 | 50.00 ± 0.00 | 75.00 ± 7.07 | 2.5 | 87.50 |' in text
    assert '| Local | natural | 1/3 | 50.00 |  |  |  |' in text
    # No row with a validation curve: no such section.
    text = bench_report.render_report(suite, '/tmp/x', [records[2]], [local], [], [])
    assert '## Test accuracy at the validation-selected round' not in text


# ----------------------------------------------------------------------------
# The tuning protocol.


# Two partitions; FedAvg and Ditto tuned with 2 trials each (Ditto's choice differs between the two
# `select` rules), Local untuned; seeds 0-2, trials on seed 1.
TUNED = """
name = "tuned"
[defaults]
dataset = "synthetic"
num_clients = 3
rounds = 3
eval_every = 1
batch_size = 16
seeds = [0, 1, 2]
eval_validation = true
[tuning]
seed = 1
trials = 2
select = "last"
[[partitions]]
name = "natural"
partition = "natural"
[[partitions]]
name = "IID"
partition = "iid"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
[algorithms.overrides]
client_learning_rate = 0.3
[algorithms.tune]
client_learning_rate = [0.05, 0.5]
[[algorithms]]
name = "Ditto"
algorithm = "ditto"
model = "personalized_model"
[algorithms.tune]
client_learning_rate = [0.1]
ditto_lambda = [0.1, 1.0]
[[algorithms]]
name = "Local"
algorithm = "local"
untuned = "local training has no federated knob"
"""


def _tuned_with(old, new):
    assert old in TUNED, old
    return TUNED.replace(old, new, 1)


# ----------------------------------------------------------------------------
# The format.


def test_trials_are_the_product_of_the_tune_lists_over_the_run_configuration():
    suite = bench_parse.parse_suite(
        _tuned_with('ditto_lambda = [0.1, 1.0]', 'ditto_lambda = [0.1, 1.0]\npersonal_epochs = [1]'), 'tuned.toml'
    )
    assert suite.tuning == bench_suite.Tuning(seed=1, trials=2, select='last')
    fedavg, ditto, local = suite.algorithms
    assert fedavg.tune == (('client_learning_rate', (0.05, 0.5)),) and fedavg.untuned is None
    assert local.tune == () and local.untuned == 'local training has no federated knob'
    trials = tuning.trials(suite)
    assert [t.label for t in trials] == [
        'natural/FedAvg/trials/client_learning_rate-0.05',
        'natural/FedAvg/trials/client_learning_rate-0.5',
        'natural/Ditto/trials/client_learning_rate-0.1-ditto_lambda-0.1-personal_epochs-1',
        'natural/Ditto/trials/client_learning_rate-0.1-ditto_lambda-1.0-personal_epochs-1',
        'IID/FedAvg/trials/client_learning_rate-0.05',
        'IID/FedAvg/trials/client_learning_rate-0.5',
        'IID/Ditto/trials/client_learning_rate-0.1-ditto_lambda-0.1-personal_epochs-1',
        'IID/Ditto/trials/client_learning_rate-0.1-ditto_lambda-1.0-personal_epochs-1',
    ]
    assert [t.index for t in trials[:4]] == [0, 1, 0, 1] and {t.seed for t in trials} == {1}
    assert trials[1].directory('/o') == '/o/runs/natural/fedavg/trials/client_learning_rate-0.5'
    assert bench_layout.trial_record_path('/r', trials[1]) == (
        '/r/records/natural/fedavg/trials/client_learning_rate-0.5.json'
    )
    # A trial's configuration: the run's (here FedAvg's override 0.3 of the rate) updated by its values.
    config = tuning.trial_config(suite, trials[1], 'out')
    assert (config.settings.client_learning_rate, config.seed, config.output_dir) == (0.5, 1, 'out')
    assert suite.config(suite.partitions[0], fedavg, 0).settings.client_learning_rate == 0.3
    assert tuning.trial_config(suite, trials[3]).settings.ditto_lambda == 1.0
    assert config.flat_value('eval_validation') is True
    # Product order: the keys in file order, the last varying fastest.
    grid = bench_parse.parse_suite(
        _tuned_with('trials = 2', 'trials = 4')
        .replace('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = [0.05, 0.5]\nlocal_epochs = [1, 2]')
        .replace('client_learning_rate = [0.1]', 'client_learning_rate = [0.1, 0.2]'),
        'tuned.toml',
    )
    assert [t.settings for t in tuning.trials(grid)[:4]] == [
        {'client_learning_rate': 0.05, 'local_epochs': 1},
        {'client_learning_rate': 0.05, 'local_epochs': 2},
        {'client_learning_rate': 0.5, 'local_epochs': 1},
        {'client_learning_rate': 0.5, 'local_epochs': 2},
    ]
    # Selections: the trials go with the tuning seed.
    assert tuning.select_trials(suite, seeds=[0, 2]) == []
    assert [t.label for t in tuning.select_trials(suite, seeds=[1], algorithms=['Ditto'], partitions=['IID'])] == [
        'IID/Ditto/trials/client_learning_rate-0.1-ditto_lambda-0.1-personal_epochs-1',
        'IID/Ditto/trials/client_learning_rate-0.1-ditto_lambda-1.0-personal_epochs-1',
    ]
    # Without [tuning] nothing changes.
    plain = bench_parse.parse_suite(PLAIN, 'plain.toml')
    assert plain.tuning is None and tuning.trials(plain) == [] and len(plain.runs()) == 18


@pytest.mark.parametrize(
    'text, message',
    [
        (_tuned_with('eval_validation = true\n', ''), 'tuned.toml: defaults.eval_validation: must be true in a suite'),
        (
            _tuned_with('client_learning_rate = 0.3', 'client_learning_rate = 0.3\neval_validation = false'),
            'tuned.toml: algorithms "FedAvg" on partitions "natural": eval_validation must be true',
        ),
        (_tuned_with('seed = 1', 'seed = 5'), 'tuned.toml: tuning.seed: required, one of the seeds [0, 1, 2]'),
        (_tuned_with('seed = 1\n', ''), 'tuning.seed: required'),
        (_tuned_with('trials = 2', 'trials = 0'), 'tuning.trials: required, a positive integer'),
        (_tuned_with('select = "last"', 'select = "best"'), "tuning.select: required, one of 'last', 'selected'"),
        (_tuned_with('select = "last"', 'select = "last"\nbudget = 3'), 'tuned.toml: tuning.budget: unknown key'),
        (
            _tuned_with('untuned = "local training has no federated knob"\n', ''),
            'tuned.toml: algorithms "Local": needs a tune table of [tuning] trials = 2 combinations, or untuned',
        ),
        (
            _tuned_with(
                'untuned = "local training has no federated knob"',
                'untuned = "x"\n[algorithms.tune]\nlocal_epochs = [1, 2]',
            ),
            'algorithms "Local": has both tune and untuned',
        ),
        (_tuned_with('"local training has no federated knob"', '" "'), '"Local".untuned: must be a non-empty string'),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = [0.05, 0.5, 0.9]'),
            'algorithms "FedAvg".tune: 3 trials (3), but [tuning] trials = 2: every algorithm gets the same budget',
        ),
        (_tuned_with('client_learning_rate = [0.1]', 'client_learning_rate = [0.1, 0.2]'), '4 trials (2 x 2), but'),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'ditto_lambda = [0.1, 1.0]'),
            'algorithms "FedAvg".tune.ditto_lambda: ditto_lambda does not apply to fedavg',
        ),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'learning_rate = [1, 2]'),
            '.tune.learning_rate: unknown key',
        ),
        (_tuned_with('client_learning_rate = [0.05, 0.5]', 'num_clients = [3, 4]'), '.tune.num_clients: changes the'),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'partition = ["iid", "natural"]'),
            '.tune.partition: set by',
        ),
        (_tuned_with('client_learning_rate = [0.05, 0.5]', 'seed = [0, 1]'), '"FedAvg".tune.seed: set by the harness'),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'dirichlet_alpha = [0.1, 1.0]'),
            '"FedAvg".tune.dirichlet_alpha: changes the client data',
        ),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'eval_validation = [true, false]'),
            ".tune.eval_validation: is the tuning protocol's own setting",
        ),
        (_tuned_with('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = 0.05'), 'must be a non-empty list'),
        (_tuned_with('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = []'), 'must be a non-empty list'),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = [0.05, "fast"]'),
            '"FedAvg".tune.client_learning_rate: client_learning_rate must be a number',
        ),
        (_tuned_with('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = [0.5, 0.5]'), 'repeated value'),
        (_tuned_with('client_learning_rate = [0.05, 0.5]', ''), 'algorithms "FedAvg".tune: names no setting'),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'model = ["logistic", "LOGISTIC"]'),
            'algorithms "FedAvg".tune: two trials name the same directory',
        ),
        (
            _tuned_with('client_learning_rate = [0.05, 0.5]', 'client_learning_rate = [0.05, -0.5]'),
            'algorithms "FedAvg" trial client_learning_rate=-0.5 on partitions "natural": client_learning_rate must',
        ),
        (
            _tuned_with('[tuning]\nseed = 1\ntrials = 2\nselect = "last"\n', '').replace(
                'untuned = "local training has no federated knob"\n', ''
            ),
            'tuned.toml: algorithms "FedAvg".tune: given without a [tuning] table',
        ),
        (
            _tuned_with('[tuning]\nseed = 1\ntrials = 2\nselect = "last"\n', '')
            .replace('[algorithms.tune]\nclient_learning_rate = [0.05, 0.5]\n', '')
            .replace('[algorithms.tune]\nclient_learning_rate = [0.1]\nditto_lambda = [0.1, 1.0]\n', ''),
            'tuned.toml: algorithms "Local".untuned: given without a [tuning] table',
        ),
        (
            TUNED + '[[algorithms]]\nname = "TFF FedRecon"\nalgorithm = "tff_fed_recon"\nmodel = "personalized_model"\n'
            '[algorithms.tune]\nclient_learning_rate = [0.1, 0.2]\n',
            '"TFF FedRecon".tune: tff_fed_recon is TFF\'s own process, scored on test only',
        ),
        (  # peers score no validation split: a suite with [tuning] cannot hold them
            TUNED + '[[algorithms]]\nname = "TFF FedRecon"\nalgorithm = "tff_fed_recon"\nmodel = "personalized_model"\n'
            'untuned = "TFF\'s own"\n',
            'algorithms "TFF FedRecon" on partitions "natural": eval_validation does not apply to tff_fed_recon',
        ),
    ],
)
def test_tuning_errors_are_one_line_naming_file_and_key(text, message):
    with pytest.raises(bench_suite.SuiteError) as error:
        bench_parse.parse_suite(text, 'tuned.toml')
    assert message in str(error.value)
    assert '\n' not in str(error.value)


# ----------------------------------------------------------------------------
# The choice: validation only.


def _trial_record(val, test, final_round=3):
    """A trial's record with validation curve `val` and test curve `test` (one point per round)."""
    curve = [{'round': r, 'accuracy': a} for r, a in enumerate(test, start=1)]
    val_curve = [{'round': r, 'accuracy': a} for r, a in enumerate(val, start=1)]
    return {
        'final_round': final_round,
        'curve': curve,
        'val_curve': val_curve,
        'selected': bench_record.selected_round(curve, val_curve),
        'best_test_round': bench_record.best_test_round(curve),
        'summary': {'global_model': {'mean': test[-1]}},
        'clients': [{'client_id': 'c0', 'accuracy': test[-1]}],
    }


def test_the_choice_reads_validation_never_test():
    suite = bench_parse.parse_suite(TUNED, 'tuned.toml')
    mine = [t for t in tuning.trials(suite) if t.partition.name == 'natural' and t.algorithm.name == 'Ditto']
    # Trial 0 peaks on validation at round 2 but ends low; trial 1 ends highest on validation; on test,
    # trial 0 is far better everywhere.
    records = [_trial_record([0.3, 0.9, 0.55], [0.9, 0.95, 0.97]), _trial_record([0.5, 0.6, 0.65], [0.2, 0.2, 0.2])]
    views = [tuning.validation_view(r) for r in records]
    assert tuning.decide(suite, mine, views).trial == mine[1]  # select = "last": 0.65 > 0.55
    selected = dataclasses.replace(suite, tuning=dataclasses.replace(suite.tuning, select='selected'))
    assert tuning.decide(selected, mine, views).trial == mine[0]  # at the selected rounds: 0.9 > 0.65
    assert tuning.decide(suite, mine, views).scores == (0.55, 0.65)
    # What the choice reads holds no test number: the same choice from records whose test numbers are
    # changed to anything.
    for view in views:
        assert set(view) == {'final_round', 'val_curve', 'selected_round', 'selected_val_accuracy'}
    poisoned = copy.deepcopy(records)
    for r in poisoned:
        r['curve'] = [{'round': p['round'], 'accuracy': 1.0 - p['accuracy']} for p in r['curve']]
        r['summary'] = r['clients'] = r['best_test_round'] = None
        r['selected']['test_accuracy'] = -1.0
    assert [tuning.validation_view(r) for r in poisoned] == views
    # Ties: the first in product order; a trial not complete: no choice yet; no finite score: refused.
    tie = [tuning.validation_view(_trial_record([0.5, 0.5, 0.7], [0.1] * 3)) for _ in range(2)]
    assert tuning.decide(suite, mine, tie).trial == mine[0]
    assert tuning.choose([None, float('nan'), 0.2, 0.2, 0.1]) == 2 and tuning.choose([None]) is None
    assert tuning.decide(suite, mine, [views[0], None]) is None
    bare = [tuning.validation_view(dict(r, val_curve=[], selected=None)) for r in records]
    with pytest.raises(bench_suite.SuiteError, match='natural/Ditto: no trial has a finite validation accuracy'):
        tuning.decide(suite, mine, bare)


# ----------------------------------------------------------------------------
# Running: a fake run function, whose numbers depend on the trial's settings (no TFF).

# (algorithm, setting value) -> (validation curve, test curve) over rounds 1-3; a seed adds 0.01 * seed.
# FedAvg: the rate 0.5 wins on validation, 0.05 on test. Ditto: lambda 1.0 wins at the last round on
# validation, lambda 0.1 at its best round, and on test.
CURVES = {
    ('fedavg', 0.05): ([0.50, 0.60, 0.70], [0.82, 0.87, 0.92]),
    ('fedavg', 0.5): ([0.60, 0.75, 0.72], [0.40, 0.45, 0.50]),
    ('ditto', 0.1): ([0.30, 0.90, 0.55], [0.95, 0.95, 0.95]),
    ('ditto', 1.0): ([0.50, 0.60, 0.65], [0.20, 0.20, 0.20]),
    ('local', None): ([0.40, 0.40, 0.40], [0.45, 0.45, 0.45]),
}


def _curves(config):
    if config.algorithm == 'fedavg':
        key = ('fedavg', config.settings.client_learning_rate)
    elif config.algorithm == 'ditto':
        key = ('ditto', config.settings.ditto_lambda)
    else:
        key = ('local', None)
    val, test = CURVES.get(key, CURVES['local', None])  # an untuned setting (the suite without tuning)
    return [v + 0.01 * config.seed for v in val], [t + 0.01 * config.seed for t in test]


class _Interrupted(Exception):
    pass


class FakeRuns:
    """Stands in for `bench_run._run_one`: records the calls, writes `_bench_result` records."""

    def __init__(self):
        self.calls = []
        self.interrupt_at = None  # a label: that run writes a checkpoint, then stops

    def __call__(self, suite, output_dir, run, config, *, resume_from=None, extra=None):
        directory = run.directory(output_dir)
        os.makedirs(directory, exist_ok=True)
        if run.label == self.interrupt_at:
            os.makedirs(os.path.join(directory, 'checkpoints'))
            raise _Interrupted(run.label)
        self.calls.append((run.label, resume_from, config))
        val, test = _curves(config)
        model = run.algorithm.model
        record = bench_record.run_record(
            suite, run, config, _result(_rows(model, val, test), model), 1.0, _COMMUNICATION, _CSV
        )
        record.update(continued=resume_from is not None, continued_from_round=resume_from, **(extra or {}))
        with open(os.path.join(directory, bench_layout.RESULT_FILE), 'w') as f:
            json.dump(record, f, indent=1)
        shutil.rmtree(os.path.join(directory, 'checkpoints'), ignore_errors=True)
        return json.loads(json.dumps(record))


@pytest.fixture
def fake_runs(monkeypatch):
    fake = FakeRuns()
    monkeypatch.setattr(bench_run, '_run_one', fake)
    monkeypatch.setattr(bench_report, '_write_plots', lambda *args: [])  # tests/test_bench.py checks them
    # A directory with `checkpoints/` continues from round 2 (`experiment.resumable_round`).
    monkeypatch.setattr(
        experiment,
        'resumable_round',
        lambda config: 2 if os.path.isdir(os.path.join(config.output_dir, 'checkpoints')) else None,
    )
    return fake


def _read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _record(path):
    with open(path) as f:
        return json.load(f)


def test_tuning_runs_trials_first_chooses_on_validation_and_reuses_the_chosen_trial(tmp_path, fake_runs):
    suite = bench_parse.parse_suite(TUNED, 'tuned.toml')
    out, results = str(tmp_path / 'out'), str(tmp_path / 'results')
    natural, iid = suite.partitions
    fedavg, ditto, local = suite.algorithms

    # 1. Seeds 0 and 2 only: the trials (seed 1) do not run, the tuned algorithms wait; Local runs.
    lines = []
    bench_run.run_suite(suite, out, seeds=[0, 2], results_dir=results, log=lines.append)
    assert lines[:4] == [
        'tuned: 12 runs selected, 0 already complete, 12 to run',
        'tuned: 0 tuning trials selected, 0 already complete, 0 to run',
        'natural/FedAvg: seeds 0, 2 not run: its tuning trials on seed 1 must run first (0 of 2 complete)',
        'natural/Ditto: seeds 0, 2 not run: its tuning trials on seed 1 must run first (0 of 2 complete)',
    ]
    assert [label for label, _, _ in fake_runs.calls] == [
        'natural/Local/seed0',
        'natural/Local/seed2',
        'IID/Local/seed0',
        'IID/Local/seed2',
    ]
    assert _record(os.path.join(out, bench_layout.TUNING_JSON)) == {}  # no choice yet
    with open(os.path.join(out, 'report.md')) as f:
        assert '- FedAvg: 0 of 2 trials complete; no choice yet.' in f.read()

    # 2. All seeds, interrupted in natural/Ditto's second trial: FedAvg's trials and choice stand.
    fake_runs.calls.clear()
    second = 'natural/Ditto/trials/client_learning_rate-0.1-ditto_lambda-1.0'
    fake_runs.interrupt_at = second
    lines = []
    with pytest.raises(_Interrupted):
        bench_run.run_suite(suite, out, results_dir=results, log=lines.append)
    assert lines[1] == 'tuned: 8 tuning trials selected, 0 already complete, 8 to run'
    assert [label for label, _, _ in fake_runs.calls] == [
        'natural/FedAvg/trials/client_learning_rate-0.05',
        'natural/FedAvg/trials/client_learning_rate-0.5',
        'natural/Ditto/trials/client_learning_rate-0.1-ditto_lambda-0.1',
    ]
    # A trial's progress line shows its validation score, never a test number.
    assert lines[2].startswith('trial 1/8 natural/FedAvg/trials/client_learning_rate-0.05: ')
    assert 'val_acc[global_model] 0.7100' in lines[2] and 'test_acc' not in lines[2]
    trial_records = os.path.join(results, 'records', 'natural', 'fedavg', 'trials')
    assert sorted(os.listdir(trial_records)) == ['client_learning_rate-0.05.json', 'client_learning_rate-0.5.json']

    # 3. Resumed: the interrupted trial continues from its checkpoint; no complete trial reruns.
    fake_runs.calls.clear()
    fake_runs.interrupt_at = None
    lines = []
    bench_run.run_suite(suite, out, results_dir=results, log=lines.append)
    assert lines[:2] == [
        'tuned: 18 runs selected, 4 already complete, 14 to run',
        'tuned: 8 tuning trials selected, 3 already complete, 5 to run',
    ]
    assert f'trial 1/5 {second}: incomplete, continuing from its round-2 checkpoint' in lines
    assert fake_runs.calls[0][1] == 2  # resume_from
    # Per partition: its trials, then its runs; the tuning seed's runs of tuned algorithms are not trained.
    assert [label for label, _, _ in fake_runs.calls] == [
        second,
        'natural/FedAvg/seed0',
        'natural/Ditto/seed0',
        'natural/Local/seed1',
        'natural/FedAvg/seed2',
        'natural/Ditto/seed2',
        'IID/FedAvg/trials/client_learning_rate-0.05',
        'IID/FedAvg/trials/client_learning_rate-0.5',
        'IID/Ditto/trials/client_learning_rate-0.1-ditto_lambda-0.1',
        'IID/Ditto/trials/client_learning_rate-0.1-ditto_lambda-1.0',
        'IID/FedAvg/seed0',
        'IID/Ditto/seed0',
        'IID/Local/seed1',
        'IID/FedAvg/seed2',
        'IID/Ditto/seed2',
    ]
    reuse = 'run 3/14 natural/FedAvg/seed1: the chosen trial client_learning_rate-0.5, its record reused (not rerun)'
    assert reuse in lines
    # The choice: on validation (FedAvg 0.5, Ditto lambda 1.0 at the last round), against test.
    configs = {label: config for label, _, config in fake_runs.calls}
    for partition in ('natural', 'IID'):
        for seed in (0, 2):
            assert configs[f'{partition}/FedAvg/seed{seed}'].settings.client_learning_rate == 0.5
            assert configs[f'{partition}/Ditto/seed{seed}'].settings.ditto_lambda == 1.0
            assert configs[f'{partition}/FedAvg/seed{seed}'].seed == seed
    # The tuning seed's run is the chosen trial's record.
    for partition, algorithm, slug in (
        (natural, fedavg, 'client_learning_rate-0.5'),
        (iid, ditto, 'client_learning_rate-0.1-ditto_lambda-1.0'),
    ):
        run = bench_suite.Run(partition, algorithm, 1)
        reused = _record(os.path.join(run.directory(out), bench_layout.RESULT_FILE))
        trial = _record(os.path.join(run.directory(out).replace('seed1', 'trials/' + slug), bench_layout.RESULT_FILE))
        choice = reused.pop('tuning_choice')
        assert reused == trial and trial['tuning_trial']['trial'] == slug
        assert choice == {'trial': slug, 'settings': trial['tuning_trial']['settings'], 'reused_trial_record': True}
        assert _record(bench_layout.record_path(results, run))['tuning_choice'] == choice
    final = _record(os.path.join(bench_suite.Run(natural, fedavg, 2).directory(out), bench_layout.RESULT_FILE))
    assert final['tuning_choice'] == {
        'trial': 'client_learning_rate-0.5',
        'settings': {'client_learning_rate': 0.5},
        'reused_trial_record': False,
    }
    assert 'tuning_choice' not in _record(
        os.path.join(bench_suite.Run(natural, local, 2).directory(out), bench_layout.RESULT_FILE)
    )

    # tuning.csv and tuning.json, in the output and the results directories.
    for directory in (out, results):
        rows = _read_csv(os.path.join(directory, bench_layout.TUNING_CSV))
        assert list(rows[0]) == [
            'partition',
            'algorithm',
            'trial',
            'client_learning_rate',
            'ditto_lambda',
            'val_last',
            'val_selected',
            'selected_round',
            'chosen',
        ]
        assert [
            (r['partition'], r['algorithm'], r['client_learning_rate'], r['ditto_lambda'], r['chosen'])
            for r in rows[:4]
        ] == [
            ('natural', 'FedAvg', '0.05', '', 'no'),
            ('natural', 'FedAvg', '0.5', '', 'yes'),
            ('natural', 'Ditto', '0.1', '0.1', 'no'),
            ('natural', 'Ditto', '0.1', '1', 'yes'),  # floats as every CSV of the harness: .6g
        ]
        # Scores in %, on seed 1: validation only.
        assert [(r['val_last'], r['val_selected'], r['selected_round']) for r in rows[2:4]] == [
            ('56', '91', '2'),
            ('66', '66', '3'),
        ]
        assert _record(os.path.join(directory, bench_layout.TUNING_JSON)) == {
            'natural': {
                'FedAvg': {'client_learning_rate': 0.5},
                'Ditto': {'client_learning_rate': 0.1, 'ditto_lambda': 1.0},
            },
            'IID': {
                'FedAvg': {'client_learning_rate': 0.5},
                'Ditto': {'client_learning_rate': 0.1, 'ditto_lambda': 1.0},
            },
        }
    # The report's Tuning section: the budget, each trial's validation scores, the choice, the reasons.
    with open(os.path.join(results, 'report.md')) as f:
        report = f.read()
    section = report.split('## Tuning')[1].split('\n## ')[0]
    assert 'Budget: 2 trials for every tuned algorithm' in section and 'on seed 1' in section
    assert '| algorithm | trial | client_learning_rate | ditto_lambda | val last | val selected | chosen |' in section
    assert '| Ditto | client_learning_rate-0.1-ditto_lambda-0.1 | 0.1 | 0.1 | 56.00 | 91.00 (round 2) |  |' in section
    assert (
        '| Ditto | client_learning_rate-0.1-ditto_lambda-1.0 | 0.1 | 1.0 | 66.00 | 66.00 (round 3) | **chosen** |'
        in section
    )
    assert '- Local: untuned (local training has no federated knob).' in section
    # No unchosen trial's test number anywhere: FedAvg 0.05's (83, 88, 93 % on seed 1) and Ditto 0.1's (96 %).
    with open(os.path.join(results, bench_layout.TUNING_CSV)) as f:
        tuning_csv = f.read()
    for number in ('83', '88', '93', '96'):
        assert f'{number}.00' not in report and f'0.{number}' not in report, number
        assert number not in tuning_csv, number
    assert 'Test accuracy at the validation-selected round' in report
    summary = {(r['partition'], r['algorithm']): r for r in _read_csv(os.path.join(results, 'summary.csv'))}
    assert float(summary[('natural', 'FedAvg')]['accuracy_mean']) == pytest.approx(51.0)  # 0.5 + 0.01 s, seeds 0-2
    assert float(summary[('natural', 'FedAvg')]['selected_test_accuracy_mean']) == pytest.approx(46.0)  # round 2
    assert float(summary[('natural', 'FedAvg')]['best_test_accuracy_mean_optimistic']) == pytest.approx(51.0)
    assert lines[-1] == f'results: {results} (18 of 18 run records, 8 of 8 trial records)'

    # 4. A fresh output directory: everything restored from the records, nothing reruns; the same tuning files.
    fake_runs.calls.clear()
    fresh = str(tmp_path / 'fresh')
    lines = []
    bench_run.run_suite(suite, fresh, results_dir=results, log=lines.append)
    assert lines[:4] == [
        f'tuned: 18 complete runs restored from {results}',
        f'tuned: 8 complete tuning trials restored from {results}',
        'tuned: 18 runs selected, 18 already complete, 0 to run',
        'tuned: 8 tuning trials selected, 8 already complete, 0 to run',
    ]
    assert fake_runs.calls == []
    for name in (bench_layout.TUNING_CSV, bench_layout.TUNING_JSON):
        with open(os.path.join(fresh, name)) as f, open(os.path.join(out, name)) as g:
            assert f.read() == g.read()
    # --report_only from the output directory alone.
    os.remove(os.path.join(out, bench_layout.TUNING_CSV))
    bench_report.write_report(suite, out, log=lambda line: None)
    assert len(_read_csv(os.path.join(out, bench_layout.TUNING_CSV))) == 8


def test_seeds_without_the_tuning_seed_run_once_the_trials_are_complete(tmp_path, fake_runs):
    suite = bench_parse.parse_suite(TUNED, 'tuned.toml')
    out = str(tmp_path / 'out')
    bench_run.run_suite(suite, out, seeds=[1], algorithms=['FedAvg'], partitions=['IID'], log=lambda line: None)
    assert [label for label, _, _ in fake_runs.calls] == [
        'IID/FedAvg/trials/client_learning_rate-0.05',
        'IID/FedAvg/trials/client_learning_rate-0.5',
    ]
    fake_runs.calls.clear()
    lines = []
    bench_run.run_suite(suite, out, seeds=[2], algorithms=['FedAvg', 'Ditto'], partitions=['IID'], log=lines.append)
    assert [label for label, _, _ in fake_runs.calls] == ['IID/FedAvg/seed2']
    assert fake_runs.calls[0][2].settings.client_learning_rate == 0.5
    assert 'IID/Ditto: seeds 2 not run: its tuning trials on seed 1 must run first (0 of 2 complete)' in lines
    # The seed-1 run of FedAvg was made by the first sitting: its chosen trial's record.
    assert os.path.exists(os.path.join(out, 'runs', 'iid', 'fedavg', 'seed1', bench_layout.RESULT_FILE))


def test_a_suite_without_tuning_writes_no_tuning_files(tmp_path, fake_runs):
    suite = bench_parse.parse_suite(PLAIN, 'plain.toml')
    out, results = str(tmp_path / 'out'), str(tmp_path / 'results')
    lines = []
    bench_run.run_suite(suite, out, seeds=[0], partitions=['natural'], results_dir=results, log=lines.append)
    assert lines[0] == 'plain: 3 runs selected, 0 already complete, 3 to run' and 'tuning trials' not in ' '.join(lines)
    assert lines[-1] == f'results: {results} (3 of 18 run records)'
    for directory in (out, results):
        assert not os.path.exists(os.path.join(directory, bench_layout.TUNING_CSV))
        assert not os.path.exists(os.path.join(directory, bench_layout.TUNING_JSON))
    with open(os.path.join(out, 'report.md')) as f:
        report = f.read()
    assert '## Tuning' not in report
    # The fake rows have validation keys: the validation-selected numbers are reported without tuning too.
    assert 'Test accuracy at the validation-selected round' in report


# ----------------------------------------------------------------------------
# The one real run: trials and a final run trained by TFF, a trial interrupted and continued.

REAL = """
name = "tuned_real"
[defaults]
dataset = "synthetic"
num_clients = 3
rounds = 2
eval_every = 1
batch_size = 16
seeds = [0, 1]
eval_validation = true
[tuning]
seed = 0
trials = 2
select = "selected"
[[partitions]]
name = "natural"
partition = "natural"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
[algorithms.tune]
client_learning_rate = [0.05, 0.5]
"""


def test_real_trials_resume_from_their_checkpoint_and_the_choice_runs_the_other_seed(
    tmp_path, monkeypatch, tff_runtime
):
    write_progress = bench_run._RunLog.__call__

    def interrupting(self, line):  # the second trial stops right after round 1 and its checkpoint
        write_progress(self, line)
        if 'client_learning_rate-0.5' in self._path and line.startswith('round 1/2'):
            raise _Interrupted

    suite = bench_parse.parse_suite(REAL, 'tuned_real.toml')
    out = str(tmp_path / 'out')
    with monkeypatch.context() as patch:
        patch.setattr(bench_run._RunLog, '__call__', interrupting)
        with pytest.raises(_Interrupted):
            bench_run.run_suite(suite, out, checkpoint_every=1, log=lambda line: None)
    lines = []
    bench_run.run_suite(suite, out, checkpoint_every=1, log=lines.append)
    assert lines[:3] == [
        'tuned_real: 2 runs selected, 0 already complete, 2 to run',
        'tuned_real: 2 tuning trials selected, 1 already complete, 1 to run',
        'trial 1/1 natural/FedAvg/trials/client_learning_rate-0.5: incomplete, continuing from its round-1 checkpoint',
    ]
    trials_dir = os.path.join(out, 'runs', 'natural', 'fedavg', 'trials')
    low, high = (
        _record(os.path.join(trials_dir, f'client_learning_rate-{rate}', bench_layout.RESULT_FILE))
        for rate in ('0.05', '0.5')
    )
    assert high['continued'] and high['continued_from_round'] == 1 and not low['continued']
    assert low['config']['settings']['client_learning_rate'] == 0.05
    assert high['config']['settings']['client_learning_rate'] == 0.5
    # Both trials scored their clients' validation splits every round; the choice is the better at its
    # validation-selected round (select = "selected"), the first on a tie.
    for trial in (low, high):
        assert [p['round'] for p in trial['val_curve']] == [1, 2]
        assert trial['selected']['val_accuracy'] == max(p['accuracy'] for p in trial['val_curve'])
    rate, chosen = (0.05, low) if low['selected']['val_accuracy'] >= high['selected']['val_accuracy'] else (0.5, high)
    assert (
        lines[4]
        == f'run 1/2 natural/FedAvg/seed0: the chosen trial client_learning_rate-{rate}, its record reused (not rerun)'
    )
    assert lines[5].startswith('run 2/2 natural/FedAvg/seed1: ')
    # The tuning seed's run is the chosen trial's record; the other seed trained with the chosen rate.
    seed0 = _record(os.path.join(out, 'runs', 'natural', 'fedavg', 'seed0', bench_layout.RESULT_FILE))
    assert seed0.pop('tuning_choice')['reused_trial_record'] and seed0 == chosen
    assert os.listdir(os.path.join(out, 'runs', 'natural', 'fedavg', 'seed0')) == [bench_layout.RESULT_FILE]
    with open(os.path.join(out, 'runs', 'natural', 'fedavg', 'seed1', 'config.json')) as f:
        config = json.load(f)
    assert (config['client_learning_rate'], config['eval_validation'], config['seed']) == (rate, True, 1)
    assert not os.path.exists(os.path.join(trials_dir, 'client_learning_rate-0.5', 'checkpoints'))
    assert _record(os.path.join(out, bench_layout.TUNING_JSON)) == {
        'natural': {'FedAvg': {'client_learning_rate': rate}}
    }
