"""Rounds on a TFF worker someone else runs (`--workers=host:port`) equal the local runtime's."""

import csv
import os
import subprocess

import portpicker
import pytest

from tff_pfl import runtime
from tff_pfl.program import experiment


@pytest.fixture
def worker():
    """A `worker_binary` on a loopback port, started here and ended by PID."""
    port = portpicker.pick_unused_port()
    process = subprocess.Popen(
        runtime._worker_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runtime.check_worker(f'localhost:{port}', timeout=60)
        yield f'localhost:{port}'
    finally:
        runtime.end_process(process)


def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _config(out, **kwargs):
    return experiment.ExperimentConfig(
        output_dir=str(out), algorithm='persfl', dataset='synthetic', num_clients=4, rounds=2, eval_every=1,
        batch_size=16, temperatures=(1.0, 5.0), imitations=(0.0, 0.5), distill_epochs=1, **kwargs)


def test_remote_worker_gives_the_local_runtimes_numbers(worker, tmp_path):
    experiment.run_experiment(_config(tmp_path / 'local'), log=lambda line: None)
    experiment.run_experiment(_config(tmp_path / 'remote', workers=(worker,)), log=lambda line: None)
    for name in ('clients.csv', 'metrics.csv'):
        local, remote = _rows(tmp_path / 'local' / name), _rows(tmp_path / 'remote' / name)
        drop = {'round_seconds', 'personalize_seconds'}
        assert [{k: v for k, v in r.items() if k not in drop} for r in remote] == \
            [{k: v for k, v in r.items() if k not in drop} for r in local]
    # The rounds ran on the remote worker: no local worker log was written.
    assert not os.path.exists(tmp_path / 'remote' / 'worker.log')


def test_unreachable_worker_is_refused_before_anything_is_written(tmp_path):
    port = portpicker.pick_unused_port()
    with pytest.raises(experiment.ConfigError, match=f'no TFF worker answers at localhost:{port}'):
        experiment.run_experiment(_config(tmp_path / 'out', workers=(f'localhost:{port}',)))
    assert not os.path.exists(tmp_path / 'out')


@pytest.mark.parametrize('workers, message', [
    (('localhost',), 'worker address must be host:port'),
    (('localhost:70000',), 'worker address must be host:port'),
    (('a:1', 'b:2'), 'several --workers are not supported yet'),
])
def test_bad_worker_flags_are_refused(workers, message, tmp_path):
    with pytest.raises(experiment.ConfigError, match=message):
        _config(tmp_path / 'out', workers=workers).validate()
