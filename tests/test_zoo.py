"""The zoo table (docs/zoo.md): generated from the declarations and the committed records, and current."""

import dataclasses
import os

from tff_pfl import algorithm
from tff_pfl.program import algorithms
from tff_pfl_bench import zoo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_algorithm_declares_a_family_of_the_table():
    undeclared = {
        n: algorithms.get(n).family for n in algorithms.names() if algorithms.get(n).family not in algorithm.FAMILIES
    }
    assert not undeclared, f'declare family= (a key of tff_pfl.algorithm.FAMILIES) in ALGORITHMS: {undeclared}'


def test_a_row_per_algorithm_with_the_suites_that_ran_it():
    fedavg = algorithms.get('fedavg')
    other = dataclasses.replace(fedavg, name='newalgo', family='hypernetwork', title='New (2026)')
    serverless = dataclasses.replace(fedavg, name='peer', family='decentralized', serverless=True)
    runs = {'fedavg': [('suite_a', 'Paper A, Table 1', 'benchmarks/results/suite_a_suite')]}
    text = zoo.render([fedavg, other, serverless], runs)
    rows = {line.split(' | ')[0].strip('| `'): line for line in text.splitlines() if line.startswith('| `')}
    assert '[suite_a](../benchmarks/results/suite_a_suite/report.md)' in rows['fedavg']
    assert rows['newalgo'].endswith('| the gate only |') and '| hypernetwork |' in rows['newalgo']
    assert 'no server' in rows['peer']
    assert '| suite_a | Paper A, Table 1 |' in text
    assert '| hypernetwork | ' in text and '`newalgo`' in text.split('## Families')[1]


def test_protocols_read_records_not_trials(tmp_path):
    suites = tmp_path / 'benchmarks' / 'suites'
    suites.mkdir(parents=True)
    (suites / 'tiny.toml').write_text(
        'name = "tiny"\ndescription = "A tiny suite: two algorithms"\n[defaults]\ndataset = "synthetic"\nrounds = 1\n'
        'seeds = [0]\n[[partitions]]\nname = "p"\npartition = "iid"\nnum_clients = 2\n'
        '[[algorithms]]\nname = "FedAvg"\nalgorithm = "fedavg"\n[[algorithms]]\nname = "Local"\nalgorithm = "local"\n'
    )
    records = tmp_path / 'benchmarks' / 'results' / 'tiny_suite' / 'records' / 'p'
    (records / 'fedavg').mkdir(parents=True)
    (records / 'fedavg' / 'seed0.json').write_text('{}')
    (records / 'local' / 'trials').mkdir(parents=True)
    (records / 'local' / 'trials' / 'lr-0.1.json').write_text('{}')
    assert zoo.protocols(str(tmp_path)) == {
        'fedavg': [('tiny', 'A tiny suite: two algorithms', os.path.join('benchmarks', 'results', 'tiny_suite'))]
    }


def test_main_refuses_arguments_and_another_directory(tmp_path, monkeypatch, capsys):
    assert zoo.main(['--all']) == 2
    assert 'unexpected arguments: --all' in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert zoo.main([]) == 2
    assert 'run from the repository root' in capsys.readouterr().err


def test_the_committed_zoo_is_current():
    with open(os.path.join(REPO, zoo.OUTPUT), encoding='utf-8') as f:
        committed = f.read()
    assert committed == zoo.generate(REPO), f'docs/zoo.md is out of date; rerun: {zoo.GENERATE}'
