"""How the driver talks to a TFF worker: gRPC channels (plain or mutual TLS) and a stub that notices a lost worker.

`open_channel` dials a worker and waits until it answers; `TlsCredentials`
are the driver's side of mutual TLS with a worker's TLS front;
`WatchedStub` wraps TFF's gRPC stub so that a worker that died (or stopped
answering) ends the computation with `WorkerLostError`, where TFF 0.87
would retry the call for ever (its execution context retries every
UNAVAILABLE, at most 30 s apart, with no limit). `tff_pfl.runtime` builds
its contexts on these.
"""

import dataclasses
import signal
import time
from collections.abc import Callable

import grpc
import tensorflow_federated as tff

_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
GRPC_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_BYTES),
]


class RuntimeStartError(RuntimeError):
    """The TFF worker could not be started."""


class WorkerLostError(RuntimeError):
    """The TFF worker a computation ran on died, or stopped answering, during the computation."""


class TlsFileError(ValueError):
    """A TLS file that cannot be used; `which` is 'ca', 'cert' or 'key'."""

    def __init__(self, which: str, path: str, reason: str):
        """Names the file and what is wrong with it.

        Args:
            which: 'ca', 'cert' or 'key': the `TlsCredentials.from_files` argument.
            path: the file's path.
            reason: what is wrong, without the path.
        """
        super().__init__(f'{which} {path} {reason}')
        self.which, self.path, self.reason = which, path, reason


def _read_pem(which: str, path: str, markers: tuple[bytes, ...], what: str) -> bytes:
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as e:
        raise TlsFileError(which, path, f'cannot be read: {e.strerror.lower()}') from None
    if not any(marker in data for marker in markers):
        raise TlsFileError(which, path, f'is not {what} in PEM form')
    return data


@dataclasses.dataclass(frozen=True)
class TlsCredentials:
    """Mutual TLS with remote workers' TLS fronts: the driver's side, as PEM bytes.

    The driver checks the front's certificate against `ca` (and that it names
    the host it dials) and presents `cert` with its `key`; the front (nginx,
    deploy/README.md) admits only a client certificate signed by the CA it
    trusts. Build it with `from_files`.

    Attributes:
        ca: the CA certificate(s) that signed the workers' certificates.
        cert: the driver's client certificate (chain).
        key: the driver's private key, unencrypted (not shown by `repr`).
    """

    ca: bytes
    cert: bytes
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def from_files(cls, ca: str, cert: str, key: str) -> 'TlsCredentials':
        """Reads and checks the three PEM files.

        Args:
            ca: path of the CA certificate that signed the workers' certificates.
            cert: path of the driver's client certificate.
            key: path of the driver's private key (unencrypted: gRPC takes no
                passphrase).

        Returns:
            The credentials.

        Raises:
            TlsFileError: a file that cannot be read, is not PEM of its kind,
                or a key that does not match the certificate (or is encrypted).
        """
        import ssl

        credentials = cls(
            ca=_read_pem('ca', ca, (b'-----BEGIN CERTIFICATE-----',), 'a certificate'),
            cert=_read_pem('cert', cert, (b'-----BEGIN CERTIFICATE-----',), 'a certificate'),
            key=_read_pem('key', key, (b'PRIVATE KEY-----',), 'a private key'),
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            context.load_verify_locations(cadata=credentials.ca.decode('ascii', 'replace'))
        except ssl.SSLError as e:
            raise TlsFileError('ca', ca, f'is not a readable certificate ({e.reason or e})') from None
        try:
            context.load_cert_chain(cert, key, password=lambda: b'')
        except ssl.SSLError as e:
            raise TlsFileError(
                'key', key, f'does not match the certificate {cert}, or is encrypted ({e.reason or e})'
            ) from None
        return credentials

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC's credentials for a channel to a TLS front.

        Returns:
            `grpc.ssl_channel_credentials` of the CA, the key and the certificate.
        """
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


# A method no server implements: a gRPC server (the worker) answers it at once with UNIMPLEMENTED,
# without running anything; a front that refuses the driver answers with its reason.
_PROBE_METHOD = '/tff_pfl.Probe/Ready'
_PROBE_CALL_TIMEOUT_S = 2.0


def _handshake_failure(details: str) -> str:
    """The TLS part of gRPC's connection error (from 'Ssl handshake failed'), or ''."""
    index = details.lower().find('handshake failed')
    if index < 0:
        return ''
    start = details.rfind(': ', 0, index)
    return details[start + 2 if start >= 0 else index :]


def open_channel(address: str, timeout: float, tls: TlsCredentials | None) -> grpc.Channel:
    """A channel to a worker someone else runs at `address` (over TLS with `tls`), once it answers.

    One call to a method no server has, repeated until it is answered or
    `timeout` passes: the worker answers UNIMPLEMENTED, and runs nothing. A
    front that refuses the driver, or a failed TLS handshake, fails at once
    with gRPC's reason; a port that refuses connections is tried again.

    Args:
        address: `host:port` of the worker (of its TLS front with `tls`).
        timeout: seconds to wait at most for it to answer.
        tls: the driver's mutual-TLS credentials; None: plain gRPC.

    Returns:
        The open channel.

    Raises:
        RuntimeStartError: with one line naming `address` and why.
    """
    if tls is None:
        channel = grpc.insecure_channel(address, GRPC_OPTIONS)
    else:
        channel = grpc.secure_channel(address, tls.channel_credentials(), GRPC_OPTIONS)
    probe = channel.unary_unary(_PROBE_METHOD, request_serializer=bytes, response_deserializer=bytes)
    deadline = time.monotonic() + timeout
    last = ''
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            channel.close()
            if tls is None:
                raise RuntimeStartError(f'no TFF worker answers at {address} (waited {timeout:g} s)')
            raise RuntimeStartError(f'no TLS worker answers at {address} (waited {timeout:g} s): {last}')
        try:
            probe(b'', timeout=min(remaining, _PROBE_CALL_TIMEOUT_S), wait_for_ready=False)
            break
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ''
        if code == grpc.StatusCode.UNIMPLEMENTED:
            break
        problem = None
        handshake = _handshake_failure(details)
        if handshake:
            problem = f'{address}: the TLS handshake failed: {handshake}'
        elif 'http1.x server' in details:
            problem = (
                f"{address} does not speak plain gRPC (it answers HTTP/1.x): a TLS front? give the driver's "
                'TLS credentials (RemoteRuntime(tls=...); --worker_tls_ca, --worker_tls_cert and --worker_tls_key)'
            )
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            problem = f'{address} refused the driver ({code.name}): {details}'
        elif code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            problem = f'{address} does not answer as a TFF worker ({code.name}): {details}'
        if problem is not None:
            channel.close()
            raise RuntimeStartError(problem)
        last = details
        time.sleep(0.05)
    return channel


# How long a worker may refuse connections before a computation gives up on it. A local worker
# that exited is given up on at once; this bounds a remote worker's restart (or a network cut).
LOST_AFTER_S = 300.0


def exit_description(returncode: int) -> str:
    """'was killed by SIGSEGV' / 'exited with code 3', from `Popen.returncode`.

    Args:
        returncode: the process's return code (negative: the signal that ended it).

    Returns:
        The phrase.
    """
    if returncode < 0:
        try:
            return f'was killed by {signal.Signals(-returncode).name}'
        except ValueError:
            return f'was killed by signal {-returncode}'
    return f'exited with code {returncode}'


def _dispatch(method: str, *, watched: bool = True):
    """A `WatchedStub` method that dispatches TFF's stub's `method`.

    Watched: through `WatchedStub._call` (`WorkerLostError` once the worker is
    gone). Not watched (`dispose_executor`): straight through, since TFF
    ignores its failures (a lost worker holds nothing to free).
    """

    def call(self, request):
        return self._call(method, request) if watched else getattr(self._stub, method)(request)

    call.__name__ = method
    call.__doc__ = f'Dispatches {method}' + (' (`WorkerLostError` once the worker is gone).' if watched else '.')
    return call


class WatchedStub(tff.framework.RemoteExecutorStub):
    """TFF's gRPC stub of one worker, raising `WorkerLostError` once the worker is gone.

    TFF 0.87 marks UNAVAILABLE as retryable and its execution context retries
    the whole computation without end, so a worker that crashed (a
    segmentation fault, the kernel's OOM killer) left the driver waiting
    for ever, its checkpoints untouched but the run never ending. Each call
    here that fails as retryable asks whether the worker is gone: a local
    worker whose process exited is, at once; any worker that has refused
    every call for `lost_after` seconds is. Then the call raises
    `WorkerLostError` (not retryable), which ends the computation. A
    successful call resets the clock.
    """

    def __init__(
        self,
        stub,
        name: str,
        *,
        exit_code: Callable[[], int | None] | None = None,
        lost_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Wraps `stub`.

        Args:
            stub: the worker's `tff.framework.RemoteExecutorGrpcStub`.
            name: how messages name the worker ('at localhost:1234', '(pid 42)').
            exit_code: for a worker this process started: returns its exit
                code once it exited, else None.
            lost_after: seconds of failed calls after which the worker counts
                as lost; None: `LOST_AFTER_S`.
            clock: seconds, monotonic (tests pass their own).
        """
        self._stub = stub
        self._name = name
        self._exit_code = exit_code
        self._lost_after = LOST_AFTER_S if lost_after is None else lost_after
        self._clock = clock
        self._failing_since: float | None = None

    def _call(self, method: str, request):
        try:
            response = getattr(self._stub, method)(request)
        except tff.framework.RetryableError:
            self._check_lost()
            raise
        self._failing_since = None
        return response

    def _check_lost(self) -> None:
        code = self._exit_code() if self._exit_code is not None else None
        if code is not None:
            raise WorkerLostError(f'the TFF worker {self._name} {exit_description(code)} during a computation')
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._failing_since >= self._lost_after:
            raise WorkerLostError(
                f'the TFF worker {self._name} has refused every call for {now - self._failing_since:.0f} s'
            )

    get_executor = _dispatch('get_executor')
    create_value = _dispatch('create_value')
    create_struct = _dispatch('create_struct')
    create_call = _dispatch('create_call')
    create_selection = _dispatch('create_selection')
    compute = _dispatch('compute')

    dispose_executor = _dispatch('dispose_executor', watched=False)

    def dispose(self, request):
        """Dispatches Dispose; a worker out of reach is not an error here (returns None).

        TFF sends value disposals from `weakref.finalize` callbacks, which run
        whenever the collector frees a value, on no caller's stack: one that
        raised there printed a traceback on stderr before the run's one-line
        error. The values it would free live in the worker that is out of reach.
        Other failures pass through.

        Args:
          request: The `DisposeRequest` to send.

        Returns:
          The worker's response, or None when the worker is out of reach.
        """
        try:
            return self._stub.dispose(request)
        except tff.framework.RetryableError:
            return None

    @property
    def is_ready(self) -> bool:
        """True if the gRPC connection is ready."""
        return self._stub.is_ready
