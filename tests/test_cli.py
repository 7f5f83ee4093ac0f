"""tff-pfl-train end to end: outputs of a run, and one-line errors with exit 2."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from tff_pfl.program import experiment, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*flags, cwd=None):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.run(
        [sys.executable, '-m', 'tff_pfl.cli.train', *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=cwd or REPO,
    )


def test_run_writes_the_output_directory(tiny_npz, tmp_path):
    out = tmp_path / 'run'
    result = _train(
        f'--dataset=npz:{tiny_npz}',
        '--partition=ds1',
        '--classes_per_client=2',
        '--num_clients=4',
        '--rounds=3',
        '--eval_every=2',
        '--batch_size=8',
        '--client_learning_rate=0.1',
        f'--output_dir={out}',
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for name in (
        'config.json',
        'metrics.csv',
        'clients.csv',
        'partition.csv',
        'partition.png',
        'accuracy.png',
        'clients.png',
        'report.md',
    ):
        assert (out / name).stat().st_size > 0, name
    assert any(f.startswith('events.out.tfevents') for f in os.listdir(out / 'tensorboard'))
    rounds = list(csv.DictReader(open(out / 'metrics.csv')))
    assert [r['round'] for r in rounds] == ['1', '2', '3']
    assert rounds[0]['test_global_model_accuracy_mean'] == ''  # evaluated at rounds 2 and 3 only
    assert rounds[1]['test_global_model_accuracy_mean'] != ''
    clients = list(csv.DictReader(open(out / 'clients.csv')))
    assert [c['client_id'] for c in clients] == [f'client_{i:05d}' for i in range(4)]
    partition = list(csv.DictReader(open(out / 'partition.csv')))
    assert all(sum(int(p[f'class_{c}']) > 0 for c in range(4)) == 2 for p in partition)  # k = 2
    config = json.load(open(out / 'config.json'))
    assert config['rounds'] == 3 and config['partition'] == 'ds1'
    # The per-client table, the summary and where the report is are printed.
    assert 'client_00003' in result.stdout and 'worst_10' in result.stdout
    assert f'report: {out}/report.md' in result.stdout
    assert 'round 3/3' in result.stdout and 'ETA' in result.stdout


# Through the binary: a flag absl rejects, a value our validation rejects
# (before the re-execution in a network namespace), and a data error (after it).
@pytest.mark.parametrize(
    'flags, message',
    [
        (['--rounds=0'], 'rounds must be >= 1'),
        (['--no_such_flag=1'], 'no_such_flag'),
        (['--dataset=npz:/nonexistent/mnist.npz'], '/nonexistent/mnist.npz'),
    ],
)
def test_bad_input_one_line_exit_2(flags, message, tmp_path):
    out = tmp_path / 'run'
    result = _train(*flags, f'--output_dir={out}')
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('tff-pfl-train: error: '), result.stderr[-2000:]
    assert message in lines[0]
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if 'staging' in p]


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--client_fraction=1.5'], 'client_fraction must be in (0, 1]'),
        (['--rounds=abc'], 'rounds'),
        (['--algorithm=persfl', '--temperatures=1,hot'], 'temperatures must be numbers'),
        (['--algorithm=persfl', '--teacher=best'], 'teacher'),
        (['--teacher=optimal'], '--teacher does not apply to fedavg (it is a setting of persfl, persfl_gd)'),
        (['--kd_mu1=2'], '--kd_mu1 does not apply to fedavg'),
        (['--algorithm=selffl', '--local_epochs=2'], '--local_epochs does not apply to selffl'),
        (['--partition=iid', '--classes_per_client=2'], '--classes_per_client does not apply to partition iid'),
        (['--algorithm=ktpfl', '--model=mnist_dnn'], '--model does not apply to ktpfl'),
        (['--dataset=tfds:mnist', '--partition=ds1', '--classes_per_client=11', '--data_dir=/nonexistent'], 'mnist'),
        (['--algorithm=nope'], 'unknown algorithm'),
        (['extra_argument'], 'unexpected arguments: extra_argument'),
    ],
)
def test_bad_input_one_line_exit_2_in_process(flags, message, tmp_path, train_in_process):
    out = tmp_path / 'run'
    code, stderr = train_in_process(*flags, f'--output_dir={out}')
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('tff-pfl-train: error: '), stderr[-2000:]
    assert message in lines[0]
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if 'staging' in p]


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(algorithm='nope'), 'unknown algorithm'),
        (dict(model='nope'), 'unknown model'),
        (dict(num_clients=0), 'num_clients'),
        (dict(local_epochs=0), 'local_epochs'),
        (dict(batch_size=0), 'batch_size'),
        (dict(client_learning_rate=-1.0), 'client_learning_rate'),
        (dict(server_learning_rate=0.0), 'server_learning_rate'),
        (dict(split_fractions=(0.5, 0.5)), 'split_fractions'),
        (dict(split_fractions=(0.6, 0.3, 0.3)), 'split_fractions'),
        (dict(partition='ds2', dirichlet_alpha=0.0), 'dirichlet_alpha'),
        (dict(partition='ds1', classes_per_client=0), 'classes_per_client'),
        (dict(partition='ds2', classes_per_client=2), 'classes_per_client does not apply to partition ds2'),
        (dict(eval_every=-1), 'eval_every'),
        (dict(algorithm='persfl', distill_epochs=0), 'distill_epochs'),
        (dict(algorithm='persfl', distill_learning_rate=0.0), 'distill_learning_rate'),
        (dict(algorithm='persfl', temperatures=(1.0, 0.0)), 'temperatures'),
        (dict(algorithm='persfl', imitations=(0.5, 1.5)), 'imitations'),
        (dict(algorithm='persfl', teacher='best'), 'teacher'),
        (dict(distill_epochs=5), 'distill_epochs does not apply to fedavg'),
        (dict(local_steps=-1), 'local_steps'),
        (dict(algorithm='selffl', selffl_max_steps=0), 'selffl_max_steps'),
        (dict(algorithm='selffl', warmup_rounds=-2), 'warmup_rounds'),
        (dict(algorithm='selffl', local_steps=3), 'local_steps does not apply to selffl'),
        (dict(rounds=2.5), 'rounds must be an integer'),
        (dict(no_such_setting=1), "unknown setting 'no_such_setting'"),
    ],
)
def test_config_validation(changes, message):
    with pytest.raises(run_config.ConfigError, match=re.escape(message)):
        run_config.make_config(output_dir='x', **changes).validate()


def test_partition_error_writes_nothing(tiny_npz, tmp_path):
    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        dataset=f'npz:{tiny_npz}',
        partition='ds1',
        classes_per_client=5,
        num_clients=4,
    )  # the tiny set has only 4 classes
    with pytest.raises(Exception, match='k'):
        experiment.run_experiment(config)
    assert os.listdir(tmp_path) == []


def test_existing_output_dir_is_refused(tmp_path):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'metrics.csv').write_text('round\n')
    config = run_config.make_config(output_dir=str(tmp_path / 'run'))
    with pytest.raises(run_config.ConfigError, match='not empty'):
        experiment.run_experiment(config)
    assert (tmp_path / 'run' / 'metrics.csv').read_text() == 'round\n'


def test_unwritable_output_dir(tmp_path):
    locked = tmp_path / 'locked'
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root ignores permission bits
        pytest.skip('running as a user that can write anywhere')
    config = run_config.make_config(output_dir=str(locked / 'run'))
    with pytest.raises(run_config.ConfigError, match='not writable'):
        experiment.run_experiment(config)


@pytest.mark.parametrize('algorithm', ['fedavg', 'kdpdfl_local'])
def test_a_run_that_diverges_stops_and_says_where(algorithm, tmp_path):
    """The round loop and the serverless loop: training loss inf from round 1, outputs complete, report says so."""
    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        algorithm=algorithm,
        dataset='synthetic',
        num_clients=4,
        rounds=5,
        eval_every=0,
        client_learning_rate=1e38,
    )
    lines = []
    result = experiment.run_experiment(config, log=lines.append)
    assert result.diverged_round == 1 and len(result.rounds) == 1
    assert any('the run diverged and stops here' in line for line in lines)
    out = tmp_path / 'run'
    with open(out / 'metrics.csv') as f:
        assert [row['round'] for row in csv.DictReader(f)] == ['1']
    with open(out / 'clients.csv') as f:
        assert len(list(csv.DictReader(f))) == 4
    assert '**Diverged at round 1**' in (out / 'report.md').read_text()
    assert json.loads((out / 'config.json').read_text())['stop_on_divergence'] is True
