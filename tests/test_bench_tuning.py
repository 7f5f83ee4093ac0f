"""tff-pfl-bench: the validation curve in records, the validation-selected round in the summary and report."""

import types

import pytest

from tff_pfl_bench import bench_report, bench_run, bench_suite, tuning

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
    assert bench_run.selected_round(curve, val) == {'round': 10, 'val_accuracy': 0.8, 'test_accuracy': 0.7}
    assert bench_run.best_test_round(curve) == {'round': 15, 'test_accuracy': 0.9}
    assert bench_run.selected_round(curve, []) is None and bench_run.best_test_round([]) is None
    assert bench_run.selected_round([], val)['test_accuracy'] is None


def test_the_record_keeps_the_validation_curve_and_the_selected_round():
    suite = bench_suite.parse_suite(PLAIN, 'plain.toml')
    run = suite.select(seeds=[0], algorithms=['FedAvg'], partitions=['natural'])[0]
    config = suite.config(run.partition, run.algorithm, 0, 'x')
    rows = _rows('global_model', [0.3, 0.6, 0.5], [0.4, 0.5, 0.8])
    record = bench_run._bench_result(suite, run, config, _result(rows, 'global_model'), 1.0, _COMMUNICATION, _CSV)
    assert record['val_curve'] == [
        {'round': 1, 'accuracy': 0.3},
        {'round': 2, 'accuracy': 0.6},
        {'round': 3, 'accuracy': 0.5},
    ]
    assert record['selected'] == {'round': 2, 'val_accuracy': 0.6, 'test_accuracy': 0.5}
    assert record['best_test_round'] == {'round': 3, 'test_accuracy': 0.8}
    # Without val keys (a run without eval_validation): no validation curve, no selected round.
    rows = _rows('global_model', [None] * 3, [0.4, 0.5, 0.8])
    record = bench_run._bench_result(suite, run, config, _result(rows, 'global_model'), 1.0, _COMMUNICATION, _CSV)
    assert record['val_curve'] == [] and record['selected'] is None
    # A model made by a final personalize stage: only the last round is that model, as for the test curve.
    ditto = suite.select(seeds=[0], algorithms=['Ditto'], partitions=['natural'])[0]
    rows = _rows('personalized_model', [0.9, 0.2, 0.4], [0.1, 0.2, 0.3])
    communication = dict(_COMMUNICATION, has_personalize=True, personalize_bytes_down_per_client=0)
    communication['personalize_bytes_up_per_client'] = 0
    config = suite.config(ditto.partition, ditto.algorithm, 0, 'x')
    record = bench_run._bench_result(
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
    suite = bench_suite.parse_suite(PLAIN, 'plain.toml')
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
    fedavg, local = bench_report.aggregate(suite, records)
    assert fedavg['selected_test_accuracy_mean'] == pytest.approx(75.0)
    assert fedavg['selected_test_accuracy_std_over_seeds'] == pytest.approx(10 / 2**0.5)
    assert fedavg['selected_round_mean'] == pytest.approx(2.5)
    assert fedavg['best_test_accuracy_mean_optimistic'] == pytest.approx(87.5)
    assert fedavg['accuracy_mean'] == pytest.approx(50.0)  # the last round's, as before
    assert all(local[column] is None for column in tuning.SUMMARY_COLUMNS)
    # Records written before these fields: blank, as committed results are.
    old = {k: v for k, v in records[2].items() if k not in ('selected', 'best_test_round')}
    assert all(bench_report.aggregate(suite, [old])[0][c] is None for c in tuning.SUMMARY_COLUMNS)
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
