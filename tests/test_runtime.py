"""No TFF worker outlives the process that started it, on any exit path."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tff_pfl import runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Starts the project's runtime, runs one computation, prints the worker PID,
# then ends in the way named by argv[1].
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import tensorflow_federated as tff
    from tff_pfl import runtime

    runtime.install_sigterm_handler()
    mode = sys.argv[1]

    @tff.tensorflow.computation(np.float32)
    def add_one(x):
        return x + 1.0

    def body():
        with runtime.local_runtime() as rt:
            assert add_one(1.0) == 2.0
            assert 'worker_binary' in open(f'/proc/{rt.pid}/cmdline').read()
            print(rt.pid, flush=True)
            if mode == 'exception':
                raise RuntimeError('boom')
            if mode in ('sigterm', 'sigkill'):
                time.sleep(60)
            if mode == 'exit_inside':
                sys.exit(3)

    if mode == 'no_runtime':
        runtime.refuse_implicit_runtime()
        try:
            add_one(1.0)
        except RuntimeError as e:
            print('refused:', e, flush=True)
        sys.exit(0)
    if mode == 'refuse_inside':
        with runtime.local_runtime():
            runtime.refuse_implicit_runtime()  # as a binary's main run inside a test's runtime does
            assert add_one(1.0) == 2.0
        try:
            add_one(1.0)
        except RuntimeError as e:
            print('refused:', e, flush=True)
        sys.exit(0)
    if mode == 'no_context_manager':
        rt = runtime.LocalRuntime()
        assert add_one(1.0) == 2.0
        print(rt.pid, flush=True)
    else:
        body()
    """
)


# Imports the modules of tff_pfl, processes and deploy named by argv[1] ('library': all of them; else
# a comma-separated list, e.g. the benchmark tool's binary, whose absl flags clash with train's),
# checks TFF's execution context is the object TFF installed, runs a computation in it (TFF's own
# worker), then ends that worker (TFF never does: tff_pfl/runtime.py) and prints what it ran.
IMPORT_SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import numpy as np
    import psutil
    import tensorflow_federated as tff

    before = tff.framework.get_context_stack().current
    if sys.argv[1] == 'library':
        names = []
        for package in ('tff_pfl', 'processes', 'deploy'):
            names.append(package)
            path = importlib.import_module(package).__path__
            names += [m.name for m in pkgutil.walk_packages(path, package + '.')]
    else:
        names = sys.argv[1].split(',')
    for name in names:
        importlib.import_module(name)
    assert tff.framework.get_context_stack().current is before, type(tff.framework.get_context_stack().current)

    @tff.tensorflow.computation(np.float32)
    def add_one(x):
        return x + 1.0

    assert add_one(1.0) == 2.0
    workers = psutil.Process().children(recursive=True)
    print(len(names), ' '.join(sorted({w.name() for w in workers})), flush=True)
    for worker in workers:
        worker.kill()
    psutil.wait_procs(workers, timeout=10)
    """
)


@pytest.mark.parametrize('modules', ['library', 'tff_pfl_bench.cli'])
def test_importing_the_library_leaves_tffs_default_context(modules, tmp_path):
    script = tmp_path / 'importer.py'
    script.write_text(IMPORT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    done = subprocess.run([sys.executable, str(script), modules], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    count, ran_on = done.stdout.split(maxsplit=1)
    # TFF's own context ran the computation: on the worker_binary it started.
    assert 'worker_binary' in ran_on
    assert int(count) >= (40 if modules == 'library' else 1)


def _gone(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _start(mode, tmp_path):
    script = tmp_path / 'driver.py'
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    # stdout is a pipe: a leaked worker holding it open would hang communicate().
    return subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )


def _worker_pid(process):
    line = process.stdout.readline()
    assert line.strip().isdigit(), f'driver printed {line!r}'
    return int(line)


@pytest.mark.parametrize(
    'mode, expected_code',
    [('normal', 0), ('exception', 1), ('exit_inside', 3), ('no_context_manager', 0)],
)
def test_worker_reaped_on_exit(mode, expected_code, tmp_path):
    process = _start(mode, tmp_path)
    pid = _worker_pid(process)
    process.communicate(timeout=60)  # returns only once every pipe holder is gone
    assert process.returncode == expected_code
    assert _gone(pid), f'worker {pid} outlived the driver ({mode})'


@pytest.mark.parametrize('mode', ['no_runtime', 'refuse_inside'])
def test_computations_refuse_to_run_without_a_runtime(mode, tmp_path):
    # refuse_inside: called inside a runtime, it leaves that runtime's context and takes effect after it.
    process = _start(mode, tmp_path)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert out.startswith('refused: no TFF runtime is running'), out


@pytest.mark.parametrize('sig, expected_code', [(signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_worker_reaped_on_signal(sig, expected_code, tmp_path):
    process = _start('sigterm', tmp_path)
    pid = _worker_pid(process)
    process.send_signal(sig)
    process.communicate(timeout=60)
    assert process.returncode == expected_code
    assert _gone(pid), f'worker {pid} outlived the driver ({sig.name})'


def test_nested_runtime_restores_the_outer_one(tff_runtime):
    import numpy as np
    import tensorflow_federated as tff

    from tff_pfl import runtime

    @tff.tensorflow.computation(np.int32)
    def plus_one(x):
        return x + 1

    with runtime.local_runtime() as inner:
        assert plus_one(1) == 2
        inner_pid = inner.pid
    assert _gone(inner_pid)
    assert plus_one(2) == 3  # back on the session's worker
    assert tff_runtime.alive


def test_the_local_worker_runs_with_few_malloc_arenas_unless_the_user_says_otherwise(tff_runtime, monkeypatch):
    with open(f'/proc/{tff_runtime.pid}/environ', 'rb') as f:
        environment = dict(item.split(b'=', 1) for item in f.read().split(b'\0') if b'=' in item)
    assert environment.get(b'MALLOC_ARENA_MAX') == os.environ.get('MALLOC_ARENA_MAX', '2').encode()
    monkeypatch.setenv('MALLOC_ARENA_MAX', '5')
    assert runtime._worker_env()['MALLOC_ARENA_MAX'] == '5'
    monkeypatch.delenv('MALLOC_ARENA_MAX')
    monkeypatch.setattr(runtime, 'WORKER_MALLOC_ARENAS', None)
    assert 'MALLOC_ARENA_MAX' not in runtime._worker_env()


class _FakeExecutor:
    def __init__(self, cardinalities):
        self.cardinalities, self.closed = cardinalities, False

    def close(self):
        self.closed = True


def test_the_executor_cache_closes_what_it_evicts():
    """Every round of Poisson sampling has its own number of clients: evicted executors must be freed."""
    made = []

    def executor_fn(cardinalities):
        made.append(_FakeExecutor(cardinalities))
        return made[-1]

    factory = runtime.ClosingExecutorFactory(executor_fn, size=3)
    first = factory.create_executor({'clients': 90})
    assert factory.create_executor({'clients': 90}) is first  # cached
    for n in (91, 92):
        factory.create_executor({'clients': n})
    factory.create_executor({'clients': 90})  # used again: now the most recent
    factory.create_executor({'clients': 93})  # evicts 91, the least recently used
    assert [e.closed for e in made] == [False, True, False, False]
    factory.clean_up_executor({'clients': 92})
    assert made[2].closed and factory.create_executor({'clients': 92}) is not made[2]
    assert not any(e.closed for e in (made[0], made[3]))
