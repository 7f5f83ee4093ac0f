"""The TFF runtime the project runs on: a `worker_binary` whose lifetime we own.

`import tensorflow_federated` installs a local C++ context that starts TFF's
`worker_binary` lazily, lets it inherit stdout/stderr, and kills it only in a
`__del__` that fails at interpreter exit, so the worker outlives the Python
process (and keeps any pipe open). This module starts the worker itself and,
while it runs, installs an equivalent execution context in TFF's place:

* the worker is started eagerly, from the calling (main) thread, with its
    output sent to a log file (or discarded), never to our stdout/stderr;
* the kernel ends it if the driver dies by any means, SIGKILL included
    (`PR_SET_PDEATHSIG`, set through `setpriv --pdeathsig KILL`);
* `LocalRuntime.close()` ends it by PID on normal exit and on exceptions (use
    it as a context manager), and an `atexit` hook covers the rest;
* SIGTERM is turned into `SystemExit` by `install_sigterm_handler()`, so the
    same clean-up runs.

Importing this module (or any of the library) changes no TFF state: outside a
runtime, TFF's own default context stays in place. `refuse_implicit_runtime()`
replaces it by one that refuses to run anything; the binaries and the tests
call it, so that no code path of theirs starts TFF's unreaped worker.

Typical use:

```python
with runtime.local_runtime() as rt:
    state = process.initialize()
    ...
```
"""

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

import grpc
import portpicker
import tensorflow_federated as tff

from tff_pfl import netns, worker_channel

_READY_TIMEOUT_S = 60.0

# Re-exported: the runtime's API (docs/runtime.md) names them `runtime.X`.
RuntimeStartError = worker_channel.RuntimeStartError
WorkerLostError = worker_channel.WorkerLostError
TlsCredentials = worker_channel.TlsCredentials
TlsFileError = worker_channel.TlsFileError
isolate_network = netns.isolate_network
network_isolated = netns.network_isolated


class NoRuntimeContext(tff.framework.SyncContext):
    """Default context while no `LocalRuntime` is open: invoking fails clearly.

    Installed by `refuse_implicit_runtime()` (the binaries, the tests) in place
    of TFF's lazily started, never reaped local worker.
    """

    def invoke(self, comp, arg):
        """Fails: no runtime is open to run `comp`.

        Args:
            comp: the computation being invoked (ignored).
            arg: its argument (ignored).

        Raises:
            RuntimeError: always, naming `local_runtime` as the fix.
        """
        del comp, arg
        raise RuntimeError('no TFF runtime is running: wrap the calls in `with tff_pfl.runtime.local_runtime():`')


# The runtimes whose context is installed, oldest first (they close LIFO): the oldest one puts
# back the context of "outside any runtime".
_OPEN_RUNTIMES: list = []


def refuse_implicit_runtime() -> None:
    """Makes a computation invoked outside a runtime fail, instead of starting TFF's own worker.

    Sets `NoRuntimeContext` as TFF's default context; called while runtimes
    are open (e.g. a binary's `main` run inside a test's runtime), it leaves
    theirs in place and becomes what the oldest one puts back when it closes.
    Not called on import: a user's process keeps TFF's default context unless
    it calls this.
    """
    if _OPEN_RUNTIMES:
        _OPEN_RUNTIMES[0]._previous_context = NoRuntimeContext()
    else:
        tff.framework.set_default_context(NoRuntimeContext())


def worker_binary_path() -> str:
    """Returns the path of the `worker_binary` shipped inside the TFF wheel.

    Returns:
        `<tensorflow_federated package>/data/worker_binary` (not checked to
        exist).
    """
    package_dir = os.path.dirname(tff.__file__)
    return os.path.join(package_dir, 'data', 'worker_binary')


# glibc malloc arenas of the local worker. With the default (8 per core) the
# worker's resident memory kept climbing over rounds of 100 clients out of
# 1000, as freed memory stayed spread over many arenas (PersFL: 898 -> 1348 MB
# from round 5 to 39); with 2 it held level (878 -> 878 MB, and 927 -> 986 MB
# in a second run): benchmarks/results/scale_clients.md.
# MALLOC_ARENA_MAX in the environment wins; None leaves glibc's default.
WORKER_MALLOC_ARENAS: int | None = 2


def _worker_env() -> dict:
    """The local worker's environment: the driver's, with `MALLOC_ARENA_MAX` set."""
    env = dict(os.environ)
    if WORKER_MALLOC_ARENAS is not None:
        env.setdefault('MALLOC_ARENA_MAX', str(WORKER_MALLOC_ARENAS))
    return env


def _worker_command(port: int, max_concurrent_computation_calls: int) -> list[str]:
    command = [
        worker_binary_path(),
        f'--port={port}',
        f'--max_concurrent_computation_calls={max_concurrent_computation_calls}',
    ]
    setpriv = shutil.which('setpriv')
    if setpriv is not None:
        # The kernel sends SIGKILL to the worker when its parent dies, whatever
        # the cause; the setting survives the exec of the worker.
        command = [setpriv, '--pdeathsig', 'KILL', '--'] + command
    return command


def _wait_until_ready(
    address: str, timeout: float, process: subprocess.Popen
) -> 'tff.framework.RemoteExecutorGrpcStub':
    """A stub for the worker we started at `address`, once it answers.

    Raises:
        RuntimeStartError: if `process` (the worker we started) exits, or the
            worker does not answer within `timeout` seconds.
    """
    channel = grpc.insecure_channel(address, worker_channel.GRPC_OPTIONS)
    stub = tff.framework.RemoteExecutorGrpcStub(channel)
    deadline = time.monotonic() + timeout
    while not stub.is_ready:
        if process.poll() is not None:
            raise RuntimeStartError(f'TFF worker exited with code {process.returncode} before it was ready')
        if time.monotonic() > deadline:
            raise RuntimeStartError(f'TFF worker did not become ready in {timeout:g} s')
        time.sleep(0.05)
    return stub


def compile_for_worker(comp):
    """TFF's native compilation, with secure-sum intrinsics replaced by what they compute.

    TFF's worker implements no secure-aggregation protocol; a simulation runs
    the secure sums' arithmetic (clip, quantize, integer sum, dequantize) as
    plain TensorFlow, as TFF's own test contexts do. The computation itself,
    and what it exports, keep the secure intrinsics (docs/privacy.md).

    Args:
      comp: a computation building block.

    Returns:
      The compiled building block.
    """
    from tensorflow_federated.python.core.backends.test import compiler as test_compiler

    return tff.backends.native.desugar_and_transform_to_native(
        test_compiler.replace_secure_intrinsics_with_bodies(comp)
    )


def _unused_secure_sum_assertion(record: logging.LogRecord) -> bool:
    """False for TensorFlow's complaint about the assertions TFF's secure-sum bodies build and never run."""
    message = record.getMessage()
    return not ('Object was never used' in message and 'assert_less_equal' in message)


# Those complaints come when the graphs are collected, at any later time; they
# are noise (the assertions are TFF's, unused by design), so they never show.
logging.getLogger('tensorflow').addFilter(_unused_secure_sum_assertion)


class ClosingExecutorFactory(tff.framework.ExecutorFactory):
    """TFF's executor cache per cardinalities, which also frees what it evicts on the worker.

    TFF's `ResourceManagingExecutorFactory` keeps the executors of the last 10
    cardinalities (numbers of clients) and drops older ones without closing
    them, so the worker keeps each dropped executor's state (its values and
    instantiated functions) for good. Under Poisson sampling every round has
    its own number of clients, and the worker grew without bound (a DP
    benchmark's worker was killed at 10.6 GB); with a fixed number of clients
    it stays flat. Here an evicted executor is closed
    (`RemoteExecutor.close`: the worker disposes of it), so the worker holds
    at most `size` executors (benchmarks/results/memory_poisson.md: +42 MB
    from round 20 to 100 against +343 MB with TFF's cache).
    """

    def __init__(self, executor_fn, size: int = 10):
        """Configures the cache.

        Args:
          executor_fn: cardinalities -> a new executor (with its cardinalities
            set).
          size: executors kept, most recently used first.
        """
        self._executor_fn = executor_fn
        self._size = size
        self._executors = collections.OrderedDict()

    @staticmethod
    def _key(cardinalities):
        return tuple(sorted((str(placement), int(n)) for placement, n in cardinalities.items()))

    def create_executor(self, cardinalities):
        """The executor of these cardinalities, made (and the oldest closed) if not cached.

        Args:
          cardinalities: placement -> number of participants.

        Returns:
          An executor for these cardinalities.
        """
        key = self._key(cardinalities)
        if key in self._executors:
            self._executors.move_to_end(key)
            return self._executors[key]
        executor = self._executor_fn(dict(cardinalities))
        self._executors[key] = executor
        while len(self._executors) > self._size:
            _, oldest = self._executors.popitem(last=False)
            oldest.close()
        return executor

    def clean_up_executor(self, cardinalities):
        """Closes and forgets the executor of these cardinalities (after an error).

        Args:
          cardinalities: placement -> number of participants.
        """
        executor = self._executors.pop(self._key(cardinalities), None)
        if executor is not None:
            executor.close()


def _executor_fn(stub):
    """The executor factory of the worker behind `stub`."""

    def executor_fn(cardinalities):
        # Computations with no CLIENTS-placed argument (initialize) still
        # need a CLIENTS cardinality; 0 is what TFF's own context uses.
        cardinalities.setdefault(tff.CLIENTS, 0)
        executor = tff.framework.RemoteExecutor(stub)
        executor.set_cardinalities(cardinalities)
        return executor

    return ClosingExecutorFactory(executor_fn)


def _execution_context(stub):
    """TFF's synchronous execution context on the worker behind `stub`."""
    return tff.framework.SyncExecutionContext(
        executor_fn=_executor_fn(stub),
        compiler_fn=compile_for_worker,
        transform_args=tff.tensorflow.transform_args,
        transform_result=tff.tensorflow.transform_result,
    )


def async_execution_context(stub):
    """TFF's asynchronous execution context on the worker behind `stub` (for `tff.program`'s contexts).

    Args:
      stub: the worker's stub (`LocalRuntime.stub`).

    Returns:
      A `tff.framework.AsyncExecutionContext`, e.g. for
      `tff.program.NativeFederatedContext`.
    """
    return tff.framework.AsyncExecutionContext(
        executor_fn=_executor_fn(stub),
        compiler_fn=compile_for_worker,
        transform_args=tff.tensorflow.transform_args,
        transform_result=tff.tensorflow.transform_result,
    )


class WorkerCalls:
    """What each worker of a `RemoteRuntime` ran: calls and busy seconds, per worker.

    Attributes:
        seconds: worker index -> seconds spent in its calls so far.
        calls: worker index -> number of calls so far.
    """

    def __init__(self, workers: int):
        """An empty record.

        Args:
            workers: number of workers.
        """
        self._lock = threading.Lock()
        self.seconds = [0.0] * workers
        self.calls = [0] * workers

    def add(self, worker: int, seconds: float) -> None:
        """Counts one call of `worker` that took `seconds`.

        Args:
            worker: the worker's index.
            seconds: how long the call took, from the driver.
        """
        with self._lock:
            self.seconds[worker] += seconds
            self.calls[worker] += 1


class SyncContextInThread(tff.framework.AsyncContext):
    """One worker's synchronous TFF context, as the asynchronous context TFF's mergeable context needs.

    TFF 0.87's `RemoteExecutor` makes blocking gRPC calls from inside its
    coroutines, so under TFF's own asynchronous context every call holds the
    mergeable context's event loop until the worker answers: the workers'
    shares of a round ran one after the other, never at the same time (a round
    on two workers took as long as on one). Here each call runs the worker's
    synchronous context on a thread of this worker's own, so the event loop
    hands the next worker its share while the first one computes. The
    mergeable context gives each worker's context one call at a time, so one
    thread per worker is enough, and enough for any number of workers (the
    event loop's shared default pool holds min(32, cores + 4) threads: on two
    cores, a seventh worker would wait for a thread).
    """

    def __init__(self, context, index: int, record: WorkerCalls | None = None):
        """Wraps `context`.

        Args:
            context: a synchronous TFF context (`tff.framework.SyncContext`) of one worker.
            index: the worker's index, for `record`.
            record: optional; receives each call's seconds.
        """
        self._context = context
        self._index = index
        self._record = record
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f'tff-worker-{index}')

    def close(self) -> None:
        """Ends this worker's thread once its call (if any) returns; safe to call twice."""
        self._thread.shutdown(wait=False)

    async def invoke(self, comp, arg):
        """Runs `comp(arg)` on the worker, in a thread, without blocking the event loop.

        Args:
            comp: the computation.
            arg: its argument, or None.

        Returns:
            The worker context's result.
        """
        start = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, self._context.invoke, comp, arg)
        finally:
            if self._record is not None:
                self._record.add(self._index, time.monotonic() - start)


def parse_worker_address(address: str) -> tuple[str, int]:
    """`host:port` -> `(host, port)`.

    Args:
        address: `host:port`; the port follows the last `:`.

    Returns:
        `(host, port)`, the port as an `int`.

    Raises:
        ValueError: with a one-line message if `address` is not `host:port`
            with a port in 1..65535.
    """
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f'worker address must be host:port, got {address!r}')
    return host, int(port)


def check_worker(address: str, timeout: float = 10.0, *, tls: TlsCredentials | None = None) -> None:
    """Raises `RuntimeStartError` unless a TFF worker answers at `address`.

    The worker runs nothing for it: the check calls a method no server has.

    Args:
        address: `host:port` of the worker (of its TLS front with `tls`).
        timeout: seconds to wait at most for it to answer.
        tls: the driver's credentials for mutual TLS with the worker's front;
            None: plain gRPC.

    Raises:
        ValueError: if `address` is not `host:port`.
        RuntimeStartError: if nothing answers in `timeout` seconds, or at
            once when the TLS handshake fails or the front refuses the
            driver's certificate (one line, with gRPC's reason).
    """
    parse_worker_address(address)
    worker_channel.open_channel(address, timeout, tls).close()


@contextlib.contextmanager
def runtime_for(workers=(), *, tls: TlsCredentials | None = None, **local_kwargs):
    """The runtime of a run: the given remote workers, or a local one we own.

    Args:
        workers: `()` for a local worker, else `host:port` of each worker.
        tls: with `workers`, the driver's mutual-TLS credentials for the
            workers' TLS fronts; None: plain gRPC.
        **local_kwargs: `LocalRuntime` arguments, used without `workers`.

    Yields:
        The open `RemoteRuntime` or `LocalRuntime`; closed on exit.

    Raises:
        ValueError: `tls` without `workers`.
    """
    if workers:
        with RemoteRuntime(workers, tls=tls) as remote:
            yield remote
    else:
        if tls is not None:
            raise ValueError('TLS credentials apply to remote workers: give their addresses')
        with local_runtime(**local_kwargs) as local:
            yield local


class RemoteRuntime:
    """TFF `worker_binary`s someone else runs, at `host:port`, as the default context.

    The workers may be on other machines (see deploy/README.md for how to
    run one): each must be TFF 0.87's `worker_binary`, reachable from this
    machine; its `--max_concurrent_computation_calls` sets how many client
    computations it runs at once. With one worker the context is TFF's
    synchronous remote context. With several it is TFF's mergeable context:
    each computation's CLIENTS-placed arguments are split over the workers
    (as evenly as they divide), the workers run their clients up to the
    aggregation at the same time (`SyncContextInThread`), the partial
    aggregates are merged here, and the rest runs after the merge. Such
    computations may hold at most one aggregation stage and return nothing
    CLIENTS-placed that depends on work before it. Nothing
    is started or ended here; `close` puts the previous context back.

    With `tls`, every address is a worker's TLS front (nginx, deploy/README.md)
    and the driver speaks mutual TLS with it: it checks the front's
    certificate against `tls.ca` and presents its own. Without, the workers
    speak plain, unauthenticated gRPC: for loopback only.

    Attributes:
        addresses: the workers' `host:port`.
        calls: `WorkerCalls`, each worker's calls and busy seconds (with
            several workers; empty with one).
    """

    def __init__(self, addresses, *, ready_timeout: float = 10.0, tls: TlsCredentials | None = None):
        """Connects to the workers and installs them as TFF's default context.

        Args:
            addresses: `host:port` of each running worker (a string for one).
            ready_timeout: seconds to wait at most for each worker to answer.
            tls: the driver's mutual-TLS credentials (`TlsCredentials.from_files`);
                None: plain gRPC.

        Raises:
            ValueError: if an address is not `host:port`, or appears twice.
            RuntimeStartError: if a worker does not answer in `ready_timeout` s,
                or at once when its TLS handshake fails or its front refuses
                the driver's certificate.
        """
        addresses = (addresses,) if isinstance(addresses, str) else tuple(addresses)
        if not addresses:
            raise ValueError('no worker address given')
        for address in addresses:
            parse_worker_address(address)
        if len(set(addresses)) != len(addresses):
            raise ValueError(f'worker addresses repeat: {",".join(addresses)}')
        self.addresses = addresses
        self.address = addresses[0]
        self.tls = tls
        stubs = [
            worker_channel.WatchedStub(
                tff.framework.RemoteExecutorGrpcStub(worker_channel.open_channel(address, ready_timeout, tls)),
                f'at {address}',
            )
            for address in addresses
        ]
        self._threaded: list[SyncContextInThread] = []
        self.calls = WorkerCalls(len(stubs))
        if len(stubs) == 1:
            self.context = _execution_context(stubs[0])
        else:
            self._threaded = [
                SyncContextInThread(_execution_context(stub), i, self.calls) for i, stub in enumerate(stubs)
            ]
            self.context = tff.backends.native.create_mergeable_comp_execution_context(self._threaded)
        self._previous_context = tff.framework.get_context_stack().current
        tff.framework.set_default_context(self.context)
        _OPEN_RUNTIMES.append(self)

    def close(self) -> None:
        """Puts back the context that was there before, and ends the workers' threads; safe to call twice."""
        for threaded in self._threaded:
            threaded.close()
        previous, self._previous_context = self._previous_context, None
        if self in _OPEN_RUNTIMES:
            _OPEN_RUNTIMES.remove(self)
        if previous is not None:
            tff.framework.set_default_context(previous)

    def __enter__(self) -> 'RemoteRuntime':
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def end_process(process: subprocess.Popen, timeout: float = 5.0) -> None:
    """Ends a process we started (SIGTERM, then SIGKILL after `timeout` s) and reaps it.

    Args:
        process: the child process; nothing is sent if it already exited.
        timeout: seconds between SIGTERM and SIGKILL.
    """
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


class LocalRuntime:
    """A TFF `worker_binary` owned by this process, and a context that uses it.

    Attributes:
        pid: PID of the worker process (None once closed).
        port: the TCP port the worker serves on.
    """

    def __init__(
        self,
        *,
        max_concurrent_computation_calls: int = 2,
        log_path: str | None = None,
    ):
        """Starts a worker and installs it as TFF's default execution context.

        Args:
            max_concurrent_computation_calls: how many client computations the
                worker runs at once (-1: unlimited). 2 matches the 2-core machines
                this project is measured on and keeps worker memory low and flat.
            log_path: file that receives the worker's stdout and stderr; None
                discards them.

        Raises:
            RuntimeStartError: if the worker binary is missing or does not become
                ready within 60 seconds.
        """
        binary = worker_binary_path()
        if not os.path.isfile(binary):
            raise RuntimeStartError(f'TFF worker binary not found at {binary}')
        self.port = portpicker.pick_unused_port()
        self._log: IO[bytes] | None = open(log_path, 'ab') if log_path else None
        sink = self._log if self._log is not None else subprocess.DEVNULL
        self._process: subprocess.Popen | None = subprocess.Popen(
            _worker_command(self.port, max_concurrent_computation_calls),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            close_fds=True,
            env=_worker_env(),
        )
        self.pid: int | None = self._process.pid
        atexit.register(self.close)
        try:
            stub = _wait_until_ready(f'localhost:{self.port}', _READY_TIMEOUT_S, self._process)
        except BaseException:
            self.close()
            raise
        # A worker that dies mid-computation ends the computation (WorkerLostError) instead of
        # leaving TFF to retry it for ever.
        stub = worker_channel.WatchedStub(
            stub, f'(pid {self.pid}, log {log_path or "discarded"})', exit_code=self._process.poll
        )
        self.stub = stub  # for another context on the same worker (`async_execution_context`)
        self.context = _execution_context(stub)
        self._previous_context = tff.framework.get_context_stack().current
        tff.framework.set_default_context(self.context)
        _OPEN_RUNTIMES.append(self)

    @property
    def alive(self) -> bool:
        """Whether the worker process is still running."""
        return self._process is not None and self._process.poll() is None

    def close(self) -> None:
        """Ends the worker (SIGTERM, then SIGKILL after 5 s) and reaps it.

        Safe to call more than once.
        """
        process, self._process = self._process, None
        if process is not None:
            end_process(process)
            self.pid = None
            # Back to what was there before (nested runtimes close LIFO); None: the
            # worker failed to start, the context was never changed.
            previous = getattr(self, '_previous_context', None)
            if self in _OPEN_RUNTIMES:
                _OPEN_RUNTIMES.remove(self)
            if previous is not None:
                tff.framework.set_default_context(previous)
        if self._log is not None:
            self._log.close()
            self._log = None
        atexit.unregister(self.close)

    def __enter__(self) -> 'LocalRuntime':
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@contextlib.contextmanager
def local_runtime(**kwargs) -> Iterator[LocalRuntime]:
    """Context manager form of `LocalRuntime(**kwargs)`.

    Args:
        **kwargs: `LocalRuntime` arguments.

    Yields:
        The started `LocalRuntime`; closed on exit.
    """
    runtime = LocalRuntime(**kwargs)
    try:
        yield runtime
    finally:
        runtime.close()


def install_sigterm_handler() -> None:
    """Turns SIGTERM into `SystemExit(143)` so `finally`/`atexit` clean-up runs."""

    def _raise_exit(signum, frame):
        del frame
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _raise_exit)
