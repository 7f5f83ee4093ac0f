"""Checkpoints: a run killed with SIGKILL and run again ends with an uninterrupted run's numbers."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tff_pfl.program import checkpoints, experiment, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {'round_seconds', 'personalize_seconds'}


def _flags(tiny_npz, out, rounds=30, **extra):
    flags = dict(
        algorithm='persfl',
        dataset=f'npz:{tiny_npz}',
        partition='ds1',
        classes_per_client=2,
        num_clients=4,
        rounds=rounds,
        eval_every=5,
        batch_size=8,
        client_learning_rate=0.1,
        client_fraction=0.5,
        checkpoint_every=2,
        temperatures='1,3',
        imitations='0,0.5',
        distill_epochs=1,
        output_dir=out,
    )
    flags.update(extra)
    return [f'--{k}={v}' for k, v in flags.items()]


def _train(*flags, **popen):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.Popen(
        [sys.executable, '-m', 'tff_pfl.cli.train', *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _rows(path):
    with open(path, newline='') as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _segment_paths(runs, round_num):
    with np.load(os.path.join(runs.directory, f'round_{round_num}.npz')) as archive:
        return [name for name, _ in json.loads(str(archive['segments']))]


def _data_rows(path):
    try:
        with open(path) as f:
            return max(0, len(f.read().splitlines()) - 1)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope='module')
def uninterrupted(tiny_npz, tmp_path_factory):
    out = tmp_path_factory.mktemp('uninterrupted') / 'run'
    process = _train(*_flags(tiny_npz, out))
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-2000:]
    return out


def test_sigkill_then_rerun_gives_the_uninterrupted_numbers(tiny_npz, uninterrupted, tmp_path):
    out = tmp_path / 'run'
    killed = _train(*_flags(tiny_npz, out), start_new_session=True)
    deadline = time.monotonic() + 300
    while _data_rows(out / 'metrics.csv') < 7 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(killed.pid, signal.SIGKILL)  # the driver and, through PR_SET_PDEATHSIG, its TFF worker
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    assert not (out / 'report.md').exists(), 'the run finished before it was killed; nothing was tested'
    done = _data_rows(out / 'metrics.csv')
    assert 7 <= done < 30
    resumed = _train(*_flags(tiny_npz, out))
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-2000:]
    last = max(r for r in range(2, done + 1, 2))  # the newest checkpoint written before the kill
    assert f'resuming after round {last}' in stdout or f'resuming after round {last - 2}' in stdout, stdout[:2000]
    for name in ('metrics.csv', 'clients.csv'):
        assert _rows(out / name) == _rows(uninterrupted / name), name
    # The newest two manifests are kept, with the client-state segments they build on and no other file.
    kept = sorted(os.listdir(out / 'checkpoints'))
    assert [name for name in kept if name.startswith('round_')] == ['round_26.npz', 'round_28.npz']
    runs = checkpoints.RunCheckpoints(str(out / 'checkpoints'))
    named = {os.path.basename(p) for r in (26, 28) for p in _segment_paths(runs, r)}
    assert [name for name in kept if not name.startswith('round_')] == sorted(named)
    assert 'clients_28.npz' in named


def test_a_worker_killed_mid_run_ends_the_run_in_one_line_and_the_rerun_continues(tiny_npz, uninterrupted, tmp_path):
    # TFF retries a call to a dead worker for ever: before the watch, the driver hung here.
    import psutil

    out = tmp_path / 'run'
    driver = _train(*_flags(tiny_npz, out))
    deadline = time.monotonic() + 300
    while _data_rows(out / 'metrics.csv') < 7 and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = [p for p in psutil.Process(driver.pid).children(recursive=True) if p.name() == 'worker_binary']
    assert len(workers) == 1, workers
    workers[0].send_signal(signal.SIGSEGV)
    _, stderr = driver.communicate(timeout=120)
    assert not (out / 'report.md').exists(), 'the run finished before its worker was killed; nothing was tested'
    assert driver.returncode == 1
    assert stderr.strip().splitlines() == [
        f'tff-pfl-train: error: the TFF worker (pid {workers[0].pid}, log {out}/worker.log) was killed by SIGSEGV '
        f'during a computation; the checkpoints in {out} are kept: the same command continues from the last one'
    ]
    assert any(name.startswith('round_') for name in os.listdir(out / 'checkpoints'))
    resumed = _train(*_flags(tiny_npz, out))
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-2000:]
    assert 'resuming after round' in stdout
    for name in ('metrics.csv', 'clients.csv'):
        assert _rows(out / name) == _rows(uninterrupted / name), name


def test_changing_the_configuration_of_a_run_is_refused(tiny_npz, uninterrupted, tmp_path):
    before = {name: (uninterrupted / name).read_bytes() for name in ('metrics.csv', 'config.json', 'clients.csv')}
    process = _train(*_flags(tiny_npz, uninterrupted, rounds=31))
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 2
    assert stderr.strip().splitlines() == [
        f'tff-pfl-train: error: output_dir {uninterrupted} holds a run with another configuration '
        '(rounds: 30 -> 31); pass --overwrite to replace it'
    ]
    assert before == {name: (uninterrupted / name).read_bytes() for name in before}


def test_a_finished_run_is_not_run_again(tiny_npz, uninterrupted):
    process = _train(*_flags(tiny_npz, uninterrupted))
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 0
    assert 'already holds this run, finished' in stdout and 'round 1/' not in stdout


def test_a_crash_while_writing_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    store = checkpoints.RunCheckpoints(str(tmp_path))
    server = {'model': [np.ones((2, 2), np.float32)], 'round_num': np.int32(2)}
    clients = {
        'a': {'client_id': b'a', 'w': np.zeros(3, np.float32)},
        'b': {'client_id': b'b', 'w': np.ones(3, np.float32)},
    }
    store.save(
        2,
        server,
        list(clients),
        checkpoints.ClientRows.from_states(clients),
        {'state': 1},
        [{'round': 1}, {'round': 2}],
    )

    def crash(archive, name, array):
        with archive.open(f'{name}.npy', 'w') as f:
            f.write(b'half a checkpoint')
        raise OSError('disk gone')

    monkeypatch.setattr(checkpoints, '_write_array', crash)
    with pytest.raises(OSError, match='disk gone'):
        store.save(4, server, list(clients), checkpoints.ClientRows.from_states(clients), {'state': 2}, [])
    monkeypatch.undo()
    # the torn write is not a checkpoint
    assert sorted(os.listdir(tmp_path)) == ['clients_2.npz', 'clients_4.npz.tmp', 'round_2.npz']
    restored = checkpoints.RunCheckpoints(str(tmp_path)).load_latest(server)
    assert restored.round_num == 2 and restored.rng_state == {'state': 1}
    assert restored.client_ids == ['a', 'b']
    states = restored.client_states(clients['a'])
    np.testing.assert_array_equal(states['b']['w'], np.ones(3))
    assert states['b']['client_id'] == b'b'
    assert restored.rows == [{'round': 1}, {'round': 2}]


def test_same_seed_same_results(tiny_npz, uninterrupted, tmp_path):
    """Partition, sampling and training repeat exactly for the same configuration."""
    again = tmp_path / 'again'
    config = run_config.make_config(
        output_dir=str(again),
        algorithm='persfl',
        dataset=f'npz:{tiny_npz}',
        partition='ds1',
        classes_per_client=2,
        num_clients=4,
        rounds=30,
        eval_every=5,
        batch_size=8,
        client_learning_rate=0.1,
        client_fraction=0.5,
        checkpoint_every=2,
        temperatures=(1.0, 3.0),
        imitations=(0.0, 0.5),
        distill_epochs=1,
    )
    experiment.run_experiment(config, log=lambda line: None)
    for name in ('partition.csv', 'metrics.csv', 'clients.csv'):
        assert _rows(again / name) == _rows(uninterrupted / name), name


def test_device_state_files_written_in_python_are_what_the_device_reads(tmp_path, tff_runtime):
    """Checkpoints restore device-held states with `device_state.save`; the device's TF code must read them."""
    import collections

    import tensorflow_federated as tff

    from tff_pfl.computations import device_state

    @tff.tensorflow.computation(np.str_)
    def initial(client_id):
        return collections.OrderedDict(client_id=client_id, count=np.int32(0), weights=[np.zeros((2, 3), np.float32)])

    @tff.tensorflow.computation(np.int32, initial.type_signature.result)
    def show(unused, state):
        del unused
        return state

    read = device_state.reading(show, initial, [tff.TensorType(np.int32)])
    state = collections.OrderedDict(
        client_id=b'c1', count=np.int32(7), weights=[np.arange(6, dtype=np.float32).reshape(2, 3)]
    )
    device = device_state.device_input('c1', str(tmp_path))
    device_state.save(device['state_file'], state)
    seen = read(np.int32(0), device)['result']
    assert seen['count'] == 7 and seen['client_id'] == b'c1'
    np.testing.assert_array_equal(seen['weights'][0], state['weights'][0])
    loaded = device_state.load(device['state_file'], initial('c1'))
    np.testing.assert_array_equal(loaded['weights'][0], state['weights'][0])
    assert loaded['count'] == 7
    assert not os.path.exists(device['state_file'] + '.tmp')
