"""A TFF worker lost during a computation ends it with one clear error, where TFF would retry for ever."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import tensorflow_federated as tff

from tff_pfl import runtime, worker_channel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _FailingStub:
    """A worker's stub whose next `failures` calls fail as TFF's stub fails on UNAVAILABLE."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0

    def _answer(self, request):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise tff.framework.RetryableError('UNAVAILABLE: failed to connect to all addresses')
        return ('answer', request)

    compute = create_value = create_call = create_struct = create_selection = get_executor = _answer
    dispose = dispose_executor = _answer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_local_worker_that_exited_is_lost_at_the_first_failed_call():
    stub = worker_channel.WatchedStub(_FailingStub(1), '(pid 42)', exit_code=lambda: -11)
    with pytest.raises(runtime.WorkerLostError) as raised:
        stub.compute('request')
    assert str(raised.value) == 'the TFF worker (pid 42) was killed by SIGSEGV during a computation'
    assert not isinstance(raised.value, tff.framework.RetryableError)  # TFF's context does not retry it


def test_a_running_worker_that_refuses_calls_is_lost_after_the_grace_period():
    clock = _Clock()
    stub = worker_channel.WatchedStub(
        _FailingStub(10), 'at host:1', exit_code=lambda: None, lost_after=300.0, clock=clock
    )
    for now in (0.0, 100.0, 299.0):  # retryable until the worker has refused calls for 300 s
        clock.now = now
        with pytest.raises(tff.framework.RetryableError):
            stub.create_value('request')
    clock.now = 300.0
    with pytest.raises(runtime.WorkerLostError, match=r'^the TFF worker at host:1 has refused every call for 300 s$'):
        stub.create_call('request')


def test_an_answered_call_resets_the_grace_period():
    clock = _Clock()
    inner = _FailingStub(1)
    stub = worker_channel.WatchedStub(inner, 'at host:1', lost_after=10.0, clock=clock)
    with pytest.raises(tff.framework.RetryableError):
        stub.compute('a')
    clock.now = 5.0
    assert stub.compute('b') == ('answer', 'b')
    inner.failures = 2
    clock.now = 12.0  # 12 s after the first failure, but the worker answered at 5 s
    with pytest.raises(tff.framework.RetryableError):
        stub.compute('c')
    clock.now = 21.0
    with pytest.raises(tff.framework.RetryableError):
        stub.compute('d')
    clock.now = 22.0
    inner.failures = 1
    with pytest.raises(runtime.WorkerLostError):
        stub.compute('e')


def test_an_executor_disposal_passes_failures_through_as_tff_expects():
    # TFF catches a failed executor disposal (a lost worker holds nothing to free): it must stay retryable.
    stub = worker_channel.WatchedStub(_FailingStub(1), '(pid 1)', exit_code=lambda: -9)
    with pytest.raises(tff.framework.RetryableError):
        stub.dispose_executor('request')


def test_a_value_disposal_to_a_worker_out_of_reach_is_dropped():
    # TFF disposes of values from weakref finalizers, where a raise prints a traceback on stderr.
    inner = _FailingStub(1)
    stub = worker_channel.WatchedStub(inner, '(pid 1)', exit_code=lambda: -9)
    assert stub.dispose('request') is None
    assert stub.dispose('again') == ('answer', 'again') and inner.calls == 2


def test_a_value_disposal_that_fails_otherwise_is_not_hidden():
    class _Refusing(_FailingStub):
        def dispose(self, request):
            raise ValueError('not a value of this executor')

    stub = worker_channel.WatchedStub(_Refusing(0), '(pid 1)')
    with pytest.raises(ValueError, match='not a value'):
        stub.dispose('request')


@pytest.mark.parametrize(
    'code, phrase',
    [(-11, 'was killed by SIGSEGV'), (-9, 'was killed by SIGKILL'), (3, 'exited with code 3'), (-99, 'signal 99')],
)
def test_exit_descriptions(code, phrase):
    assert phrase in worker_channel.exit_description(code)


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    import tensorflow_federated as tff
    from tff_pfl import runtime

    @tff.tensorflow.computation(np.float32)
    def add_one(x):
        return x + 1.0

    with runtime.local_runtime(log_path=sys.argv[1]) as rt:
        assert add_one(1.0) == 2.0
        os.kill(rt.pid, signal.SIGSEGV)
        while rt.alive:
            time.sleep(0.01)
        started = time.monotonic()
        try:
            add_one(2.0)
        except runtime.WorkerLostError as e:
            print(f'lost after {time.monotonic() - started:.1f} s: {e}', flush=True)
    """
)


def test_a_computation_on_a_dead_local_worker_fails_instead_of_retrying_for_ever(tmp_path):
    log = tmp_path / 'worker.log'
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    # Without the watch TFF retries every 30 s without end: the timeout fails the test.
    done = subprocess.run(
        [sys.executable, '-c', SCRIPT, str(log)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    found = re.fullmatch(
        rf'lost after ([0-9.]+) s: the TFF worker \(pid [0-9]+, log {re.escape(str(log))}\) was killed by SIGSEGV '
        'during a computation',
        line,
    )
    assert found, done.stdout
    assert float(found.group(1)) < 30.0  # at the first failed call, not after TFF's backoff


REMOTE_SCRIPT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    import numpy as np
    import portpicker
    import tensorflow_federated as tff
    from tff_pfl import runtime, worker_channel

    worker_channel.LOST_AFTER_S = 2.0  # 300 s in a run

    @tff.tensorflow.computation(np.float32)
    def add_one(x):
        return x + 1.0

    port = portpicker.pick_unused_port()
    worker = subprocess.Popen(runtime._worker_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with runtime.RemoteRuntime(f'localhost:{port}', ready_timeout=60):
            assert add_one(1.0) == 2.0
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            try:
                add_one(2.0)
            except runtime.WorkerLostError as e:
                print(e, flush=True)
    finally:
        runtime.end_process(worker)
    """
)


def test_a_remote_worker_that_stops_answering_is_given_up_after_the_grace_period():
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    done = subprocess.run([sys.executable, '-c', REMOTE_SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith('the TFF worker at localhost:') and ' has refused every call for ' in line, done.stdout
