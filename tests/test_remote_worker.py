"""Rounds on TFF workers someone else runs (`--workers=host:port,...`) equal the local runtime's."""

import csv
import os
import subprocess

import portpicker
import pytest

from tff_pfl import runtime
from tff_pfl.program import algorithms, experiment, run_config


@pytest.fixture(scope='module')
def two_workers():
    """Two `worker_binary`s on loopback ports, started here and ended by PID."""
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    processes = [
        subprocess.Popen(runtime._worker_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in ports
    ]
    try:
        for port in ports:
            runtime.check_worker(f'localhost:{port}', timeout=60)
        yield tuple(f'localhost:{port}' for port in ports)
    finally:
        for process in processes:
            runtime.end_process(process)
        assert all(process.poll() is not None for process in processes)


@pytest.fixture
def worker(two_workers):
    return two_workers[0]


def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _config(out, algorithm='persfl', **kwargs):
    small = dict(batch_size=16, temperatures=(1.0, 5.0), imitations=(0.0, 0.5), distill_epochs=1, local_epochs=1)
    own = algorithms.get(algorithm).settings.field_names()
    return run_config.make_config(
        output_dir=str(out),
        algorithm=algorithm,
        dataset='synthetic',
        num_clients=5,
        rounds=2,
        eval_every=1,
        **{k: v for k, v in small.items() if k in own},
        **kwargs,
    )


def _assert_same_results(first, second):
    for name in ('clients.csv', 'metrics.csv'):
        drop = {'round_seconds', 'personalize_seconds'}
        assert [{k: v for k, v in r.items() if k not in drop} for r in _rows(second / name)] == [
            {k: v for k, v in r.items() if k not in drop} for r in _rows(first / name)
        ]


def test_remote_worker_gives_the_local_runtimes_numbers(worker, tmp_path):
    experiment.run_experiment(_config(tmp_path / 'local'), log=lambda line: None)
    experiment.run_experiment(_config(tmp_path / 'remote', workers=(worker,)), log=lambda line: None)
    _assert_same_results(tmp_path / 'local', tmp_path / 'remote')
    # The rounds ran on the remote worker: no local worker log was written.
    assert not os.path.exists(tmp_path / 'remote' / 'worker.log')


@pytest.mark.parametrize(
    'algorithm, extra', [('fedavg', {}), ('persfl', {}), ('ktpfl_homo', {'partition': 'iid'})]
)  # a round of two phases
def test_two_workers_give_the_local_runtimes_numbers(algorithm, extra, two_workers, tmp_path):
    experiment.run_experiment(_config(tmp_path / 'local', algorithm, **extra), log=lambda line: None)
    experiment.run_experiment(_config(tmp_path / 'two', algorithm, workers=two_workers, **extra), log=lambda line: None)
    _assert_same_results(tmp_path / 'local', tmp_path / 'two')
    # The client states stayed with the devices: one state file per client.
    assert sorted(os.listdir(tmp_path / 'two' / 'client_states')) == [f'client_{i:05d}.state' for i in range(5)]
    assert not os.path.exists(tmp_path / 'local' / 'client_states')


def test_unreachable_worker_is_refused_before_anything_is_written(tmp_path):
    port = portpicker.pick_unused_port()
    with pytest.raises(run_config.ConfigError, match=f'no TFF worker answers at localhost:{port}'):
        experiment.run_experiment(_config(tmp_path / 'out', workers=(f'localhost:{port}',)))
    assert not os.path.exists(tmp_path / 'out')


@pytest.mark.parametrize(
    'workers, message',
    [
        (('localhost',), 'worker address must be host:port'),
        (('localhost:70000',), 'worker address must be host:port'),
        (('a:1', 'a:1'), 'an address repeats: a:1,a:1'),
    ],
)
def test_bad_worker_flags_are_refused(workers, message, tmp_path):
    with pytest.raises(run_config.ConfigError, match=message):
        _config(tmp_path / 'out', workers=workers).validate()


@pytest.mark.parametrize('algorithm, extra', [('kdpdfl', {}), ('kdpdfl_fedavg', {}), ('kdpdfl_local', {})])
def test_rounds_with_more_than_one_aggregation_are_refused_on_several_workers(algorithm, extra, tmp_path):
    with pytest.raises(
        run_config.ConfigError, match=f'{algorithm} cannot be split over several workers: .*; give one worker'
    ):
        _config(tmp_path / 'out', algorithm, workers=('a:1', 'b:2'), **extra).validate()
    _config(tmp_path / 'out', algorithm, workers=('a:1',), **extra).validate()
