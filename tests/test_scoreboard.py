"""The scoreboard (docs/reports/scoreboard.md): paper numbers of the suites against the committed results."""

import csv
import glob
import importlib.util
import json
import os

import numpy as np
import pytest

from tff_pfl_bench import bench_aggregate, bench_layout, bench_parse, bench_report, bench_suite, scoreboard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = """
name = "fake"
description = "two partitions, two algorithms"
[defaults]
dataset = "npz:data/digits.npz"
num_clients = 3
rounds = 2
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
model = "global_model"
[[algorithms]]
name = "FT"
algorithm = "fedavg_ft"
model = "personalized_model"
[paper]
"FedAvg" = { natural = [80.0, 5.0], IID = { weighted = 90.0, top10 = 99.0 } }
"FT" = { natural = { worst10 = 60.0, mean = 70.25 }, IID = 50 }
[paper_source]
source = "Some paper, Table 2, digits"
"""

# summary.csv as bench_report writes it (the columns the scoreboard reads, and one it does not).
SUMMARY = """\
partition,algorithm,model,seeds,runs,accuracy_mean,accuracy_std_over_seeds,client_std,worst_10,\
worst_10_std_over_seeds,weighted_mean,weighted_mean_std_over_seeds,top_10_by_samples,\
top_10_by_samples_std_over_seeds,rounds
natural,FedAvg,global_model,0 1 2,3/3,81.5,0.5,4.0,70,1,82,1,90,2,2
natural,FT,personalized_model,0 1 2,3/3,72.25,1.25,3.0,58.5,0.75,,,,,2
IID,FedAvg,global_model,0,1/3,93,,0.5,91,,92.0,,96.9,,2
"""

COMMANDS = """\
tff-pfl-bench --suite=benchmarks/suites/fake.toml --output_dir=runs/bench/fake --partitions=natural
tff-pfl-bench --suite=benchmarks/suites/fake.toml --output_dir=runs/bench/fake --partitions IID --algorithms=FedAvg
"""

UNRUN = """
name = "unrun"
[defaults]
dataset = "synthetic"
seeds = [0]
[[partitions]]
name = "natural"
partition = "natural"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
[paper]
"FedAvg" = { natural = { top10 = 12.5 } }
"""

NO_PAPER = UNRUN.split('[paper]')[0].replace('"unrun"', '"no_paper"')


def _tree(root, summary=SUMMARY, stored_suite=SUITE):
    """A repository root with three suites; only `fake` has committed results."""
    suites = root / 'benchmarks' / 'suites'
    suites.mkdir(parents=True)
    (suites / 'fake.toml').write_text(SUITE)
    (suites / 'unrun.toml').write_text(UNRUN)
    (suites / 'no_paper.toml').write_text(NO_PAPER)
    results = root / 'benchmarks' / 'results' / 'fake_suite'
    results.mkdir(parents=True)
    (results / 'summary.csv').write_text(summary)
    (results / 'commands.txt').write_text(COMMANDS)
    (results / 'suite.toml').write_text(stored_suite)
    (results / 'report.md').write_text('# fake\n')
    return root


def _by_key(items):
    return {(e['suite'], e['partition'], e['algorithm'], e['metric']): e for e in items}


def test_entries_from_a_fake_results_dir(tmp_path):
    items = scoreboard.entries(str(_tree(tmp_path)))
    # Suites in file order (fake, no_paper skipped, unrun), then partition, algorithm, metric.
    assert [(e['suite'], e['partition'], e['algorithm'], e['metric']) for e in items] == [
        ('fake', 'natural', 'FedAvg', 'mean'),
        ('fake', 'natural', 'FT', 'mean'),
        ('fake', 'natural', 'FT', 'worst10'),
        ('fake', 'IID', 'FedAvg', 'weighted'),
        ('fake', 'IID', 'FedAvg', 'top10'),
        ('fake', 'IID', 'FT', 'mean'),
        ('unrun', 'natural', 'FedAvg', 'top10'),
    ]
    by_key = _by_key(items)
    first = by_key[('fake', 'natural', 'FedAvg', 'mean')]
    assert first['source'] == 'Some paper, Table 2, digits' and first['dataset'] == 'digits'
    assert first['report'] == os.path.join('benchmarks', 'results', 'fake_suite', 'report.md')
    assert (first['paper'], first['ours'], first['ours_std'], first['runs']) == (80.0, 81.5, 0.5, '3/3')
    assert first['diff'] == pytest.approx(1.5) and first['within'] is True and first['status'] == 'ok'
    assert first['commands'] == [COMMANDS.splitlines()[0]] and first['stale'] is False
    e = by_key[('fake', 'natural', 'FT', 'mean')]
    assert (e['paper'], e['ours'], e['diff'], e['within']) == (70.25, 72.25, 2.0, True)  # 2 points: within
    e = by_key[('fake', 'natural', 'FT', 'worst10')]
    assert (e['ours'], e['ours_std'], e['diff'], e['within']) == (58.5, 0.75, -1.5, True)
    e = by_key[('fake', 'IID', 'FedAvg', 'weighted')]
    assert (e['ours'], e['ours_std'], e['runs']) == (92.0, None, '1/3')
    assert e['diff'] == pytest.approx(2.0) and e['within'] is True
    assert e['commands'] == [COMMANDS.splitlines()[1]]
    e = by_key[('fake', 'IID', 'FedAvg', 'top10')]
    assert e['diff'] == pytest.approx(-2.1) and e['within'] is False
    # A cell without a summary row is not run yet, with the command that runs it.
    e = by_key[('fake', 'IID', 'FT', 'mean')]
    assert (e['status'], e['ours'], e['diff'], e['within'], e['runs']) == ('not run yet', None, None, None, '0/3')
    assert e['commands'] == [
        'tff-pfl-bench --suite=benchmarks/suites/fake.toml --output_dir=runs/bench/fake '
        '--results_dir=benchmarks/results/fake_suite'
    ]
    e = by_key[('unrun', 'natural', 'FedAvg', 'top10')]
    assert (e['status'], e['runs'], e['report'], e['source']) == ('not run yet', '0/1', None, '')
    assert e['dataset'] == 'synthetic'

    text = scoreboard.render(items)
    assert '7 paper numbers from 2 suites: 5 with a result, 4 of them within 2 points of the paper; 2 not run yet.' in (
        text
    )
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith('| paper / table |'))
    assert header == (
        '| paper / table | suite | dataset / partition | algorithm | metric | paper | ours | seeds | diff | within 2 '
        '| command |'
    )
    rows = [[c.strip() for c in line.split('|')[1:-1]] for line in lines[lines.index(header) + 2 :]]
    assert rows[0][:10] == [
        'Some paper, Table 2, digits',
        '[fake](../../benchmarks/results/fake_suite/report.md)',
        'digits / natural',
        'FedAvg',
        'mean',
        '80.0',
        '81.50 ± 0.50',
        '3/3',
        '+1.50',
        'yes',
    ]
    assert rows[0][10] == f'`{COMMANDS.splitlines()[0]}`'
    assert rows[1][5:10] == ['70.25', '72.25 ± 1.25', '3/3', '+2.00', 'yes']
    assert rows[4][4:10] == ['top 10% by samples', '99.0', '96.90', '1/3', '-2.10', 'no']
    assert rows[5][6:10] == ['not run yet', '0/3', '', '']
    assert rows[5][10].startswith('to run: `tff-pfl-bench --suite=benchmarks/suites/fake.toml')
    assert rows[6][:2] == ['(no [paper_source])', 'unrun (`benchmarks/suites/unrun.toml`)']


def test_suites_without_paper_numbers_are_listed_after_the_table(tmp_path):
    root = _tree(tmp_path)
    (root / 'benchmarks' / 'suites' / 'no_paper.toml').write_text(
        NO_PAPER.replace('[defaults]', 'description = """Our protocol. On data the paper\nnever used."""\n[defaults]')
    )
    command = (
        'tff-pfl-bench --suite=benchmarks/suites/no_paper.toml --output_dir=runs/bench/no_paper '
        '--results_dir=benchmarks/results/no_paper_suite'
    )
    assert scoreboard.unscored(str(root)) == [
        dict(
            suite='no_paper',
            suite_path=os.path.join('benchmarks', 'suites', 'no_paper.toml'),
            report=None,
            what='Our protocol. On data the paper never used.',
            runs='0/1',
            command=command,
        )
    ]
    results = root / 'benchmarks' / 'results' / 'no_paper_suite'
    results.mkdir()
    (results / 'summary.csv').write_text('partition,algorithm,runs\nnatural,FedAvg,1/1\n')
    (results / 'report.md').write_text('# no_paper\n')
    others = scoreboard.unscored(str(root))
    assert others[0]['report'] == os.path.join('benchmarks', 'results', 'no_paper_suite', 'report.md')
    assert others[0]['runs'] == '1/1'
    text = scoreboard.render(scoreboard.entries(str(root)), others)
    assert text.index('## Suites without a paper number') > text.index('| paper / table |')
    link = '[no_paper](../../benchmarks/results/no_paper_suite/report.md)'
    assert f'| {link} | Our protocol. On data the paper never used. | 1/1 | `{command}` |' in text
    assert '## Suites without a paper number' not in scoreboard.render(scoreboard.entries(str(root)))


def test_blank_cells_old_summaries_and_stale_results(tmp_path):
    # The FT row's weighted columns are blank (a run without partition sizes).
    suite = SUITE.replace('IID = 50', 'IID = 50, natural = { weighted = 60.0 }').replace(
        'natural = { worst10 = 60.0, mean = 70.25 }, ', ''
    )
    root = _tree(tmp_path / 'blank')
    (root / 'benchmarks' / 'suites' / 'fake.toml').write_text(suite)
    e = _by_key(scoreboard.entries(str(root)))[('fake', 'natural', 'FT', 'weighted')]
    assert (e['status'], e['ours'], e['within']) == ('not available', None, None)
    # A summary.csv written before the sample-weighted columns existed.
    old = (
        'partition,algorithm,model,seeds,runs,accuracy_mean,accuracy_std_over_seeds,client_std,worst_10,rounds\n'
        'natural,FedAvg,global_model,0 1 2,3/3,81.5,0.5,4.0,70,2\n'
        'natural,FT,personalized_model,0 1 2,3/3,72.25,1.25,3.0,58.5,2\n'
        'IID,FedAvg,global_model,0,1/3,93,,0.5,91,2\n'
    )
    root = _tree(tmp_path / 'old', summary=old)
    items = _by_key(scoreboard.entries(str(root)))
    e = items[('fake', 'IID', 'FedAvg', 'weighted')]
    assert (e['status'], e['ours'], e['runs']) == ('no such column', None, '1/3')
    assert 'not in summary.csv (written before this metric was reported)' in scoreboard.render([e])
    e = items[('fake', 'natural', 'FT', 'worst10')]
    assert (e['ours'], e['ours_std']) == (58.5, None)
    # Results of other settings are marked; other paper numbers or a description are not other settings.
    root = _tree(tmp_path / 'stale', stored_suite=SUITE.replace('rounds = 2', 'rounds = 3'))
    e = _by_key(scoreboard.entries(str(root)))[('fake', 'natural', 'FedAvg', 'mean')]
    assert e['stale'] and e['ours'] == 81.5
    assert '| 3/3 (results of an older suite.toml) |' in scoreboard.render([e])
    stored = SUITE.replace('[80.0, 5.0]', '[1.0, 5.0]').replace('two partitions', 'Two partitions')
    root = _tree(tmp_path / 'fresh', stored_suite=stored.split('[paper_source]')[0])
    assert not any(e['stale'] for e in scoreboard.entries(str(root)))


PAPER_ERRORS = """
[paper_errors]
"FT" = { natural = "Table 2's FT column repeats its FedAvg column" }
"""


def test_paper_errors_are_marked_and_left_out_of_the_counts(tmp_path):
    root = _tree(tmp_path, stored_suite=SUITE)  # results written before the suite marked the error
    (root / 'benchmarks' / 'suites' / 'fake.toml').write_text(SUITE + PAPER_ERRORS)
    items = scoreboard.entries(str(root))
    by_key = _by_key(items)
    # Every metric of the marked cell carries the reason; the results are not "of an older suite.toml".
    for metric in ('mean', 'worst10'):
        e = by_key[('fake', 'natural', 'FT', metric)]
        assert e['paper_error'] == "Table 2's FT column repeats its FedAvg column" and e['status'] == 'ok'
        assert not e['stale']
    assert by_key[('fake', 'natural', 'FedAvg', 'mean')]['paper_error'] is None
    text = scoreboard.render(items)
    assert (
        '7 paper numbers from 2 suites, 2 of them paper errors (marked below, not counted); of the other 5: '
        '3 with a result, 2 of them within 2 points of the paper; 2 not run yet.'
    ) in text
    row = next(line for line in text.splitlines() if '| FT | mean |' in line)
    cells = [c.strip() for c in row.split('|')[1:-1]]
    reason = "paper error: Table 2's FT column repeats its FedAvg column"
    assert cells[5:10] == ['70.25', '72.25 ± 1.25', '3/3', '+2.00', reason]
    one = PAPER_ERRORS.replace('"FT" = { natural', '"FedAvg" = { natural')
    (root / 'benchmarks' / 'suites' / 'fake.toml').write_text(SUITE + one)
    assert '1 of them a paper error (marked below, not counted); of the other 6:' in scoreboard.generate(str(root))


@pytest.mark.parametrize(
    'errors, message',
    [
        ('"Ditto" = { natural = "x" }', 'paper_errors.Ditto: unknown algorithm label; the suite has FedAvg, FT'),
        ('"FT" = { ds9 = "x" }', 'paper_errors.FT.ds9: unknown partition label; the suite has natural, IID'),
        ('"FedAvg" = { IID = "x" }\n"FT" = { IID = "x" }', 'paper_errors.FT.IID: no such [paper] cell (paper.FT.IID)'),
        ('"FT" = { natural = " " }', 'paper_errors.FT.natural: must be a non-empty string'),
        ('"FT" = { natural = 3 }', 'paper_errors.FT.natural: must be a non-empty string'),
        ('"FT" = "x"', 'paper_errors.FT: must be a table, got str'),
    ],
)
def test_paper_errors_are_validated(errors, message):
    suite = SUITE.replace('IID = { weighted = 90.0, top10 = 99.0 }', 'IID = 90.0').replace(', IID = 50', '')
    with pytest.raises(bench_suite.SuiteError) as raised:
        bench_parse.parse_suite(suite + '[paper_errors]\n' + errors + '\n', 'x.toml')
    assert str(raised.value).startswith('x.toml: ') and message in str(raised.value)
    assert '\n' not in str(raised.value)


@pytest.mark.parametrize(
    'commands, partition, algorithm, expected',
    [
        (['tff-pfl-bench --suite=s'], 'a', 'X', [0]),
        (['tff-pfl-bench --suite=s --partitions=a,b', 'tff-pfl-bench --suite=s --partitions=c'], 'b', 'X', [0]),
        (['tff-pfl-bench --algorithms "Per-FedAvg,X" --partitions=b'], 'b', 'Per-FedAvg', [0]),
        (['tff-pfl-bench --algorithms=Y', 'tff-pfl-bench "unbalanced'], 'b', 'X', [1]),
        # A label with a comma, quoted as absl's list flag (CSV) reads it.
        (['tff-pfl-bench \'--algorithms="KT, step 0.5"\''], 'b', 'KT, step 0.5', [0]),
        (['tff-pfl-bench \'--algorithms="KT, step 0.5","KT, step 1", X\''], 'b', 'X', [0]),
        (['tff-pfl-bench \'--algorithms="KT, step 0.5"\''], 'b', 'KT', []),
        # A command invoked again (a resumed run) is listed once, where it first ran.
        (['tff-pfl-bench --seeds=0', 'tff-pfl-bench --algorithms=X', 'tff-pfl-bench --seeds=0'], 'b', 'X', [0, 1]),
    ],
)
def test_covering_commands(commands, partition, algorithm, expected):
    assert scoreboard.covering_commands(commands, partition, algorithm) == [commands[i] for i in expected]


@pytest.mark.parametrize(
    'dataset, label',
    [
        ('npz:../shared/data/mnist.npz', 'mnist'),
        ('../shared/data/fashion_mnist.npz', 'fashion_mnist'),
        ('folder:/data/cifar/', 'cifar'),
        ('tfds:emnist', 'emnist'),
        ('synthetic:0.5,0.5', 'synthetic:0.5,0.5'),
    ],
)
def test_dataset_label(dataset, label):
    assert scoreboard.dataset_label(dataset) == label


def test_main_writes_checks_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_tree(tmp_path))
    assert scoreboard.main([]) == 0
    assert capsys.readouterr().out == 'wrote docs/reports/scoreboard.md (7 paper numbers)\n'
    with open(scoreboard.OUTPUT) as f:
        assert f.read() == scoreboard.generate('.')
    assert scoreboard.main(['--check']) == 0
    with open(scoreboard.OUTPUT, 'a') as f:
        f.write('edited by hand\n')
    assert scoreboard.main(['--check']) == 1
    assert 'out of date; rerun: uv run --locked python -m tff_pfl_bench.scoreboard' in capsys.readouterr().err
    assert scoreboard.main(['--force']) == 2
    assert capsys.readouterr().err == 'scoreboard: error: unexpected arguments: --force (only --check)\n'
    (tmp_path / 'benchmarks' / 'suites' / 'bad.toml').write_text(UNRUN.replace('top10', 'top5'))
    assert scoreboard.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith('scoreboard: error: ') and 'paper.FedAvg.natural.top5: unknown metric' in err
    assert err.count('\n') == 1
    (tmp_path / 'benchmarks' / 'suites' / 'bad.toml').unlink()
    # A sitting that completed tuning trials and no run writes an empty summary: nothing to score yet.
    (tmp_path / 'benchmarks' / 'results' / 'fake_suite' / 'summary.csv').write_text('\n')
    assert scoreboard._read_summary(str(tmp_path / 'benchmarks' / 'results' / 'fake_suite')) is None
    (tmp_path / 'benchmarks' / 'results' / 'fake_suite' / 'summary.csv').write_text('a,b\n1,2\n')
    assert scoreboard.main([]) == 2
    assert 'fake_suite/summary.csv: not a tff-pfl-bench summary.csv' in capsys.readouterr().err
    monkeypatch.chdir(tmp_path / 'benchmarks')
    assert scoreboard.main([]) == 2
    assert 'run from the repository root' in capsys.readouterr().err


def test_the_committed_scoreboard_is_current():
    with open(os.path.join(REPO, scoreboard.OUTPUT), encoding='utf-8') as f:
        committed = f.read()
    assert committed == scoreboard.generate(REPO), (
        f'docs/reports/scoreboard.md is out of date; rerun: {scoreboard.GENERATE}'
    )


def test_every_committed_result_names_the_commands_that_made_it():
    # A result without a covering line in its suite's commands.txt cannot be reproduced from the page.
    missing = [
        f'{e["suite"]} / {e["partition"]} / {e["algorithm"]}'
        for e in scoreboard.entries(REPO)
        if e['status'] != 'not run yet' and not e['commands']
    ]
    assert not missing, f'results without a recorded command (commands.txt): {missing}'


# ----------------------------------------------------------------------------
# Every committed result read the same way: one folder rule, one record format.

# The summary.csv columns the scoreboard reads (`bench_aggregate.METRICS`), with their stds over seeds.
SCORED_COLUMNS = [column for columns in bench_aggregate.METRICS.values() for column in columns[:2]]


def _committed_results_dirs(root):
    """Every folder of `<root>/benchmarks/results/` that holds a suite's results (a suite.toml)."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(root, 'benchmarks', 'results', '*', 'suite.toml')))


def _read_csv(path):
    with open(path, newline='', encoding='utf-8') as f:
        return list(csv.DictReader(f))


def _record_problems(results_dir):
    """Runs of results.csv without a record in the harness's format at `bench_layout.record_path`, one line each."""
    suite = bench_parse.load_suite(os.path.join(results_dir, 'suite.toml'))
    runs = {(r.partition.name, r.algorithm.name, r.seed): r for r in suite.runs()}
    clients = {}
    for row in _read_csv(os.path.join(results_dir, 'results.csv')):
        clients.setdefault((row['partition'], row['algorithm'], int(row['seed'])), []).append(row)
    problems = []
    for key, rows in clients.items():
        path = bench_layout.record_path(results_dir, runs[key])
        if not os.path.exists(path):
            problems.append(f'{key}: no record {os.path.relpath(path, results_dir)}')
            continue
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        if (record['partition'], record['algorithm'], record['seed']) != key:
            problems.append(f'{key}: {path} is the record of another run')
        elif [c['accuracy'] for c in record['clients']] != pytest.approx(
            [float(r['accuracy']) for r in rows], rel=1e-5
        ):
            problems.append(f'{key}: the clients of {path} are not those of results.csv')
        elif record.get(bench_aggregate.CONVERTED_FROM) is not None:
            unknown = record[bench_aggregate.UNKNOWN]
            if record[bench_aggregate.CONVERTED_FROM] != 'results.csv' or any(
                record[field] is not None for field in unknown if '.' not in field
            ):
                problems.append(f'{key}: converted record {path} does not say what it lacks')
    return problems


def _summary_mismatches(results_dir):
    """Where aggregating the records (what --report_only --results_dir does) differs from the committed summary.csv."""
    suite = bench_parse.load_suite(os.path.join(results_dir, 'suite.toml'))
    rows = {
        (r['partition'], r['algorithm']): r
        for r in bench_aggregate.aggregate(suite, bench_aggregate.load_records(suite, results_dir))
    }
    mismatches = []
    for committed in _read_csv(os.path.join(results_dir, 'summary.csv')):
        key = (committed['partition'], committed['algorithm'])
        row = rows.pop(key, None)
        if row is None or row['runs'] != committed['runs']:
            mismatches.append(f'{key}: runs {committed["runs"]} in summary.csv, {row and row["runs"]} in the records')
            continue
        for column in SCORED_COLUMNS:
            if column not in committed:  # a summary.csv written before the column existed
                continue
            ours, theirs = row[column], committed[column]
            if (ours is None) != (theirs == '') or (ours is not None and abs(ours - float(theirs)) > 1e-3):
                mismatches.append(f'{key} {column}: {theirs!r} in summary.csv, {ours} from the records')
    mismatches += [f'{key}: records but no summary.csv row' for key in rows]
    return mismatches


def test_every_committed_results_folder_is_read_by_the_scoreboard():
    assert _committed_results_dirs(REPO), 'no committed results found'
    assert scoreboard.misplaced_results(REPO) == []
    scored = {e['suite'] for e in scoreboard.entries(REPO) if e['status'] != 'not run yet'}
    listed = {o['suite']: o for o in scoreboard.unscored(REPO)}
    read = []
    for path in scoreboard.suite_paths(REPO):
        suite = bench_parse.load_suite(path)
        directory = scoreboard.results_dir(REPO, suite)
        if not os.path.isdir(directory):
            continue
        read.append(directory)
        complete = sum(int(row['runs'].split('/')[0]) for row in _read_csv(os.path.join(directory, 'summary.csv')))
        if suite.paper:
            assert suite.name in scored, f'{suite.name}: its results in {directory} are not on the scoreboard'
        else:
            assert listed[suite.name]['runs'] == f'{complete}/{len(suite.runs())}', suite.name
            assert listed[suite.name]['report'] == os.path.relpath(os.path.join(directory, 'report.md'), REPO)
    assert sorted(read) == _committed_results_dirs(REPO)


def test_baselines_mnist_counts_its_committed_runs():
    (baselines,) = [o for o in scoreboard.unscored(REPO) if o['suite'] == 'baselines_mnist']
    assert baselines['runs'] == '20/20'
    assert baselines['report'] == os.path.join('benchmarks', 'results', 'baselines_mnist_suite', 'report.md')


def test_a_misnamed_results_folder_is_refused(tmp_path, monkeypatch, capsys):
    root = _tree(tmp_path)
    assert scoreboard.misplaced_results(str(root)) == []
    results = root / 'benchmarks' / 'results'
    (results / 'fake_suite').rename(results / 'fake')
    (results / 'gone_suite').mkdir()
    (results / 'gone_suite' / 'suite.toml').write_text(UNRUN.replace('"unrun"', '"gone"'))
    assert scoreboard.misplaced_results(str(root)) == [
        os.path.join('benchmarks', 'results', 'fake')
        + ' holds results of '
        + os.path.join('benchmarks', 'suites', 'fake.toml')
        + ', read from '
        + os.path.join('benchmarks', 'results', 'fake_suite')
        + ': rename the folder',
        os.path.join('benchmarks', 'results', 'gone_suite')
        + " holds results of suite 'gone', which has no file in "
        + os.path.join('benchmarks', 'suites'),
    ]
    monkeypatch.chdir(root)
    assert scoreboard.main([]) == 2
    assert 'results the scoreboard would not read: benchmarks/results/fake holds' in capsys.readouterr().err


@pytest.mark.parametrize('results_dir', _committed_results_dirs(REPO), ids=os.path.basename)
def test_every_committed_run_has_a_record_that_gives_the_committed_summary(results_dir):
    assert _record_problems(results_dir) == []
    assert _summary_mismatches(results_dir) == []


def _converter():
    path = os.path.join(REPO, 'benchmarks', 'convert_results.py')
    spec = importlib.util.spec_from_file_location('convert_results', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONVERT_SUMMARY = """\
partition,algorithm,model,seeds,runs,accuracy_mean,rounds_to_target,rounds_to_target_reached,\
bytes_down_per_client_per_round,bytes_up_per_client_per_round,bytes_down_per_client,bytes_up_per_client,minutes_per_run
natural,FedAvg,global_model,0 1 2,3/3,60,,0/3,100,200,200,400,1.5
IID,FedAvg,global_model,0,1/3,70,2,1/1,100,200,200,400,0.5
"""


def test_converting_results_csv_into_records(tmp_path):
    """benchmarks/convert_results.py: records from results.csv, what summary.csv gives per run, the rest unknown."""
    convert = _converter()
    results = tmp_path / 'fake_suite'
    results.mkdir()
    (results / 'suite.toml').write_text(SUITE)
    (results / 'summary.csv').write_text(CONVERT_SUMMARY)
    accuracies = {
        (p, s): [0.1 * (i + s + 1) + (0.2 if p == 'IID' else 0) for i in range(3)]
        for p in ('natural', 'IID')
        for s in (0, 1, 2)
    }
    examples = [10, 20, 70]
    lines = ['partition,algorithm,seed,client,client_id,model,accuracy,examples']
    for p, seeds in (('natural', (0, 1, 2)), ('IID', (0,))):
        for s in seeds:
            lines += [
                f'{p},FedAvg,{s},{i},c{i},global_model,{a:.6g},{examples[i]}' for i, a in enumerate(accuracies[p, s])
            ]
    (results / 'results.csv').write_text('\n'.join(lines) + '\n')
    assert convert.convert(str(results)) == (4, 0)
    suite = bench_parse.parse_suite(SUITE, 'fake.toml')
    records = {(r['partition'], r['seed']): r for r in bench_aggregate.load_records(suite, str(results))}
    assert sorted(records) == [('IID', 0), ('natural', 0), ('natural', 1), ('natural', 2)]
    single, multi = records['IID', 0], records['natural', 1]
    for r in (single, multi):
        assert r['converted_from'] == 'results.csv' and r['curve'] is None and r['partition_csv'] is None
        assert {'curve', 'partition_csv', 'config', 'summary.weighted_mean'} <= set(r['unknown'])
        assert [c['examples'] for c in r['clients']] == examples and r['rounds'] == 2
    assert single['summary']['global_model']['mean'] == pytest.approx(np.mean(accuracies['IID', 0]))
    # A cell of one run: summary.csv's row is that run's.
    assert (single['seconds'], single['rounds_to_target']) == (30.0, 2)
    assert single['communication'] == {
        'bytes_down_per_client_per_round': 100,
        'bytes_up_per_client_per_round': 200,
        'bytes_down_per_client': 200,
        'bytes_up_per_client': 400,
    }
    assert not {'seconds', 'rounds_to_target', 'communication'} & set(single['unknown'])
    # A cell of three: no seed's time or bytes; none reached the target (0/3), so that is known.
    assert (multi['seconds'], multi['communication'], multi['rounds_to_target']) == (None, None, None)
    assert {'seconds', 'communication'} <= set(multi['unknown']) and 'rounds_to_target' not in multi['unknown']
    rows = {r['partition']: r for r in bench_aggregate.aggregate(suite, list(records.values()))}
    means = [100 * np.mean(accuracies['natural', s]) for s in (0, 1, 2)]
    assert rows['natural']['accuracy_mean'] == pytest.approx(np.mean(means))
    assert rows['natural']['weighted_mean'] == pytest.approx(
        np.mean([100 * np.average(accuracies['natural', s], weights=examples) for s in (0, 1, 2)])
    )
    assert rows['natural']['top_10_by_samples'] == pytest.approx(
        np.mean([100 * accuracies['natural', s][2] for s in (0, 1, 2)])
    )
    assert (rows['natural']['minutes_per_run'], rows['natural']['rounds_to_target_reached']) == (None, '0/3')
    assert (rows['IID']['minutes_per_run'], rows['IID']['rounds_to_target_reached']) == (0.5, '1/1')
    text = bench_report.render_report(suite, str(tmp_path), list(records.values()), list(rows.values()), [], [])
    assert '4 of the 4 records were converted from committed files (results.csv;' in text
    # A record the harness wrote is left alone; converted ones are rewritten identically.
    harness = bench_layout.record_path(str(results), records['natural', 2]['run'])
    record = {k: v for k, v in records['natural', 2].items() if k not in ('run', 'converted_from', 'unknown')}
    with open(harness, 'w') as f:
        json.dump(record, f)
    before = {p: open(p).read() for p in glob.glob(str(results / 'records' / '*' / '*' / '*.json'))}
    assert convert.convert(str(results)) == (3, 1)
    assert {p: open(p).read() for p in before} == before
    # results.csv naming a run the suite does not have is refused.
    with open(results / 'results.csv', 'a') as f:
        f.write('natural,Nope,0,0,c0,global_model,0.5,10\n')
    with pytest.raises(convert.ConversionError, match="run .*'Nope'.* is not a run of"):
        convert.records(str(results))


def test_a_leaderboard_suite_is_scored_by_its_best_round_on_test(tmp_path):
    """`measure = "best round on test"`: ours is summary.csv's best-round column, not the last round's mean."""
    source = 'source = "A leaderboard"\nmeasure = "best round on test"'
    board = SUITE.replace('source = "Some paper, Table 2, digits"', source)
    best = SUMMARY.replace(',rounds\n', ',rounds,best_test_accuracy_mean_optimistic\n', 1)
    best = best.replace(
        'natural,FedAvg,global_model,0 1 2,3/3,81.5,0.5,4.0,70,1,82,1,90,2,2\n',
        'natural,FedAvg,global_model,0 1 2,3/3,81.5,0.5,4.0,70,1,82,1,90,2,2,83.5\n',
    )
    root = _tree(tmp_path, summary=best, stored_suite=board)
    (root / 'benchmarks' / 'suites' / 'fake.toml').write_text(board)
    by_key = _by_key(scoreboard.entries(str(root)))
    e = by_key[('fake', 'natural', 'FedAvg', 'best round')]
    assert (e['paper'], e['ours'], e['ours_std'], e['diff']) == (80.0, 83.5, None, pytest.approx(3.5))
    # The other metrics of a cell keep their own columns (last round).
    assert by_key[('fake', 'natural', 'FT', 'worst10')]['ours'] == 58.5
    text = scoreboard.render(list(by_key.values()))
    assert '| digits / natural | FedAvg | mean, best round on test | 80.0 | 83.50 | 3/3 | +3.50 | no |' in text
    assert '| FT | mean, best round on test | 70.25 | not available (a run without a validation curve) |' in text
