"""Rounds on TFF workers someone else runs (`--workers=host:port,...`) equal the local runtime's."""

import asyncio
import csv
import os
import subprocess
import threading

import numpy as np
import portpicker
import pytest
import tensorflow_federated as tff

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


class _MeetingContext:
    """A worker's synchronous context whose call returns only once the other worker's call has started."""

    def __init__(self, barrier):
        self._barrier = barrier

    def invoke(self, comp, arg):
        del comp
        self._barrier.wait()
        return arg


def test_workers_compute_their_shares_at_the_same_time():
    # Each share waits at a barrier for the others: shares run one after the other never meet there.
    # More workers than the event loop's default thread pool holds (min(32, cores + 4)): each has its own thread.
    workers = min(32, (os.cpu_count() or 1) + 4) + 2
    barrier = threading.Barrier(workers, timeout=30)
    record = runtime.WorkerCalls(workers)
    contexts = [runtime.SyncContextInThread(_MeetingContext(barrier), i, record) for i in range(workers)]

    async def both(contexts):
        return await asyncio.gather(*(context.invoke(None, i) for i, context in enumerate(contexts)))

    assert asyncio.run(both(contexts)) == list(range(workers))
    assert record.calls == [1] * workers
    for context in contexts:
        context.close()

    class Blocking(tff.framework.AsyncContext):
        """The way TFF's own asynchronous remote context calls a worker: blocking inside the coroutine."""

        def __init__(self, barrier):
            self._context = _MeetingContext(barrier)

        async def invoke(self, comp, arg):
            return self._context.invoke(comp, arg)

    blocking = threading.Barrier(2, timeout=2)
    with pytest.raises(threading.BrokenBarrierError):
        asyncio.run(both([Blocking(blocking), Blocking(blocking)]))


def test_two_workers_each_compute_a_share_of_the_clients(two_workers):
    @tff.tensorflow.computation(np.float32)
    def double(x):
        return x * 2.0

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def doubled_sum(values):
        return tff.federated_sum(tff.federated_map(double, values))

    with runtime.RemoteRuntime(two_workers) as remote:
        assert doubled_sum([1.0, 2.0, 3.0, 4.0]) == pytest.approx(20.0)
        calls = list(remote.calls.calls)
    # Both workers ran calls (their halves up to the sum; the merge and what follows on one of them).
    assert len(calls) == 2 and min(calls) >= 1, calls
    assert np.isfinite(remote.calls.seconds).all()
