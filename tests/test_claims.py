"""The claims table (docs/reports/claims.md): the papers' orderings, paired by seed on the committed records."""

import json
import os

import pytest

from tff_pfl_bench import bench_parse, bench_suite, claims

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = """
name = "fake"
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
[[algorithms]]
name = "Local"
algorithm = "local"
model = "personalized_model"
[paper]
"FT" = { natural = 80.0 }
[paper_errors]
"FT" = { natural = "Table 9's FT column repeats its FedAvg column" }
"""

# The same comparison under another setting: one partition, its own label.
OTHER = """
name = "other"
[defaults]
dataset = "npz:data/digits.npz"
num_clients = 3
rounds = 4
seeds = [0, 1, 2]
[[partitions]]
name = "natural4"
partition = "natural"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
[[algorithms]]
name = "FT, more rounds"
algorithm = "fedavg_ft"
model = "personalized_model"
"""

CLAIMS = """
[[claims]]
id = "ft-over-fedavg"
paper = "Some paper (2020)"
source = "Table 9, digits"
claim = "FT beats FedAvg"
suite = "fake"
better = "FT"
worse = "FedAvg"
paper_margin = { natural = 2.5, IID = "not stated" }
note = "A note."

[[claims.settings]]
name = "more rounds"
changes = "rounds = 4"
suite = "other"
better = "FT, more rounds"
partitions = { natural = "natural4" }

[[claims]]
id = "ft-over-local"
paper = "Some paper (2020)"
source = "Table 9, digits"
claim = "FT beats Local"
suite = "fake"
better = "FT"
worse = "Local"
paper_margin = { natural = 1.25 }

[[claims]]
id = "local-over-fedavg"
paper = "Another paper (2021)"
source = "Fig. 2"
claim = "Local beats FedAvg"
suite = "fake"
better = "Local"
worse = "FedAvg"
paper_margin = { IID = 7 }
"""

COMMANDS = """\
tff-pfl-bench --suite=benchmarks/suites/fake.toml --output_dir=runs/bench/fake --partitions=natural
tff-pfl-bench --suite=benchmarks/suites/fake.toml --output_dir=runs/bench/fake --partitions=IID --algorithms=Local
tff-pfl-bench --suite=benchmarks/suites/fake.toml --output_dir=runs/bench/fake --partitions=IID --algorithms=FT,FedAvg
"""

PARTITION_CSV = 'client_id,train_examples,val_examples,test_examples\nc0,6,2,2\nc1,6,2,2\nc2,6,2,2\n'


def _record(accuracies, model='personalized_model', partition_csv=PARTITION_CSV, **extra):
    """A bench_result.json record holding what the claims read: the model's summary, the clients, the partition."""
    clients = [{'client_id': f'c{i}', 'accuracy': a} for i, a in enumerate(accuracies)]
    return dict(
        model=model,
        summary={model: {'mean': sum(accuracies) / len(accuracies)}},
        clients=clients,
        partition_csv=partition_csv,
        **extra,
    )


# Per-client accuracies by (suite, partition slug, algorithm slug) and seed.
RUNS = {
    ('fake', 'natural', 'fedavg'): {s: [0.80, 0.70, 0.60] for s in (0, 1, 2)},
    # FT beats FedAvg on natural in every seed: +2, +1, +3 points.
    ('fake', 'natural', 'ft'): {0: [0.83, 0.72, 0.61], 1: [0.81, 0.71, 0.61], 2: [0.85, 0.72, 0.62]},
    # Local ties FT in seed 0 (the same clients), is below in seed 1 and above in seed 2.
    ('fake', 'natural', 'local'): {0: [0.83, 0.72, 0.61], 1: [0.82, 0.72, 0.61], 2: [0.80, 0.70, 0.60]},
    # On IID, FT loses to FedAvg in seed 1; Local has one seed, and beats FedAvg there.
    ('fake', 'iid', 'fedavg'): {s: [0.90, 0.90, 0.90] for s in (0, 1, 2)},
    ('fake', 'iid', 'ft'): {0: [0.91, 0.90, 0.90], 1: [0.89, 0.90, 0.90], 2: [0.92, 0.90, 0.90]},
    ('fake', 'iid', 'local'): {0: [0.95, 0.95, 0.95]},
}


def _write_records(results, runs):
    for (_, partition, algorithm), seeds in runs.items():
        for seed, accuracies in seeds.items():
            path = results / 'records' / partition / algorithm / f'seed{seed}.json'
            path.parent.mkdir(parents=True, exist_ok=True)
            model = 'global_model' if algorithm == 'fedavg' else 'personalized_model'
            path.write_text(json.dumps(_record(accuracies, model=model)))


def _tree(root, claims_text=CLAIMS, runs=RUNS, other_runs=None, stored_suite=SUITE):
    """A repository root with suites `fake` (committed records) and `other` (none unless `other_runs`)."""
    suites = root / 'benchmarks' / 'suites'
    suites.mkdir(parents=True)
    (suites / 'fake.toml').write_text(SUITE)
    (suites / 'other.toml').write_text(OTHER)
    (root / 'benchmarks' / 'claims.toml').write_text(claims_text)
    results = root / 'benchmarks' / 'results' / 'fake_suite'
    results.mkdir(parents=True)
    (results / 'commands.txt').write_text(COMMANDS)
    (results / 'suite.toml').write_text(stored_suite)
    (results / 'report.md').write_text('# fake\n')
    _write_records(results, runs)
    if other_runs is not None:
        other = root / 'benchmarks' / 'results' / 'other_suite'
        other.mkdir(parents=True)
        (other / 'suite.toml').write_text(OTHER)
        (other / 'commands.txt').write_text('tff-pfl-bench --suite=benchmarks/suites/other.toml\n')
        _write_records(other, other_runs)
    return root


def _part(partition, diffs, status=None):
    """A pair() result for verdict tests: seed -> difference (None: the record lacks the measure)."""
    known = [d for d in diffs.values() if d is not None]
    return dict(
        partition=partition,
        seeds=sorted(diffs),
        diffs=diffs,
        mean=sum(known) / len(known) if known else None,
        status=status or ('ok' if known else 'not run yet' if not diffs else 'not available'),
        clients=None,
    )


# ----------------------------------------------------------------------------
# Pairing and signs.


def test_pair_gives_each_seeds_difference_its_sign_and_the_clients():
    better = {s: _record(a) for s, a in RUNS[('fake', 'natural', 'ft')].items()}
    worse = {s: _record(a) for s, a in RUNS[('fake', 'natural', 'fedavg')].items()}
    worse[3] = _record([0.5, 0.5, 0.5])  # a seed of one side only is not paired
    part = claims.pair(better, worse, 'last', 'fake, natural')
    assert part['seeds'] == [0, 1, 2] and part['status'] == 'ok'
    assert [round(part['diffs'][s], 6) for s in (0, 1, 2)] == [2.0, 1.0, 3.0]
    assert part['mean'] == pytest.approx(2.0)
    assert claims.seeds_text(part) == '+2.00 / +1.00 / +3.00'
    # Client by client: higher on all 9 client-seeds.
    assert part['clients'] == (9, 0, 0)
    # Equal accuracies are a tie, shown without a sign; a loss has its minus.
    tie = claims.pair({0: _record([0.8, 0.7])}, {0: _record([0.8, 0.7])}, 'last', 'x')
    assert tie['diffs'] == {0: 0.0} and claims.seeds_text(tie) == '0.00' and tie['clients'] == (0, 0, 2)
    loss = claims.pair({0: _record([0.8, 0.7])}, {0: _record([0.9, 0.7])}, 'last', 'x')
    assert claims.seeds_text(loss) == '-5.00' and loss['clients'] == (0, 1, 1)
    # The record's own model is read: a global-model record against a personalized one.
    mixed = claims.pair({0: _record([0.9], model='global_model')}, {0: _record([0.8])}, 'last', 'x')
    assert mixed['diffs'][0] == pytest.approx(10.0)
    empty = claims.pair({}, worse, 'last', 'x')
    assert (empty['status'], empty['seeds'], empty['mean'], empty['clients']) == ('not run yet', [], None, None)


def test_pair_refuses_runs_on_other_partitions_or_clients():
    other = PARTITION_CSV.replace('c2,6,2,2', 'c2,7,1,2')
    with pytest.raises(claims.ClaimsError) as raised:
        claims.pair({0: _record([0.8] * 3)}, {0: _record([0.7] * 3, partition_csv=other)}, 'last', 'fake, natural')
    assert str(raised.value) == 'fake, natural, seed 0: the two runs trained on different partitions (partition_csv)'
    # A record without its partition (converted from results.csv) is paired on its clients.
    claims.pair({0: _record([0.8] * 3)}, {0: _record([0.7] * 3, partition_csv=None)}, 'last', 'x')
    with pytest.raises(claims.ClaimsError, match='x, seed 0: the two runs do not hold the same clients'):
        claims.pair({0: _record([0.8] * 3)}, {0: _record([0.7] * 2)}, 'last', 'x')


def test_the_validation_selected_measure_reads_selected_test_accuracy():
    better = {0: _record([0.9], selected={'test_accuracy': 0.86}), 1: _record([0.9])}
    worse = {0: _record([0.8], selected={'test_accuracy': 0.85}), 1: _record([0.8], selected={'test_accuracy': 0.8})}
    part = claims.pair(better, worse, 'val_selected', 'x')
    assert part['diffs'][0] == pytest.approx(1.0) and part['diffs'][1] is None
    assert part['status'] == 'ok' and part['mean'] == pytest.approx(1.0) and part['clients'] is None
    assert claims.seeds_text(part) == '+1.00 / n/a'
    older = claims.pair({1: better[1]}, {1: worse[1]}, 'val_selected', 'x')
    assert (older['status'], older['mean']) == ('not available', None)


# ----------------------------------------------------------------------------
# Verdicts.

POSITIVE = [_part('a', {0: 0.4, 1: 0.1, 2: 0.2}), _part('b', {0: 1.0, 1: 2.0, 2: 3.0})]
NEGATIVE = [_part('a', {0: 0.4, 1: -0.1, 2: 0.2}), _part('b', {0: 1.0, 1: 2.0, 2: 3.0})]


@pytest.mark.parametrize(
    'claim, settings, expected',
    [
        (POSITIVE, [], 'reproduced'),
        (POSITIVE, [('S', NEGATIVE)], 'reproduced'),
        ([_part('a', {0: 0.4, 1: 0.1})], [], 'reproduced (2 seeds)'),
        (NEGATIVE, [], 'not reproduced; no other setting tested'),
        # A tie is no win.
        ([_part('a', {0: 0.4, 1: 0.0, 2: 0.2})], [], 'not reproduced; no other setting tested'),
        (NEGATIVE, [('S', [_part('a', {0: 0.5})])], 'reproduced under setting "S" (1 seed)'),
        (
            NEGATIVE,
            [('S', POSITIVE), ('T', NEGATIVE), ('U', POSITIVE[:1])],
            'reproduced under settings "S", "U"',
        ),
        (
            NEGATIVE,
            [('T', NEGATIVE), ('U', [_part('a', {0: 0.5}), _part('b', {})])],
            'not reproduced; settings tested: "T" (a +0.17, b +2.00); "U" (a +0.50 in 1 seed, b not run yet)',
        ),
        (
            NEGATIVE,
            [('T', NEGATIVE), ('V', [_part('a', {}), _part('b', {})])],
            'not reproduced; settings tested: "T" (a +0.17, b +2.00); not run yet: "V"',
        ),
        (NEGATIVE, [('V', [_part('a', {})])], 'not reproduced; no other setting tested; not run yet: "V"'),
        ([_part('a', {}), _part('b', {})], [], 'not run yet'),
        ([_part('a', {0: 0.4, 1: 0.1, 2: 0.2}), _part('b', {})], [], 'not run yet on b'),
        (
            [_part('a', {0: None}), _part('b', {}), _part('c', {0: 1.0})],
            [('T', NEGATIVE)],
            'not available on a; not run yet on b; settings tested: "T" (a +0.17, b +2.00)',
        ),
        ([_part('a', {0: None}), _part('b', {0: None})], [], 'not available'),
    ],
)
def test_verdict(claim, settings, expected):
    assert claims.verdict(claim, settings) == expected


# ----------------------------------------------------------------------------
# The claims file.


def _suite_of(name):
    texts = {'fake': SUITE, 'other': OTHER}
    return (
        (bench_parse.parse_suite(texts[name], f'{name}.toml'), f'benchmarks/suites/{name}.toml')
        if (name in texts)
        else None
    )


def test_a_claims_file_is_parsed_with_its_settings():
    first, second, third = claims.parse_claims(CLAIMS, 'c.toml', _suite_of)
    assert (first.id, first.paper, first.claim, first.measure, first.note) == (
        'ft-over-fedavg',
        'Some paper (2020)',
        'FT beats FedAvg',
        'last',
        'A note.',
    )
    assert first.paper_margin == {'natural': 2.5, 'IID': 'not stated'}
    assert (first.comparison.better, first.comparison.worse, dict(first.comparison.partitions)) == (
        'FT',
        'FedAvg',
        {'natural': 'natural', 'IID': 'IID'},
    )
    (setting,) = first.settings
    # A setting takes the claim's labels unless it names its own.
    assert (setting.setting, setting.changes, setting.suite.name, setting.better, setting.worse) == (
        'more rounds',
        'rounds = 4',
        'other',
        'FT, more rounds',
        'FedAvg',
    )
    assert dict(setting.partitions) == {'natural': 'natural4'}
    assert second.settings == () and third.paper_margin == {'IID': 7.0}


@pytest.mark.parametrize(
    'edit, message',
    [
        (('id = "ft-over-local"', 'id = "ft-over-fedavg"'), "claims[1].id: 'ft-over-fedavg' is the id of an earlier"),
        (('id = "ft-over-local"', 'id = "FT over local"'), 'claims[1].id: required, lower-case letters, digits and -'),
        (
            ('note = "A note."', 'note = "A note."\nmargin = 3'),
            'claims "ft-over-fedavg".margin: unknown key; known: id,',
        ),
        (('claim = "FT beats Local"', 'claim = " "'), 'claims "ft-over-local".claim: required, a non-empty string'),
        (
            ('suite = "fake"\nbetter = "FT"\nworse = "Local"', 'suite = "fakes"\nbetter = "FT"\nworse = "Local"'),
            'claims "ft-over-local".suite: no suite file in benchmarks/suites is named \'fakes\'',
        ),
        (
            ('worse = "Local"', 'worse = "Ditto"'),
            'claims "ft-over-local".worse: \'Ditto\' is no algorithm label of fake; it has FedAvg, FT, Local',
        ),
        (('worse = "Local"', 'worse = "FT"'), 'claims "ft-over-local".worse: \'FT\' is also better'),
        (
            ('paper_margin = { natural = 1.25 }', 'paper_margin = { ds9 = 1.25 }'),
            'claims "ft-over-local".paper_margin.ds9: unknown partition label; fake has natural, IID',
        ),
        (
            ('paper_margin = { natural = 1.25 }', 'paper_margin = { natural = -0.3 }'),
            'claims "ft-over-local".paper_margin.natural: -0.3: a claim is that better beats worse',
        ),
        (
            ('paper_margin = { natural = 1.25 }', 'paper_margin = { natural = true }'),
            'claims "ft-over-local".paper_margin.natural: must be points (a number) or a string',
        ),
        (
            ('paper_margin = { natural = 1.25 }', 'paper_margin = { natural = "" }'),
            'claims "ft-over-local".paper_margin.natural: an empty string',
        ),
        (('paper_margin = { natural = 1.25 }', 'paper_margin = {}'), 'claims "ft-over-local".paper_margin: required'),
        (
            ('paper_margin = { natural = 1.25 }', 'paper_margin = { natural = 1.25 }\nmeasure = "best"'),
            'claims "ft-over-local".measure: must be one of last, val_selected, got \'best\'',
        ),
        (
            ('partitions = { natural = "natural4" }', 'partitions = { natural = "ds9" }'),
            'claims "ft-over-fedavg".settings "more rounds".partitions.natural: \'ds9\' is no partition label of other',
        ),
        (
            ('partitions = { natural = "natural4" }', 'partitions = { natural4 = "natural4" }'),
            '.partitions.natural4: not a partition of the claim (its paper_margin has natural, IID)',
        ),
        (
            ('partitions = { natural = "natural4" }\n', ''),
            "settings \"more rounds\".partitions: other has no partition 'natural' (it has natural4); map the claim's",
        ),
        (
            ('better = "FT, more rounds"', 'better = "FT, fewer rounds"'),
            'settings "more rounds".better: \'FT, fewer rounds\' is no algorithm label of other',
        ),
        (
            ('suite = "other"\nbetter = "FT, more rounds"\npartitions = { natural = "natural4" }', ''),
            'claims "ft-over-fedavg".settings "more rounds": the claim\'s own comparison (same suite, algorithms',
        ),
        (('name = "more rounds"', 'name = ""'), 'claims "ft-over-fedavg".settings[0].name: required'),
        (
            ('changes = "rounds = 4"', 'changes = "rounds = 4"\nseeds = [0]'),
            'settings "more rounds".seeds: unknown key',
        ),
        (
            ('[[claims]]\nid = "ft-over-fedavg"', 'title = "x"\n[[claims]]\nid = "ft-over-fedavg"'),
            'c.toml: title: unknown key; known: claims',
        ),
        (('paper = "Another paper (2021)"', 'paper = "Another paper (2021)'), 'bad TOML: '),
    ],
)
def test_claims_file_errors_are_one_line_naming_file_and_key(edit, message):
    old, new = edit
    assert old in CLAIMS
    with pytest.raises(claims.ClaimsError) as raised:
        claims.parse_claims(CLAIMS.replace(old, new, 1), 'c.toml', _suite_of, ['fake', 'other'])
    text = str(raised.value)
    assert text.startswith('c.toml: ') and message in text and '\n' not in text
    with pytest.raises(claims.ClaimsError, match=r'c.toml: claims: required, one or more \[\[claims\]\] tables'):
        claims.parse_claims('', 'c.toml', _suite_of)


# ----------------------------------------------------------------------------
# The page, from a tree of committed records.


def test_the_page_from_a_fake_tree(tmp_path):
    root = _tree(tmp_path)
    items = claims.evaluate(str(root), claims.load_claims(str(root)))
    fedavg, local, third = items
    own, setting = fedavg['comparisons']
    natural, iid = own['parts']
    assert [round(natural['diffs'][s], 6) for s in (0, 1, 2)] == [2.0, 1.0, 3.0]
    assert [round(iid['diffs'][s], 6) for s in (0, 1, 2)] == [round(1 / 3, 6), round(-1 / 3, 6), round(2 / 3, 6)]
    # The claim fails on IID in seed 1; its setting has no committed results.
    assert fedavg['verdict'] == 'not reproduced; no other setting tested; not run yet: "more rounds"'
    assert fedavg['paper_errors'] == {'natural': ["FT: Table 9's FT column repeats its FedAvg column"]}
    # natural: the first line; IID: the line that selects FT or FedAvg there, not the one of Local only.
    assert own['commands'] == [COMMANDS.splitlines()[0], COMMANDS.splitlines()[2]]
    assert setting['commands'] == [] and setting['run'] == (
        'tff-pfl-bench --suite=benchmarks/suites/other.toml --output_dir=runs/bench/other '
        '--results_dir=benchmarks/results/other_suite'
    )
    assert own['report'] == os.path.join('benchmarks', 'results', 'fake_suite', 'report.md') and not own['stale']
    assert local['verdict'] == 'not reproduced; no other setting tested'
    # Seed 0 ties client for client, seed 1 loses on two clients, seed 2 wins on all three.
    assert local['comparisons'][0]['parts'][0]['clients'] == (3, 2, 4)
    assert claims.seeds_text(local['comparisons'][0]['parts'][0]) == '0.00 / -0.67 / +3.00'
    assert third['verdict'] == 'reproduced (1 seed)'
    assert third['comparisons'][0]['commands'] == [COMMANDS.splitlines()[1], COMMANDS.splitlines()[2]]

    text = claims.render(items)
    assert '3 claims from 2 papers: 1 reproduced, 0 reproduced under a setting, 2 not reproduced, 0 not run yet.' in (
        text
    )
    summary = next(
        line for line in text.splitlines() if line.startswith('| Some paper (2020), Table 9, digits | FT beats FedAvg')
    )
    cells = [c.strip() for c in summary.split('|')[1:-1]]
    assert cells[2] == (
        "natural +2.5 (paper error: FT: Table 9's FT column repeats its FedAvg column)<br>IID not stated"
    )
    assert cells[3] == 'natural +2.00 (+2.00 / +1.00 / +3.00)<br>IID +0.22 (+0.33 / -0.33 / +0.67)'
    assert text.index('## Some paper (2020)') < text.index('### FT beats Local') < text.index('## Another paper (2021)')
    assert '**Verdict: reproduced (1 seed).**' in text
    assert (
        '| the claim, as the suite runs it |  | [fake](../../benchmarks/results/fake_suite/report.md) | natural |'
        in text
    )
    assert (
        '| more rounds | rounds = 4; "FT, more rounds" against "FedAvg" | other (`benchmarks/suites/other.toml`) '
        '| natural (as natural4) | +2.5' in text
    )
    assert f'- more rounds: to run: `{setting["run"]}`' in text

    # The setting's runs committed: the claim is reproduced under it. Results of other runs are marked.
    other_runs = {
        ('other', 'natural4', 'fedavg'): {s: [0.5, 0.5, 0.5] for s in (0, 1, 2)},
        ('other', 'natural4', 'ft-more-rounds'): {s: [0.6, 0.5, 0.5] for s in (0, 1, 2)},
    }
    root = _tree(tmp_path / 'more', other_runs=other_runs, stored_suite=SUITE.replace('rounds = 2', 'rounds = 3'))
    items = claims.evaluate(str(root), claims.load_claims(str(root)))
    assert items[0]['verdict'] == 'reproduced under setting "more rounds"'
    assert items[0]['comparisons'][0]['stale'] and not items[0]['comparisons'][1]['stale']
    text = claims.render(items)
    assert '(results of an older suite.toml)' in text and '1 reproduced under a setting' in text


def test_records_on_different_partitions_are_refused(tmp_path):
    root = _tree(tmp_path)
    path = root / 'benchmarks' / 'results' / 'fake_suite' / 'records' / 'iid' / 'ft' / 'seed1.json'
    path.write_text(json.dumps(_record([0.9] * 3, partition_csv=PARTITION_CSV.replace('c2,6', 'c2,5'))))
    with pytest.raises(bench_suite.SuiteError, match='trained on different partitions'):
        claims.evaluate(str(root), claims.load_claims(str(root)))


def test_main_writes_checks_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_tree(tmp_path))
    assert claims.main([]) == 0
    assert capsys.readouterr().out == 'wrote docs/reports/claims.md\n'
    with open(claims.OUTPUT) as f:
        assert f.read() == claims.generate('.')
    assert claims.main(['--check']) == 0
    with open(claims.OUTPUT, 'a') as f:
        f.write('edited by hand\n')
    assert claims.main(['--check']) == 1
    assert 'out of date; rerun: uv run --locked python -m tff_pfl_bench.claims' in capsys.readouterr().err
    assert claims.main(['--force']) == 2
    assert capsys.readouterr().err == 'claims: error: unexpected arguments: --force (only --check)\n'
    (tmp_path / 'benchmarks' / 'claims.toml').write_text(CLAIMS.replace('worse = "Local"', 'worse = "Ditto"'))
    assert claims.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith('claims: error: benchmarks/claims.toml: claims "ft-over-local".worse: ')
    assert err.count('\n') == 1
    (tmp_path / 'benchmarks' / 'claims.toml').unlink()
    assert claims.main([]) == 2
    assert capsys.readouterr().err == 'claims: error: benchmarks/claims.toml: not found\n'
    monkeypatch.chdir(tmp_path / 'benchmarks')
    assert claims.main([]) == 2
    assert 'run from the repository root' in capsys.readouterr().err


# ----------------------------------------------------------------------------
# The committed page.


def test_the_committed_claims_page_is_current():
    with open(os.path.join(REPO, claims.OUTPUT), encoding='utf-8') as f:
        committed = f.read()
    assert committed == claims.generate(REPO), f'docs/reports/claims.md is out of date; rerun: {claims.GENERATE}'


def test_every_committed_claim_is_run_and_names_its_commands():
    """Each claim is run; a setting may be declared before its runs exist (its verdict says "not run yet")."""
    for item in claims.evaluate(REPO, claims.load_claims(REPO)):
        for entry in item['comparisons']:
            name = f'{item["claim"].id} / {entry["comparison"].setting or "the claim"}'
            if entry['comparison'].setting is None:
                assert all(part['status'] == 'ok' for part in entry['parts']), f'{name}: not run'
            elif not any(part['status'] == 'ok' for part in entry['parts']):
                continue
            assert entry['commands'], f'{name}: no recorded command in commands.txt'
            assert not entry['stale'], f'{name}: results of an older suite.toml'


def test_a_setting_may_take_its_worse_algorithm_from_another_suite_on_the_same_data(tmp_path):
    """`worse_suite`: the setting changes only `better`; `worse` is the other suite's run, on the same partition."""
    more = (
        SUITE.split('[[algorithms]]')[0].replace('name = "fake"', 'name = "more"')
        + '[[algorithms]]\nname = "FT, changed"\nalgorithm = "fedavg_ft"\nmodel = "personalized_model"\n'
    )
    setting = """
[[claims.settings]]
name = "FT changed"
suite = "more"
better = "FT, changed"
worse_suite = "fake"
"""
    text = CLAIMS.replace('paper_margin = { natural = 1.25 }', 'paper_margin = { natural = 1.25 }' + setting)
    root = _tree(tmp_path, claims_text=text)
    (root / 'benchmarks' / 'suites' / 'more.toml').write_text(more)
    results = root / 'benchmarks' / 'results' / 'more_suite'
    results.mkdir(parents=True)
    (results / 'suite.toml').write_text(more)
    _write_records(results, {('more', 'natural', 'ft-changed'): {s: [0.85, 0.75, 0.65] for s in (0, 1, 2)}})
    ft_local = claims.evaluate(str(root), claims.load_claims(str(root)))[1]
    changed = ft_local['comparisons'][1]
    assert changed['comparison'].suite_of('Local').name == 'fake'
    # Against fake's Local (seed 0: 0.72, seed 1: 0.7167, seed 2: 0.70 on average) on natural.
    (natural,) = changed['parts']
    assert [round(natural['diffs'][s], 4) for s in (0, 1, 2)] == [3.0, 3.3333, 5.0]
    assert ft_local['verdict'] == 'reproduced under setting "FT changed"'
    with pytest.raises(claims.ClaimsError, match="'Nobody' is no algorithm label of fake"):
        claims.parse_claims(
            text.replace('worse_suite = "fake"', 'worse_suite = "fake"\nworse = "Nobody"'),
            'c.toml',
            lambda name: (
                _suite_of(name)
                or ((bench_parse.parse_suite(more, 'more.toml'), 'more.toml') if name == 'more' else None)
            ),
        )
