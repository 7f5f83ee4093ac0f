"""tff-pfl-bench: suites, resume and split, the aggregated report, communication bytes."""

import csv
import functools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from processes import fedavg
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import audit
from tff_pfl.program import experiment
from tff_pfl_bench import bench_aggregate, bench_layout, bench_parse, bench_record, bench_report, bench_run, bench_suite

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two partitions of Synthetic(1,1) with 3 clients, FedAvg and PersFL (a 1 x 1
# grid), 2 rounds, seeds 0 and 1: 8 runs of a few seconds each.
TINY = """
name = "tiny"
description = "harness test"
[defaults]
dataset = "synthetic"
num_clients = 3
rounds = 2
eval_every = 1
batch_size = 16
seeds = [0, 1]
target_accuracy = 0.4
[[partitions]]
name = "natural"
partition = "natural"
[[partitions]]
name = "IID"
partition = "iid"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
model = "global_model"
[[algorithms]]
name = "PersFL"
algorithm = "persfl"
model = "personalized_model"
[algorithms.overrides]
temperatures = [1.0]
imitations = [0.5]
distill_epochs = 1
[paper]
"FedAvg" = { natural = [50.0, 10.0] }
"PersFL" = { IID = { weighted = 40.0, top10 = 45.5 } }
[paper_source]
source = "A paper, Table 1, Synthetic(1,1)"
"""


# ----------------------------------------------------------------------------
# Communication from type signatures.


def test_communication_bytes_of_fedavg(tmp_path):
    spec = make_linear_problem(tmp_path / 'data')
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    process = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(batch_size=8, client_learning_rate=0.3))
    model_bytes = sum(w.size * w.dtype.itemsize for w in model_fn().get_weights())
    assert model_bytes == (4 * 3 + 3) * 4
    got = audit.communication_bytes(process.next)
    # Down: the model and the int32 round number. Up: the weighted update, its
    # float32 weight, and the five float32 training metric sums (loss, correct,
    # examples, clients, local steps).
    assert got == {'bytes_down_per_client': model_bytes + 4, 'bytes_up_per_client': model_bytes + 4 + 5 * 4}
    # Evaluation broadcasts the model and sends nothing up.
    assert audit.communication_bytes(process.evaluate) == {
        'bytes_down_per_client': model_bytes,
        'bytes_up_per_client': 0,
    }


def test_type_bytes():
    import tensorflow_federated as tff

    struct = tff.StructType(
        [('a', tff.TensorType(np.float32, [2, 3])), ('b', tff.TensorType(np.int64)), ('id', tff.TensorType(np.str_))]
    )
    assert audit.type_bytes(struct) == 2 * 3 * 4 + 8
    assert audit.type_bytes(tff.FederatedType(struct, tff.CLIENTS)) == 32
    with pytest.raises(ValueError, match='no fixed size'):
        audit.type_bytes(tff.TensorType(np.float32, [None, 3]))


# ----------------------------------------------------------------------------
# Suites.


def test_precedence_defaults_partition_overrides_partition_overrides():
    suite = bench_parse.parse_suite(
        """
name = "p"
[defaults]
seeds = [3]
rounds = 10
batch_size = 7
client_learning_rate = 0.1
local_epochs = 2
[[partitions]]
name = "a"
partition = "iid"
rounds = 20
batch_size = 8
[[partitions]]
name = "b"
partition = "natural"
[[algorithms]]
name = "Alg"
algorithm = "persfl"
[algorithms.overrides]
rounds = 30
temperatures = [1, 2]
[algorithms.partition_overrides.a]
rounds = 40
""",
        'p.toml',
    )
    a, b = suite.partitions
    alg = suite.algorithms[0]
    config = suite.config(a, alg, 3, 'out')
    settings = config.settings
    assert (config.schedule.rounds, settings.batch_size, settings.client_learning_rate, settings.local_epochs) == (
        40,
        8,
        0.1,
        2,
    )
    assert settings.temperatures == (1.0, 2.0) and config.data.partition.name == 'iid' and config.seed == 3
    assert config.algorithm == 'persfl' and config.output_dir == 'out'
    config = suite.config(b, alg, 3)
    assert (config.schedule.rounds, config.settings.batch_size, config.data.partition.name) == (30, 7, 'natural')
    assert alg.model == 'global_model'  # headline_model's default
    assert [r.label for r in suite.runs()] == ['a/Alg/seed3', 'b/Alg/seed3']


def _suite_with(old, new):
    assert old in TINY, old
    return TINY.replace(old, new, 1)


@pytest.mark.parametrize(
    'text, message',
    [
        (TINY + '\n[[partitions\n', 'tiny.toml: bad TOML'),
        (_suite_with('name = "tiny"', 'name = "tiny"\nversion = 2'), 'tiny.toml: version: unknown key'),
        (_suite_with('num_clients = 3', 'num_client = 3'), 'tiny.toml: defaults.num_client: unknown key'),
        (_suite_with('num_clients = 3', 'seed = 3'), 'tiny.toml: defaults.seed: set by the harness'),
        (_suite_with('rounds = 2', 'rounds = "two"'), 'tiny.toml: defaults.rounds: rounds must be an integer'),
        (_suite_with('num_clients = 3', 'num_clients = 3\nkd_mu1 = 2.0'), 'defaults.kd_mu1: is a setting of none'),
        (_suite_with('seeds = [0, 1]', 'seeds = []'), 'defaults.seeds: required'),
        (_suite_with('seeds = [0, 1]', 'seeds = [0, 0]'), 'defaults.seeds: repeated seed'),
        (_suite_with('target_accuracy = 0.4', 'target_accuracy = 40'), 'defaults.target_accuracy'),
        (
            _suite_with('algorithm = "fedavg"', 'algorithm = "fedper_x"'),
            'tiny.toml: algorithms "FedAvg".algorithm: unknown algorithm \'fedper_x\'',
        ),
        (_suite_with('model = "global_model"', 'model = "best_model"'), 'algorithms "FedAvg".model: must be one of'),
        (
            _suite_with('distill_epochs = 1', 'distil_epochs = 1'),
            'algorithms "PersFL".overrides.distil_epochs: unknown key (not a setting: docs/settings.md)',
        ),
        (
            _suite_with('distill_epochs = 1', 'distill_epochs = 1\nditto_lambda = 0.5'),
            'algorithms "PersFL" on partitions "natural": ditto_lambda does not apply to persfl',
        ),
        (
            _suite_with('distill_epochs = 1', 'distill_epochs = 0'),
            'algorithms "PersFL" on partitions "natural": distill_epochs must be >= 1',
        ),
        (
            _suite_with('distill_epochs = 1', 'distill_epochs = 1\n[algorithms.partition_overrides.IID]\nrounds = 0'),
            'algorithms "PersFL" on partitions "IID": rounds must be >= 1',
        ),
        (
            _suite_with('distill_epochs = 1', 'distill_epochs = 1\n[algorithms.partition_overrides.ds9]\nrounds = 1'),
            'algorithms "PersFL".partition_overrides.ds9: unknown partition',
        ),
        (
            _suite_with('distill_epochs = 1', 'distill_epochs = 1\nnum_clients = 4'),
            'algorithms "PersFL" on partitions "natural": changes the client data (num_clients 4, but 3 for "FedAvg")',
        ),
        (_suite_with('name = "PersFL"', 'name = "fedavg"'), 'labels "FedAvg" and "fedavg" name the same directory'),
        (TINY.replace('natural = [50.0, 10.0]', 'ds1 = [50.0, 10.0]'), 'paper.FedAvg.ds1: unknown partition label'),
        (TINY.replace('natural = [50.0, 10.0]', 'natural = [50.0]'), 'paper.FedAvg.natural: must be [mean, std]'),
        (TINY.replace('natural = [50.0, 10.0]', 'natural = "50"'), 'paper.FedAvg.natural: must be [mean, std] in %, a'),
        (TINY.replace('natural = [50.0, 10.0]', 'natural = {}'), 'paper.FedAvg.natural: names no metric; known: mean'),
        (TINY.replace('weighted = 40.0', 'median = 40.0'), 'paper.PersFL.IID.median: unknown metric; known: mean, we'),
        (TINY.replace('weighted = 40.0', 'weighted = [40.0, 1.0]'), 'paper.PersFL.IID.weighted: must be a number in %'),
        (TINY.replace('weighted = 40.0', 'mean = [40.0]'), 'paper.PersFL.IID.mean: must be [mean, std] in %'),
        (TINY.replace('weighted = 40.0', 'mean = true'), 'paper.PersFL.IID.mean: must be a number or [mean, std]'),
        (TINY.replace('top10 = 45.5', 'top10 = 0.455e3'), 'paper.PersFL.IID.top10: must be in [0, 100] (%)'),
        (
            TINY.replace('natural = [50.0, 10.0]', 'natural = [50.0, -1]'),
            'paper.FedAvg.natural: std must be in [0, 100]',
        ),
        (TINY.replace('source = "A', 'title = "A'), 'tiny.toml: paper_source.title: unknown key; known: source'),
        (TINY.replace('source = "A paper, Table 1, Synthetic(1,1)"', 'source = " "'), 'paper_source.source: required'),
        (TINY.replace('[paper]\n', '[other]\n'), 'tiny.toml: other: unknown key'),
        (
            TINY.split('[paper]')[0] + '[paper_source]\nsource = "x"\n',
            'tiny.toml: paper_source: given without a [paper] table',
        ),
        (
            TINY.replace('[[partitions]]\nname = "natural"\npartition = "natural"\n', '', 1).replace(
                '[[partitions]]\nname = "IID"\npartition = "iid"\n', ''
            ),
            'partitions: required',
        ),
    ],
)
def test_suite_errors_are_one_line_naming_file_and_key(text, message):
    with pytest.raises(bench_suite.SuiteError) as error:
        bench_parse.parse_suite(text, 'tiny.toml')
    assert message in str(error.value)
    assert '\n' not in str(error.value)


def test_paper_table_forms():
    """`[mean, std]` (the old form), a number, and tables of metrics; metrics in a fixed order."""
    text = TINY.replace('"FedAvg" = { natural = [50.0, 10.0] }\n', '').replace(
        '"PersFL" = { IID = { weighted = 40.0, top10 = 45.5 } }',
        '"PersFL" = { IID = { top10 = 45.5, weighted = 40 }, natural = 61.25 }\n'
        '[paper.FedAvg]\nnatural = [50, 10.0]\nIID = { worst10 = 20.0, mean = [70.0, 3.5] }',
    )
    suite = bench_parse.parse_suite(text, 'tiny.toml')
    assert suite.paper == {
        'FedAvg': {'natural': {'mean': (50.0, 10.0)}, 'IID': {'mean': (70.0, 3.5), 'worst10': (20.0, None)}},
        'PersFL': {'IID': {'weighted': (40.0, None), 'top10': (45.5, None)}, 'natural': {'mean': (61.25, None)}},
    }
    assert list(suite.paper['PersFL']['IID']) == ['weighted', 'top10']
    assert suite.paper_source == 'A paper, Table 1, Synthetic(1,1)'
    assert tuple(bench_aggregate.METRICS) == bench_suite.PAPER_METRICS
    plain = bench_parse.parse_suite(TINY.split('[paper]')[0], 'tiny.toml')
    assert plain.paper == {} and plain.paper_source == ''


def test_paper_table_lists_clients_up_to_the_limit_then_quantiles():
    """Up to MAX_CLIENT_ROWS clients one row each; beyond, quantiles of the seed-averaged accuracies."""
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')

    def rows(per_client):
        return [
            {
                'algorithm': 'FedAvg',
                'partition': 'IID',
                'per_client': per_client,
                'accuracy_mean': 1.0,
                'client_std': 2.0,
            }
        ]

    few = [float(i) for i in range(bench_report.MAX_CLIENT_ROWS)]
    table, columns = bench_report.paper_table(suite, rows(few))
    assert columns == ['', 'FedAvg IID']
    assert [r[''] for r in table] == [f'User {i}' for i in range(len(few))] + ['Avg. Acc.', 'Std Dev']
    assert table[7]['FedAvg IID'] == '7.00'
    # 101 clients with accuracies 100, 99, ..., 0 (in no order): the q-quantile is 100 q exactly.
    many = [float(100 - i) for i in range(101)]
    table, _ = bench_report.paper_table(suite, rows(many))
    cells = {r['']: r['FedAvg IID'] for r in table}
    assert cells == {
        'min': '0.00',
        '10th percentile': '10.00',
        '25th percentile': '25.00',
        'median': '50.00',
        '75th percentile': '75.00',
        '90th percentile': '90.00',
        'max': '100.00',
        'Avg. Acc.': '1.00',
        'Std Dev': '2.00',
    }


def _fake_record(suite, partition, algorithm, seed, accuracies, splits):
    """A `bench_result.json` record of clients c0, c1, ... with (train, val, test) examples `splits`."""
    run = next(r for r in suite.runs() if (r.partition.name, r.algorithm.name, r.seed) == (partition, algorithm, seed))
    lines = ['client_id,train_examples,val_examples,test_examples,class_0']
    lines += [f'c{i},{train},{val},{test},{train + val + test}' for i, (train, val, test) in enumerate(splits)]
    ordered = np.sort(accuracies)
    model = run.algorithm.model
    return {
        'run': run,
        'seed': seed,
        'summary': {model: {'mean': np.mean(accuracies), 'std': np.std(accuracies), 'worst_10': np.mean(ordered[:2])}},
        'clients': [
            {'client_id': f'c{i}', 'accuracy': a, 'num_examples': test}
            for i, (a, (_, _, test)) in enumerate(zip(accuracies, splits))
        ],
        'rounds': 2,
        'rounds_to_target': None,
        'communication': {},
        'seconds': 60.0,
        'partition_csv': '\n'.join(lines) + '\n',
    }


def test_sample_weighted_and_top_10_by_hand():
    """11 clients: the top 10% are ceil(1.1) = 2; weights are train + val + test examples."""
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')
    # Seed 0: client i holds 20 (i + 1) examples, test sets shrinking with i (11 - i), so that
    # weighting by test examples would pick other clients. Accuracy 0.5, but 0.0 for client 9
    # (200 examples) and 1.0 for client 10 (220).
    splits0 = [(20 * (i + 1) - 13 + i, 2, 11 - i) for i in range(11)]
    assert [sum(s) for s in splits0] == [20 * (i + 1) for i in range(11)]
    accuracies0 = [0.5] * 9 + [0.0, 1.0]
    # Seed 1: every client holds 30 examples: a tie, the first two clients are the top 10%.
    splits1 = [(20, 5, 5)] * 11
    accuracies1 = [0.2, 0.4] + [0.9] * 9
    records = [
        _fake_record(suite, 'natural', 'FedAvg', 0, accuracies0, splits0),
        _fake_record(suite, 'natural', 'FedAvg', 1, accuracies1, splits1),
    ]
    # By hand: seed 0, weighted (0.5 * 20 * (1 + ... + 9) + 0 * 200 + 1 * 220) / 1320 = 670 / 1320,
    # top 10% (0 * 200 + 1 * 220) / 420; seed 1, weighted (0.2 + 0.4 + 9 * 0.9) / 11, top (0.2 + 0.4) / 2.
    weighted = [100 * 670 / 1320, 100 * 8.7 / 11]
    top = [100 * 220 / 420, 100 * 0.3]
    assert bench_aggregate.sample_weighted(records[0]) == (pytest.approx(weighted[0]), pytest.approx(top[0]))
    assert bench_aggregate.sample_weighted(records[1]) == (pytest.approx(weighted[1]), pytest.approx(top[1]))
    assert bench_aggregate.client_examples(records[0]['partition_csv'])['c10'] == 220
    (row,) = bench_aggregate.aggregate(suite, records)
    assert row['weighted_mean'] == pytest.approx((weighted[0] + weighted[1]) / 2)
    assert row['weighted_mean_std_over_seeds'] == pytest.approx(abs(weighted[0] - weighted[1]) / 2**0.5)
    assert row['top_10_by_samples'] == pytest.approx((top[0] + top[1]) / 2)
    assert row['top_10_by_samples_std_over_seeds'] == pytest.approx(abs(top[0] - top[1]) / 2**0.5)
    worst = [100 * (0.0 + 0.5) / 2, 100 * (0.2 + 0.4) / 2]
    assert row['worst_10'] == pytest.approx(sum(worst) / 2)
    assert row['worst_10_std_over_seeds'] == pytest.approx(abs(worst[0] - worst[1]) / 2**0.5)
    # Without its partition a run has no sample-weighted numbers, and the cell none.
    records[1]['partition_csv'] = None
    assert bench_aggregate.sample_weighted(records[1]) == (None, None)
    (row,) = bench_aggregate.aggregate(suite, records)
    assert row['weighted_mean'] is None and row['top_10_by_samples'] is None
    records[1]['partition_csv'] = 'client_id,train_examples\nc0,3\n'
    with pytest.raises(bench_suite.SuiteError, match='run natural/FedAvg/seed1: partition.csv row .* has no client_id'):
        bench_aggregate.aggregate(suite, records)
    # The report shows them beside the worst 10%, with the paper's targeted metrics.
    records[1] = _fake_record(suite, 'natural', 'FedAvg', 1, accuracies1, splits1)
    rows = bench_aggregate.aggregate(suite, records)
    text = bench_report.render_report(suite, '/tmp/x', records, rows, [], [])
    header = next(line for line in text.splitlines() if line.startswith('| algorithm | partition | model |'))
    assert header == (
        '| algorithm | partition | model | runs | ours | ours std | weighted | worst 10% | top 10% | paper | '
        'paper std | diff | diff std | paper weighted | diff weighted | paper top 10% | diff top 10% |'
    )
    line = next(line for line in text.splitlines() if line.startswith('| FedAvg | natural |'))
    cells = [c.strip() for c in line.split('|')[1:-1]]
    assert cells[6:9] == [f'{sum(weighted) / 2:.2f}', f'{sum(worst) / 2:.2f}', f'{sum(top) / 2:.2f}']
    assert cells[9:11] == ['50.0', '10.0'] and cells[13:] == ['', '', '', '']
    assert 'Paper: A paper, Table 1, Synthetic(1,1).' in text


def test_load_suite_errors(tmp_path):
    with pytest.raises(bench_suite.SuiteError, match='suite file not found'):
        bench_parse.load_suite(str(tmp_path / 'nope.toml'))
    (tmp_path / 'bad.toml').write_bytes(b'\xff\xfe')
    with pytest.raises(bench_suite.SuiteError, match='not UTF-8'):
        bench_parse.load_suite(str(tmp_path / 'bad.toml'))


def test_selection():
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')
    assert len(suite.runs()) == 8
    runs = suite.select(seeds=[1], algorithms=['PersFL'])
    assert [r.label for r in runs] == ['natural/PersFL/seed1', 'IID/PersFL/seed1']
    assert runs[1].directory('/o') == '/o/runs/iid/persfl/seed1'
    for kwargs, message in [
        (dict(seeds=[2]), 'unknown seed 2; the suite has 0, 1'),
        (dict(algorithms=['FedAvg', 'pFedMe']), 'unknown algorithm pFedMe'),
        (dict(partitions=['ds1']), 'unknown partition ds1'),
    ]:
        with pytest.raises(bench_suite.SuiteError, match=message):
            suite.select(**kwargs)


def test_an_unquoted_label_with_commas_gets_the_quoting_in_its_error():
    """`--algorithms=KT-pFL, step 0.5` arrives split at the comma: the error shows the quoted flag."""
    text = TINY.replace('name = "PersFL"', 'name = "PersFL, short"').replace('"PersFL" = {', '"PersFL, short" = {')
    suite = bench_parse.parse_suite(text, 'tiny.toml')
    with pytest.raises(bench_suite.SuiteError) as raised:
        suite.select(algorithms=['PersFL', 'short'])
    assert str(raised.value) == (
        'unknown algorithm PersFL, short; the suite has FedAvg, PersFL, short; a label with commas goes in '
        """double quotes: '--algorithms="PersFL, short"'"""
    )
    with pytest.raises(bench_suite.SuiteError, match=r'unknown algorithm pFedMe; the suite has FedAvg, PersFL, short$'):
        suite.select(algorithms=['pFedMe'])
    assert [r.algorithm.name for r in suite.select(algorithms=['PersFL, short'])] == ['PersFL, short'] * 4


def test_committed_suites():
    smoke = bench_parse.load_suite(os.path.join(REPO, 'benchmarks', 'suites', 'smoke.toml'))
    assert len(smoke.runs()) == 4 and smoke.defaults['dataset'] == 'synthetic'
    path = os.path.join(REPO, 'benchmarks', 'suites', 'persfl_mnist.toml')
    suite = bench_parse.load_suite(path)
    assert [p.name for p in suite.partitions] == ['ds1', 'ds2', 'ds3'] and suite.seeds == (0, 1, 2)
    assert [a.name for a in suite.algorithms] == [
        'FedAvg',
        'PersFL',
        'FedPer',
        'pFedMe',
        'Per-FedAvg',
        'Local',
        'FedAvg+FT',
    ]
    rounds = {a.name: [suite.config(p, a, 0).schedule.rounds for p in suite.partitions] for a in suite.algorithms}
    assert rounds == {
        'FedAvg': [100, 50, 100],
        'PersFL': [100, 25, 100],
        'FedPer': [100, 50, 100],
        'pFedMe': [800, 800, 800],
        'Per-FedAvg': [800, 800, 800],
        'Local': [100, 100, 100],
        'FedAvg+FT': [100, 50, 100],
    }
    assert suite.paper['PersFL']['ds3'] == {'mean': (99.4, 0.3)}
    baselines = bench_parse.load_suite(os.path.join(REPO, 'benchmarks', 'suites', 'baselines_mnist.toml'))
    names = {a.algorithm for a in baselines.algorithms}
    assert {'local', 'fedavg_ft', 'fedper', 'ditto', 'pfedme', 'perfedavg_fo', 'perfedavg_hf', 'apfl'} <= names


# ----------------------------------------------------------------------------
# Running: one output directory shared by the tests below.


def _read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _result_state(directory):
    path = os.path.join(directory, bench_layout.RESULT_FILE)
    with open(path, 'rb') as f:
        return os.stat(path).st_mtime_ns, f.read()


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory, tff_runtime):
    """Runs seed 0 of the tiny suite, then the whole suite (which must skip seed 0)."""
    out = str(tmp_path_factory.mktemp('bench') / 'tiny')
    suite_path = tmp_path_factory.mktemp('suite') / 'tiny.toml'
    suite_path.write_text(TINY)
    suite = bench_parse.load_suite(str(suite_path))
    first = []
    bench_run.run_suite(suite, out, seeds=[0], command='first', log=first.append)
    seed0 = {r.label: _result_state(r.directory(out)) for r in suite.select(seeds=[0])}
    second = []
    rows = bench_run.run_suite(suite, out, command='second', log=second.append)
    return dict(suite=suite, out=out, first=first, second=second, seed0=seed0, rows=rows)


def test_split_by_seed_then_resume(tiny_run):
    suite, out = tiny_run['suite'], tiny_run['out']
    assert tiny_run['first'][0] == 'tiny: 4 runs selected, 0 already complete, 4 to run'
    assert tiny_run['second'][0] == 'tiny: 8 runs selected, 4 already complete, 4 to run'
    progress = [line for line in tiny_run['second'] if line.startswith('run ')]
    assert [line.split()[2] for line in progress] == [
        'natural/FedAvg/seed1:',
        'natural/PersFL/seed1:',
        'IID/FedAvg/seed1:',
        'IID/PersFL/seed1:',
    ]
    assert progress[0].startswith('run 1/4 ') and 'ETA' in progress[0] and 'test_acc[global_model]' in progress[0]
    # The seed-0 runs were not redone.
    for run in suite.select(seeds=[0]):
        assert _result_state(run.directory(out)) == tiny_run['seed0'][run.label]
    for run in suite.runs():
        assert os.path.exists(os.path.join(run.directory(out), bench_layout.RESULT_FILE))
        assert os.path.getsize(os.path.join(run.directory(out), 'progress.log')) > 0
    with open(os.path.join(out, bench_layout.COMMANDS_FILE)) as f:
        assert f.read() == 'first\nsecond\n'
    with open(os.path.join(out, bench_layout.SUITE_FILE)) as f:
        assert f.read() == TINY


def test_outputs_equal_an_independent_recomputation(tiny_run):
    suite, out = tiny_run['suite'], tiny_run['out']
    results = _read_csv(os.path.join(out, 'results.csv'))
    summary = {(r['partition'], r['algorithm']): r for r in _read_csv(os.path.join(out, 'summary.csv'))}
    with open(os.path.join(out, 'report.md')) as f:
        report = f.read()
    assert len(results) == 8 * 3 and len(summary) == 4
    for partition in suite.partitions:
        for algorithm in suite.algorithms:
            model = algorithm.model
            per_seed, weighted_per_seed, top_per_seed = [], [], []
            for seed in suite.seeds:
                directory = os.path.join(out, 'runs', partition.slug, algorithm.slug, f'seed{seed}')
                clients = _read_csv(os.path.join(directory, 'clients.csv'))
                accuracies = [float(c[f'{model}_accuracy']) for c in clients]
                mine = [
                    r
                    for r in results
                    if (r['partition'], r['algorithm'], r['seed']) == (partition.name, algorithm.name, str(seed))
                ]
                assert [r['client_id'] for r in mine] == [c['client_id'] for c in clients]
                assert [int(r['client']) for r in mine] == list(range(len(clients)))
                np.testing.assert_allclose([float(r['accuracy']) for r in mine], accuracies, rtol=1e-5)
                per_seed.append(np.asarray(accuracies))
                # Sample weights: all of a client's examples, from the run's partition.csv.
                sizes = {
                    row['client_id']: int(row['train_examples']) + int(row['val_examples']) + int(row['test_examples'])
                    for row in _read_csv(os.path.join(directory, 'partition.csv'))
                }
                weights = np.asarray([sizes[c['client_id']] for c in clients], dtype=float)
                assert [int(r['examples']) for r in mine] == list(weights.astype(int))
                top = np.argsort(-weights, kind='stable')[: int(np.ceil(0.1 * len(clients)))]
                weighted_per_seed.append(100 * np.average(accuracies, weights=weights))
                top_per_seed.append(100 * np.average(np.asarray(accuracies)[top], weights=weights[top]))
            means = [100 * a.mean() for a in per_seed]
            stds = [100 * a.std() for a in per_seed]  # population std across clients
            row = summary[(partition.name, algorithm.name)]
            assert row['model'] == model and row['runs'] == '2/2'
            assert float(row['accuracy_mean']) == pytest.approx(np.mean(means), abs=1e-3)
            assert float(row['accuracy_std_over_seeds']) == pytest.approx(np.std(means, ddof=1), abs=1e-3)
            assert float(row['client_std']) == pytest.approx(np.mean(stds), abs=1e-3)
            assert float(row['worst_10']) == pytest.approx(np.mean([100 * a.min() for a in per_seed]), abs=1e-3)
            assert float(row['weighted_mean']) == pytest.approx(np.mean(weighted_per_seed), abs=1e-3)
            assert float(row['weighted_mean_std_over_seeds']) == pytest.approx(
                np.std(weighted_per_seed, ddof=1), abs=1e-3
            )
            assert float(row['top_10_by_samples']) == pytest.approx(np.mean(top_per_seed), abs=1e-3)
            # The paper-style table: client i averaged over seeds, Avg. Acc., Std Dev.
            column = f'{algorithm.name} {partition.name}'
            header = next(line for line in report.splitlines() if line.startswith('|  |'))
            index = [c.strip() for c in header.split('|')].index(column)
            per_client = np.mean(per_seed, axis=0) * 100
            for i, value in enumerate(per_client):
                line = next(line for line in report.splitlines() if line.startswith(f'| User {i} |'))
                assert line.split('|')[index].strip() == f'{value:.2f}'
            avg = next(line for line in report.splitlines() if line.startswith('| Avg. Acc. |'))
            assert avg.split('|')[index].strip() == f'{np.mean(means):.2f}'
            std = next(line for line in report.splitlines() if line.startswith('| Std Dev |'))
            assert std.split('|')[index].strip() == f'{np.mean(stds):.2f}'
            # Seconds per round: the median of the runs' training rounds (metrics.csv), mean over seeds.
            medians = [
                np.median(
                    [
                        float(r['round_seconds'])
                        for r in _read_csv(
                            os.path.join(out, 'runs', partition.slug, algorithm.slug, f'seed{seed}', 'metrics.csv')
                        )
                    ]
                )
                for seed in suite.seeds
            ]
            assert float(row['seconds_per_round']) == pytest.approx(np.mean(medians), rel=1e-4)
    # Columns grouped by algorithm, then partition, as in the paper's Table 3.
    assert '|  | FedAvg natural | FedAvg IID | PersFL natural | PersFL IID |' in report
    # Ours vs the paper, with the difference.
    fedavg = summary[('natural', 'FedAvg')]
    line = next(line for line in report.splitlines() if line.startswith('| FedAvg | natural | global_model |'))
    assert f'{float(fedavg["accuracy_mean"]) - 50.0:+.2f}' in line and '| 50.0 | 10.0 |' in line
    persfl = summary[('IID', 'PersFL')]
    line = next(line for line in report.splitlines() if line.startswith('| PersFL | IID | personalized_model |'))
    weighted, top = float(persfl['weighted_mean']), float(persfl['top_10_by_samples'])
    assert line.endswith(f'| 40.0 | {weighted - 40.0:+.2f} | 45.5 | {top - 45.5:+.2f} |')
    assert 'tff-pfl-bench --suite=' in report and '    second' in report
    for partition in suite.partitions:
        for kind in ('curves', 'clients', 'std'):
            name = f'{kind}_{partition.slug}.png'
            assert f']({name})' in report
            with open(os.path.join(out, name), 'rb') as f:
                assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_rounds_to_target_and_communication(tiny_run):
    suite, out = tiny_run['suite'], tiny_run['out']
    target = suite.target_accuracy
    for run in suite.runs():
        directory = run.directory(out)
        with open(os.path.join(directory, bench_layout.RESULT_FILE)) as f:
            record = json.load(f)
        metrics = _read_csv(os.path.join(directory, 'metrics.csv'))
        key = f'test_{run.algorithm.model}_accuracy_mean'
        if run.algorithm.algorithm == 'persfl':
            # The personalized model is made by the final personalize stage.
            assert record['final_only'] and [p['round'] for p in record['curve']] == [2]
            reached = [2] if float(metrics[-1][key]) >= target else []
        else:
            assert [p['round'] for p in record['curve']] == [1, 2]
            reached = [int(m['round']) for m in metrics if float(m[key]) >= target]
        assert record['rounds_to_target'] == (reached[0] if reached else None)
        # 3 clients take part in each of the 2 rounds; personalize runs once on every client.
        comm = record['communication']
        assert comm['client_rounds'] == 6
        down = 6 * comm['bytes_down_per_client_per_round'] + 3 * comm.get('personalize_bytes_down_per_client', 0)
        assert comm['bytes_down_total'] == down and comm['bytes_down_per_client'] == down / 3
        assert comm['bytes_up_total'] == 6 * comm['bytes_up_per_client_per_round']
        assert comm['has_personalize'] == (run.algorithm.algorithm == 'persfl')
        if run.algorithm.algorithm == 'fedavg':  # logistic regression, 60 features, 10 classes
            assert comm['bytes_down_per_client_per_round'] == (60 * 10 + 10) * 4 + 4
    summary = {(r['partition'], r['algorithm']): r for r in _read_csv(os.path.join(out, 'summary.csv'))}
    for row in tiny_run['rows']:
        assert summary[(row['partition'], row['algorithm'])]['rounds'] == '2'
        assert row['bytes_down_per_client'] > 0 and row['bytes_up_per_client'] > 0
        if row['algorithm'] == 'FedAvg':  # per round: the model and round number down
            assert row['bytes_down_per_client_per_round'] == (60 * 10 + 10) * 4 + 4


def test_incomplete_run_is_redone_and_others_are_not(tiny_run, tmp_path):
    suite = tiny_run['suite']
    out = str(tmp_path / 'copy')
    shutil.copytree(tiny_run['out'], out)
    redo = suite.select(seeds=[1], algorithms=['FedAvg'], partitions=['IID'])[0]
    os.remove(os.path.join(redo.directory(out), bench_layout.RESULT_FILE))
    with open(os.path.join(redo.directory(out), 'stale'), 'w') as f:
        f.write('left by an interrupted run')
    before = {r.label: _result_state(r.directory(out)) for r in suite.runs() if r != redo}
    lines = []
    bench_run.run_suite(suite, out, log=lines.append)
    assert lines[0] == 'tiny: 8 runs selected, 7 already complete, 1 to run'
    assert lines[1] == 'run 1/1 IID/FedAvg/seed1: incomplete, redoing it'
    assert not os.path.exists(os.path.join(redo.directory(out), 'stale'))
    assert os.path.exists(os.path.join(redo.directory(out), bench_layout.RESULT_FILE))
    assert before == {r.label: _result_state(r.directory(out)) for r in suite.runs() if r != redo}


class _Interrupted(Exception):
    pass


def test_an_interrupted_run_continues_from_its_checkpoint_to_the_same_numbers(tiny_run, tmp_path, monkeypatch):
    suite = tiny_run['suite']
    out = str(tmp_path / 'copy')
    shutil.copytree(tiny_run['out'], out)
    run = suite.select(seeds=[1], algorithms=['PersFL'], partitions=['IID'])[0]
    shutil.rmtree(run.directory(out))
    write_progress = bench_run._RunLog.__call__

    def interrupting(self, line):  # the run stops right after round 1 and its checkpoint
        write_progress(self, line)
        if line.startswith('round 1/2'):
            raise _Interrupted

    monkeypatch.setattr(bench_run._RunLog, '__call__', interrupting)
    with pytest.raises(_Interrupted):
        bench_run.run_suite(suite, out, seeds=[1], algorithms=['PersFL'], partitions=['IID'], checkpoint_every=1)
    monkeypatch.undo()
    config = bench_run.run_config(suite, out, run, checkpoint_every=1)
    assert experiment.resumable_round(config) == 1
    # Where and how often it checkpoints may change; what it computes may not.
    assert experiment.resumable_round(config.replace(checkpoint_every=7)) == 1
    assert experiment.resumable_round(config.replace(rounds_per_call=2, checkpoint_every=2)) == 1
    assert experiment.resumable_round(config.replace(rounds=3)) is None
    # What to do on a non-finite loss may change, and a config.json from before that setting resumes.
    assert experiment.resumable_round(config.replace(stop_on_divergence=False)) == 1
    saved_path = os.path.join(run.directory(out), 'config.json')
    with open(saved_path) as f:
        saved = json.load(f)
    del saved['stop_on_divergence']
    with open(saved_path, 'w') as f:
        json.dump(saved, f, indent=2)
    assert experiment.resumable_round(config) == 1
    lines = []
    bench_run.run_suite(suite, out, checkpoint_every=1, log=lines.append)
    assert lines[0] == 'tiny: 8 runs selected, 7 already complete, 1 to run'
    assert lines[1] == 'run 1/1 IID/PersFL/seed1: incomplete, continuing from its round-1 checkpoint'
    with open(os.path.join(run.directory(out), bench_layout.RESULT_FILE)) as f:
        continued = json.load(f)
    with open(os.path.join(run.directory(tiny_run['out']), bench_layout.RESULT_FILE)) as f:
        uninterrupted = json.load(f)
    assert (continued['continued'], uninterrupted['continued']) == (True, False)
    assert (continued['continued_from_round'], uninterrupted['continued_from_round']) == (1, None)
    # Its seconds: this sitting's plus round 1's, trained by the interrupted sitting.
    with open(os.path.join(run.directory(out), 'metrics.csv')) as f:
        round1 = float(next(row for row in csv.DictReader(f) if row['round'] == '1')['round_seconds'])
    assert continued['seconds'] == pytest.approx(continued['seconds_this_sitting'] + round1, abs=1e-2)
    assert uninterrupted['seconds'] == uninterrupted['seconds_this_sitting']
    for key in ('summary', 'clients', 'curve', 'communication', 'final_round', 'partition_csv'):
        assert continued[key] == uninterrupted[key], key
    # The older config.json was rewritten with the configuration the run went on with.
    with open(saved_path) as f:
        assert json.load(f) == json.loads(json.dumps(config.to_dict()))
    # A complete run keeps its record, not its checkpoints.
    assert not os.path.exists(os.path.join(run.directory(out), 'checkpoints'))


def test_a_run_on_another_partition_fails_loudly(tiny_run, tmp_path):
    suite = tiny_run['suite']
    out = str(tmp_path / 'copy')
    shutil.copytree(tiny_run['out'], out)
    fedavg_run, persfl_run = suite.select(seeds=[0], partitions=['natural'])
    # The FedAvg run's record says it trained on another partition.
    record_path = os.path.join(fedavg_run.directory(out), bench_layout.RESULT_FILE)
    with open(record_path) as f:
        record = json.load(f)
    record['partition_csv'] += 'client_99999,1,1,1\n'
    with open(record_path, 'w') as f:
        json.dump(record, f)
    os.remove(os.path.join(persfl_run.directory(out), bench_layout.RESULT_FILE))
    with pytest.raises(
        bench_suite.SuiteError, match='natural/PersFL/seed0 trains on another partition than natural/FedAvg/seed0'
    ):
        bench_run.run_suite(suite, out, seeds=[0], algorithms=['PersFL'], log=lambda line: None)
    # Aggregation checks the same from the stored results.
    shutil.copy(
        os.path.join(tiny_run['out'], 'runs', 'natural', 'persfl', 'seed0', bench_layout.RESULT_FILE),
        os.path.join(persfl_run.directory(out), bench_layout.RESULT_FILE),
    )
    with pytest.raises(bench_suite.SuiteError, match='trained on different partitions'):
        bench_report.write_report(suite, out, log=lambda line: None)


def test_a_different_suite_is_refused(tiny_run, tmp_path):
    out = tiny_run['out']
    state = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    changed = bench_parse.parse_suite(TINY.replace('rounds = 2', 'rounds = 3'), 'tiny.toml')
    with pytest.raises(bench_suite.SuiteError, match='holds results of a different suite'):
        bench_run.run_suite(changed, out, log=lambda line: None)
    with pytest.raises(bench_suite.SuiteError, match='different suite'):
        bench_run.check_report_dir(changed, out)
    assert state == {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    # Comments and layout are not content; nor are the description and the paper numbers.
    bench_run.check_report_dir(bench_parse.parse_suite('# a comment\n' + TINY, 'tiny.toml'), out)
    renamed = TINY.replace('source = "A paper, Table 1, Synthetic(1,1)"', 'source = "Another table"')
    assert bench_suite.same_runs(
        TINY, bench_parse.parse_suite(renamed.replace('[50.0, 10.0]', '[60.0, 5.0]'), 't.toml')
    )
    assert not bench_suite.same_runs(TINY, changed) and not bench_suite.same_runs(None, changed)
    # A directory that holds something else is not taken over without --overwrite.
    other = tmp_path / 'other'
    other.mkdir()
    (other / 'notes.txt').write_text('mine')
    with pytest.raises(bench_suite.SuiteError, match='holds no benchmark; pass --overwrite'):
        bench_run.run_suite(changed, str(other), log=lambda line: None)
    assert os.listdir(other) == ['notes.txt']


def test_a_suite_that_only_adds_runs_keeps_the_results(tiny_run, tmp_path):
    out = str(tmp_path / 'tiny')
    shutil.copytree(tiny_run['out'], out)
    local = '[[algorithms]]\nname = "Local"\nalgorithm = "local"\nmodel = "personalized_model"\n[paper]'
    grown = TINY.replace('seeds = [0, 1]', 'seeds = [0, 1, 2]').replace('[paper]', local, 1)
    grown = grown.replace('[[algorithms]]', '[[partitions]]\nname = "more"\npartition = "iid"\n[[algorithms]]', 1)
    extended = bench_parse.parse_suite(grown, 'tiny.toml')
    assert len(extended.runs()) == 3 * 3 * 3
    assert bench_suite.same_runs(TINY, extended) and not bench_suite.same_runs(grown, tiny_run['suite'])
    bench_run.check_report_dir(extended, out)
    # The stored runs are complete runs of the grown suite; only the selection left to run would run.
    lines = []
    selection = dict(seeds=[0, 1], algorithms=['FedAvg', 'PersFL'], partitions=['natural', 'IID'])
    bench_run.run_suite(extended, out, log=lines.append, **selection)
    assert 'tiny: 8 runs selected, 8 already complete, 0 to run' in lines
    with open(os.path.join(out, bench_layout.SUITE_FILE), encoding='utf-8') as f:
        assert f.read() == grown
    # A stored run whose settings the suite changes, or a stored run the suite drops, is another suite's.
    for other in (
        TINY.replace('distill_epochs = 1', 'distill_epochs = 2'),
        TINY.replace('seeds = [0, 1]', 'seeds = [0]'),
        TINY.replace('batch_size = 16', 'batch_size = 8').replace('seeds = [0, 1]', 'seeds = [0, 1, 2]'),
    ):
        assert not bench_suite.same_runs(TINY, bench_parse.parse_suite(other, 'tiny.toml'))


def test_results_dir_keeps_records_and_a_fresh_output_dir_adds_to_them(tiny_run, tmp_path):
    """A results directory outlives the output directory: later sittings add to it."""
    suite, out = tiny_run['suite'], tiny_run['out']
    results = str(tmp_path / 'results')
    lines = []
    # Publishing the complete benchmark: the report, its CSVs and plots, and one record per run.
    bench_run.run_suite(suite, out, results_dir=results, report_only=True, log=lines.append)
    assert f'{suite.name}: 8 runs selected, 8 complete, none run (--report_only)' in lines
    assert lines[-1] == f'results: {results} (8 of 8 run records)'
    for name in bench_layout.PUBLISHED_FILES + ('curves_natural.png', 'clients_iid.png'):
        # One model for every client: no accuracy by architecture.
        assert os.path.exists(os.path.join(results, name)) == (name != bench_layout.ARCHITECTURES_FILE), name
    for run in suite.runs():
        with open(bench_layout.record_path(results, run)) as f:
            assert f.read() == bench_layout.file_text(os.path.join(run.directory(out), bench_layout.RESULT_FILE))
    assert bench_layout.record_path(results, suite.runs()[0]).endswith('records/natural/fedavg/seed0.json')
    # A fresh output directory (a new checkout): the records count as complete runs, and only the
    # run whose record is gone trains.
    missing = suite.select(seeds=[1], algorithms=['FedAvg'], partitions=['natural'])[0]
    os.remove(bench_layout.record_path(results, missing))
    fresh = str(tmp_path / 'fresh')
    lines = []
    bench_run.run_suite(suite, fresh, command='third', results_dir=results, log=lines.append)
    assert lines[:2] == [
        f'tiny: 7 complete runs restored from {results}',
        'tiny: 8 runs selected, 7 already complete, 1 to run',
    ]
    assert lines[2].startswith('run 1/1 natural/FedAvg/seed1: ')
    assert os.path.exists(bench_layout.record_path(results, missing))
    # The same numbers as the benchmark that ran everything in one directory.
    for name in ('results.csv', 'summary.csv'):
        mine, theirs = _read_csv(os.path.join(results, name)), _read_csv(os.path.join(out, name))
        drop = {'minutes_per_run', 'seconds_per_round'}  # timings differ from run to run
        assert [{k: v for k, v in r.items() if k not in drop} for r in mine] == [
            {k: v for k, v in r.items() if k not in drop} for r in theirs
        ]
    with open(os.path.join(results, bench_layout.COMMANDS_FILE)) as f:
        assert f.read() == 'first\nsecond\nthird\n'
    # A sitting cut short after its first run keeps that run's record (and the suite beside it).
    cut = str(tmp_path / 'cut')

    def interrupt(line):
        if line.startswith('run 1/'):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench_run.run_suite(suite, str(tmp_path / 'cut_out'), seeds=[0], results_dir=cut, log=interrupt)
    first = suite.select(seeds=[0])[0]
    assert sorted(os.listdir(cut)) == sorted([bench_layout.SUITE_FILE, bench_layout.RECORDS_DIR])
    published = json.loads(bench_layout.file_text(bench_layout.record_path(results, first)))
    with open(bench_layout.record_path(cut, first)) as f:
        assert json.load(f)['summary'] == published['summary']
    bench_run.check_results_dir(suite, str(tmp_path / 'next_out'), cut)
    # Bad results directories: refused before anything is written.
    with pytest.raises(bench_suite.SuiteError, match='is the output directory'):
        bench_run.run_suite(suite, fresh, results_dir=fresh, log=lines.append)
    changed = bench_parse.parse_suite(TINY.replace('rounds = 2', 'rounds = 3'), 'tiny.toml')
    with pytest.raises(bench_suite.SuiteError, match='results_dir .* holds results of a different suite'):
        bench_run.run_suite(changed, str(tmp_path / 'other'), results_dir=results, log=lines.append)
    assert not os.path.exists(tmp_path / 'other')


# ----------------------------------------------------------------------------
# The binary.


def _start(*flags):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.Popen(
        [sys.executable, '-m', 'tff_pfl_bench.cli', *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def test_binary(tiny_run, tmp_path):
    """Bad input: one line on stderr, exit 2, nothing written; --report_only re-aggregates."""
    suite_path = tmp_path / 'tiny.toml'
    suite_path.write_text(TINY)
    bad_toml = tmp_path / 'bad.toml'
    bad_toml.write_text('name = "x"\n[defaults\n')
    unknown_key = tmp_path / 'unknown.toml'
    unknown_key.write_text(TINY.replace('num_clients = 3', 'num_clients = 3\nlearning_rate = 0.1'))
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    out = tmp_path / 'out'
    report_dir = tmp_path / 'report_only'
    shutil.copytree(tiny_run['out'], report_dir)
    os.remove(report_dir / 'report.md')
    cases = [
        ([f'--suite={tmp_path / "missing.toml"}', f'--output_dir={out}'], 'suite file not found'),
        ([f'--suite={bad_toml}', f'--output_dir={out}'], 'bad TOML'),
        ([f'--suite={unknown_key}', f'--output_dir={out}'], 'defaults.learning_rate: unknown key'),
        ([f'--suite={suite_path}', f'--output_dir={blocker}/out'], 'is not writable'),
        ([f'--suite={suite_path}', f'--output_dir={out}', '--algorithms=FedAvg,pFedMe'], 'unknown algorithm pFedMe'),
        ([f'--suite={suite_path}', f'--output_dir={out}', '--seeds=0,x'], '--seeds must be integers'),
        ([f'--suite={suite_path}', f'--output_dir={out}', '--report_only'], 'does not exist'),
        ([f'--output_dir={out}'], '--suite is required'),
        ([f'--suite={suite_path}', f'--output_dir={out}', f'--results_dir={out}'], 'is the output directory'),
        ([f'--suite={suite_path}', f'--output_dir={out}', f'--results_dir={blocker}'], 'is not a directory'),
    ]
    started = [(_start(*flags), message) for flags, message in cases]
    report = _start(f'--suite={suite_path}', f'--output_dir={report_dir}', '--report_only')
    for process, message in started:
        stdout, stderr = process.communicate(timeout=300)
        lines = stderr.strip().splitlines()
        assert process.returncode == 2, stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith('tff-pfl-bench: error: '), stderr[-2000:]
        assert message in lines[0], lines[0]
    assert not out.exists() and blocker.read_text() == ''
    stdout, stderr = report.communicate(timeout=300)
    assert report.returncode == 0, stderr[-2000:]
    assert f'report: {report_dir}/report.md (8 of 8 runs complete)' in stdout
    with open(report_dir / 'report.md') as f, open(os.path.join(tiny_run['out'], 'report.md')) as g:

        def section(text):
            return text.split('## Test accuracy per client')[1].split('## Commands')[0]

        assert section(f.read()) == section(g.read())


def test_the_binary_refuses_flags_and_toml_before_importing_tensorflow(tmp_path):
    """A wrong flag, a missing suite file or bad TOML is refused without TensorFlow's start-up."""
    bad_toml = tmp_path / 'bad.toml'
    bad_toml.write_text('name = "x"\n[defaults\n')
    probe = (
        'import sys\n'
        'from tff_pfl_bench import cli\n'
        'sys.argv = ["tff-pfl-bench", *sys.argv[1:]]\n'
        'try:\n'
        '    cli.run()\n'
        'except SystemExit as e:\n'
        '    print(e.code, sorted(m for m in ("tensorflow", "tensorflow_federated") if m in sys.modules))\n'
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    for flags, message in [
        ([f'--output_dir={tmp_path}/out'], '--suite is required'),
        ([f'--suite={tmp_path}/missing.toml'], 'suite file not found'),
        ([f'--suite={bad_toml}'], 'bad TOML'),
        ([f'--suite={bad_toml}', '--seeds=0,x'], '--seeds must be integers'),
    ]:
        done = subprocess.run(
            [sys.executable, '-c', probe, *flags], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
        )
        assert done.stdout.strip() == '2 []', (flags, done.stdout, done.stderr[-2000:])
        assert done.stderr.strip().startswith('tff-pfl-bench: error: ') and message in done.stderr, done.stderr
        assert not (tmp_path / 'out').exists()


def test_client_lift_by_hand():
    """benchmarks/client_lift.py: per-client differences to a baseline, on the same client and seed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location('client_lift', os.path.join(REPO, 'benchmarks', 'client_lift.py'))
    client_lift = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client_lift)

    def row(algorithm, seed, client, accuracy):
        return dict(partition='p', algorithm=algorithm, seed=str(seed), client_id=client, accuracy=str(accuracy))

    rows = [row('FedAvg', 0, f'c{i}', a) for i, a in enumerate([0.5, 0.2, 0.9])]
    rows += [row('FedAvg', 1, f'c{i}', a) for i, a in enumerate([0.4, 0.3, 0.8])]
    rows += [row('Mine', 0, f'c{i}', a) for i, a in enumerate([0.6, 0.2, 0.7])]
    rows += [row('Mine', 1, f'c{i}', a) for i, a in enumerate([0.5, 0.6, 0.8])]
    (result,) = client_lift.lift(rows, 'FedAvg')
    np.testing.assert_allclose(result['differences'], [10, 0, -20, 10, 30, 0], atol=1e-9)
    assert (result['clients'], result['above'], result['equal'], result['below']) == (6, 0.5, 2 / 6, 1 / 6)
    assert result['mean'] == pytest.approx(30 / 6) and result['median'] == pytest.approx(5)
    # FedAvg's worst 10 % of its 6 (client, seed) pairs: ceil(0.6) = 1, client c1 of seed 0 (20 %): Mine +0.
    assert result['worst_10_of_baseline'] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="'Other' has no results in partition 'p'"):
        client_lift.lift(rows, 'Other')


DP_SUITE = """
name = "dp"
description = "accuracy against epsilon"
[defaults]
dataset = "synthetic"
num_clients = 6
rounds = 2
eval_every = 0
client_fraction = 0.5
seeds = [0]
[[partitions]]
name = "natural"
partition = "natural"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
model = "global_model"
[[algorithms]]
name = "FedAvg z=1"
algorithm = "fedavg"
model = "global_model"
[algorithms.overrides]
dp_noise_multiplier = 1.0
dp_clip = 1.0
dp_delta = 0.001
"""


def test_a_dp_suite_reports_epsilon_and_plots_accuracy_against_it(tmp_path, tff_runtime):
    from tff_pfl.computations import privacy

    path = tmp_path / 'dp.toml'
    path.write_text(DP_SUITE)
    suite = bench_parse.load_suite(str(path))
    out = str(tmp_path / 'out')
    rows = bench_run.run_suite(suite, out, log=lambda line: None)
    by_name = {row['algorithm']: row for row in rows}
    want = privacy.epsilon(privacy.DPConfig(1.0, 3.0, clip=1.0), 0.5, 2, 1e-3)
    assert by_name['FedAvg']['epsilon'] is None
    assert by_name['FedAvg z=1']['epsilon'] == pytest.approx(want, rel=1e-9)
    with open(os.path.join(out, 'report.md')) as f:
        report = f.read()
    assert '| diff std | epsilon |' in report
    assert 'no DP' in report and f'{want:.3g}' in report
    assert os.path.getsize(os.path.join(out, 'epsilon_natural.png')) > 0


def test_the_report_names_the_runs_that_diverged():
    import types

    def record(algorithm, seed, diverged_round):
        run = types.SimpleNamespace(
            algorithm=types.SimpleNamespace(name=algorithm), partition=types.SimpleNamespace(name='c20'), seed=seed
        )
        return {'run': run, 'diverged_round': diverged_round}

    assert bench_report._diverged_lines([record('FedAvg', 0, None), {'run': None}]) == []
    (line, blank) = bench_report._diverged_lines(
        [record('pFedMe', 0, 4), record('FedAvg', 1, None), record('Ditto', 2, 7)]
    )
    assert line == (
        'Diverged (mean training loss NaN or infinite; the run stopped there and its models were evaluated): '
        'pFedMe c20 seed 0 at round 4; Ditto c20 seed 2 at round 7.'
    )
    assert blank == ''


def test_a_command_repeated_over_sittings_is_listed_once_with_its_count():
    commands = ['b --seeds=0', 'b --seeds=1', 'b --seeds=0', 'b --seeds=0', 'b --seeds=2']
    assert bench_report.distinct_commands(commands) == [
        'b --seeds=0  # 3 sittings',
        'b --seeds=1',
        'b --seeds=2',
    ]
    assert bench_report.distinct_commands([]) == []


def test_accuracy_by_client_architecture_by_hand():
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')
    splits = [(20, 5, 5)] * 11
    seed0 = _fake_record(suite, 'natural', 'FedAvg', 0, [i / 10 for i in range(11)], splits)
    seed1 = _fake_record(suite, 'natural', 'FedAvg', 1, [0.5] * 11, splits)
    homogeneous = _fake_record(suite, 'IID', 'FedAvg', 0, [0.5] * 11, splits)
    for record in (seed0, seed1):
        record['config'] = {'settings': {'architectures': ['a', 'b', 'a']}}  # client i: ['a', 'b', 'a'][i % 3]
    homogeneous['config'] = {'settings': {'architectures': ['a', 'a']}}
    # The records list their clients in another order than partition.csv: the assignment follows partition.csv.
    seed0['clients'].reverse()
    assert bench_aggregate.client_architectures(homogeneous) is None
    assert bench_aggregate.client_architectures({'config': {}, 'partition_csv': seed0['partition_csv']}) is None
    assert bench_aggregate.client_architectures(seed0)['c4'] == 'b'
    rows = bench_aggregate.architecture_rows(suite, [seed0, seed1, homogeneous])
    # Seed 0 by hand: a = clients 0 2 3 5 6 8 9, (0 + .2 + .3 + .5 + .6 + .8 + .9) / 7; b = 1 4 7 10, 2.2 / 4.
    a0, b0 = 100 * 3.3 / 7, 100 * 2.2 / 4
    assert [(r['partition'], r['algorithm'], r['architecture'], r['clients'], r['runs']) for r in rows] == [
        ('natural', 'FedAvg', 'a', 7, '2/2'),
        ('natural', 'FedAvg', 'b', 4, '2/2'),
    ]
    assert rows[0]['accuracy_mean'] == pytest.approx((a0 + 50) / 2)
    assert rows[1]['accuracy_mean'] == pytest.approx((b0 + 50) / 2)
    assert rows[1]['accuracy_std_over_seeds'] == pytest.approx(abs(b0 - 50) / np.sqrt(2))
    text = bench_report.render_report(suite, '/tmp/x', [seed0, seed1], [], [], [], arch_rows=rows)
    assert f'| FedAvg | natural | 2/2 | {(a0 + 50) / 2:.2f} ± {abs(a0 - 50) / np.sqrt(2):.2f} |' in text
    assert '| algorithm | partition | runs | a (7) | b (4) |' in text
    assert '## Test accuracy by client architecture' not in bench_report.render_report(suite, '/tmp/x', [], [], [], [])
    seed0['clients'][0]['client_id'] = 'elsewhere'
    with pytest.raises(bench_suite.SuiteError, match='client elsewhere is not in its partition.csv'):
        bench_aggregate.architecture_rows(suite, [seed0])


def test_a_published_report_reproduces_into_the_default_output_dir_not_the_one_it_was_rebuilt_in():
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')
    records = [_fake_record(suite, 'natural', 'FedAvg', 0, [0.5] * 11, [(20, 5, 5)] * 11)]
    rows = bench_aggregate.aggregate(suite, records)

    def reproduce(**kwargs):
        text = bench_report.render_report(suite, '/tmp/rebuilt', records, rows, [], ['b', 'b'], **kwargs)
        lines = text.splitlines()
        return lines[lines.index('## Commands') + 4], lines[-2]

    assert reproduce() == ('    tff-pfl-bench --suite=tiny.toml --output_dir=/tmp/rebuilt', '    b  # 2 sittings')
    assert reproduce(published=True)[0] == '    tff-pfl-bench --suite=tiny.toml --output_dir=runs/bench/tiny'


def test_records_made_by_different_code_are_flagged_in_the_communication_table():
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')
    splits = [(20, 5, 5)] * 11
    records = [_fake_record(suite, 'natural', 'FedAvg', seed, [0.5] * 11, splits) for seed in (0, 1)]
    for r in records:  # what seed 0's code sent up: 20 slots; the later seeds': one row
        r['communication'] = {'bytes_down_per_client_per_round': 8_000, 'bytes_up_per_client_per_round': 2_000}
    (row,) = bench_aggregate.aggregate(suite, records)
    assert row['communication_by_seed'] is None
    assert 'different versions of the code' not in bench_report.render_report(suite, '/tmp/x', records, [row], [], [])
    records[0]['communication'] = {'bytes_down_per_client_per_round': 8_000, 'bytes_up_per_client_per_round': 40_000}
    (row,) = bench_aggregate.aggregate(suite, records)
    assert row['communication_by_seed'] == [(0, 8_000, 40_000), (1, 8_000, 2_000)]
    assert row['bytes_up_per_client_per_round'] == pytest.approx(42_000 / 2)
    text = bench_report.render_report(suite, '/tmp/x', records, [row], [], [])
    assert '- natural/FedAvg: seed 0: 8.0 kB down, 40.0 kB up; seed 1: 8.0 kB down, 2.0 kB up.' in text.splitlines()


def test_minutes_of_a_run_recorded_before_sittings_were_summed_are_flagged():
    suite = bench_parse.parse_suite(TINY, 'tiny.toml')
    splits = [(20, 5, 5)] * 11
    records = [_fake_record(suite, 'natural', 'FedAvg', seed, [0.5] * 11, splits) for seed in (0, 1)]
    for r, seconds in zip(records, (600.0, 1200.0)):
        r['seconds'] = seconds
    records[1].update(continued=True, continued_from_round=1, seconds_this_sitting=300.0)
    (row,) = bench_aggregate.aggregate(suite, records)
    assert row['minutes_per_run'] == pytest.approx(15.0)
    assert row['minutes_last_sitting_only'] is False
    text = bench_report.render_report(suite, '/tmp/x', records, [row], [], [])
    assert '| 15.00 |' in text and 'last sitting' not in text
    del records[1]['seconds_this_sitting']  # a continued run's record from before: its last sitting only
    (row,) = bench_aggregate.aggregate(suite, records)
    assert row['minutes_last_sitting_only'] is True
    text = bench_report.render_report(suite, '/tmp/x', records, [row], [], [])
    assert '| 15.00 * |' in text and '\\* Counts only the last sitting' in text


def test_the_selected_round_is_the_best_on_validation_and_reads_test_only_there():
    curve = [{'round': 5, 'accuracy': 0.9}, {'round': 10, 'accuracy': 0.5}, {'round': 15, 'accuracy': 0.7}]
    val = [{'round': 5, 'accuracy': 0.6}, {'round': 10, 'accuracy': 0.8}, {'round': 15, 'accuracy': 0.8}]
    # Validation peaks (tied) at rounds 10 and 15: the earliest, whatever test says (its best is round 5).
    assert bench_record.selected_round(curve, val) == {'round': 10, 'val_accuracy': 0.8, 'test_accuracy': 0.5}
    assert bench_record.selected_round(curve, []) is None
    rows = [
        {'round': 5, 'test_global_model_accuracy_mean': 0.9, 'val_global_model_accuracy_mean': 0.6},
        {'round': 6},
        {'round': 10, 'test_global_model_accuracy_mean': 0.5, 'val_global_model_accuracy_mean': 0.8},
    ]
    assert bench_record.model_curve(rows, 'global_model', False, split='val') == [
        {'round': 5, 'accuracy': 0.6},
        {'round': 10, 'accuracy': 0.8},
    ]
