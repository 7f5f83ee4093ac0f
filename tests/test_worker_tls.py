"""Mutual TLS between the driver and a remote TFF worker behind its nginx front (deploy/tls/).

A `worker_binary` and nginx, configured from deploy/tls/nginx-worker.conf with certificates made
by deploy/tls/make-certs.sh, run here as unprivileged processes from a temporary directory and
are ended by PID. A run through the front gives the local runtime's numbers; a driver the front
does not trust, or a front the driver's CA did not sign, is refused before anything is written,
and the front's access log shows that no call reached the worker.
"""

import csv
import os
import shutil
import subprocess
import sys
import time

import portpicker
import pytest

from tff_pfl import runtime
from tff_pfl.program import config_parts, experiment, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE_CERTS = os.path.join(REPO, 'deploy', 'tls', 'make-certs.sh')
NGINX_TEMPLATE = os.path.join(REPO, 'deploy', 'tls', 'nginx-worker.conf')
TIMING = {'round_seconds', 'personalize_seconds'}


def _nginx() -> str:
    nginx = shutil.which('nginx') or next((p for p in ('/usr/sbin/nginx',) if os.access(p, os.X_OK)), None)
    if nginx is None:
        pytest.fail('nginx is not installed: apt-get install nginx-light (.ci/run installs it)')
    return nginx


@pytest.fixture(scope='module')
def certs(tmp_path_factory):
    """Two CAs, each with a driver certificate and one for a worker named localhost and 127.0.0.1."""
    root = tmp_path_factory.mktemp('certs')
    for name in ('ours', 'other'):
        subprocess.run([MAKE_CERTS, str(root / name), 'localhost,127.0.0.1'], check=True, capture_output=True)
    return root


def _files(root, ca='ours', client='ours'):
    """Flat settings of the driver's TLS files: the CA of `ca`, the driver certificate of `client`."""
    return dict(
        worker_tls_ca=str(root / ca / 'ca.pem'),
        worker_tls_cert=str(root / client / 'driver.pem'),
        worker_tls_key=str(root / client / 'driver.key'),
    )


class Front:
    """A worker_binary on a plain port and its nginx mTLS front, as deploy/tls/ describes them."""

    def __init__(self, directory, certs):
        self.directory = directory
        worker_port, tls_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
        self.address = f'localhost:{tls_port}'
        self.worker_address = f'localhost:{worker_port}'
        self.access_log = directory / 'access.log'
        os.makedirs(directory / 'tls')
        for name in ('worker.pem', 'worker.key', 'ca.pem'):
            shutil.copy(certs / 'ours' / 'localhost' / name, directory / 'tls' / name)
        with open(NGINX_TEMPLATE) as f:
            conf = f.read().replace('@TLS_PORT@', str(tls_port)).replace('@WORKER_PORT@', str(worker_port))
        (directory / 'nginx.conf').write_text(conf)
        self._logs = [open(directory / 'worker.log', 'wb'), open(directory / 'nginx.log', 'wb')]
        self.worker = subprocess.Popen(
            runtime._worker_command(worker_port, 2), stdout=self._logs[0], stderr=subprocess.STDOUT
        )
        # In the foreground (the template says `daemon off`), as an unprivileged service would run it.
        self.nginx = subprocess.Popen(
            [_nginx(), '-p', f'{directory}/', '-c', str(directory / 'nginx.conf'), '-e', 'stderr'],
            stdout=self._logs[1],
            stderr=subprocess.STDOUT,
        )

    def log_lines(self) -> list[str]:
        """The front's access log: one line per gRPC call it received."""
        return self.access_log.read_text().splitlines() if self.access_log.exists() else []

    def calls_since(self, before: list[str]) -> list[str]:
        """The access log's lines after `before`, once it has held still for 0.5 s.

        nginx writes a call's line after it has answered it.
        """
        lines, still_since, deadline = self.log_lines(), time.monotonic(), time.monotonic() + 5
        while time.monotonic() - still_since < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.log_lines()
            if now != lines:
                lines, still_since = now, time.monotonic()
        return lines[len(before) :]

    def close(self):
        for process in (self.nginx, self.worker):
            runtime.end_process(process)
        for log in self._logs:
            log.close()
        assert self.nginx.poll() is not None and self.worker.poll() is not None


@pytest.fixture(scope='module')
def front(tmp_path_factory, certs):
    """The worker and its front, up; ended by PID when the module's tests are done."""
    front = Front(tmp_path_factory.mktemp('front'), certs)
    try:
        tls = runtime.TlsCredentials.from_files(*_files(certs).values())
        deadline = time.monotonic() + 60
        while True:
            processes = {'nginx': front.nginx, 'worker_binary': front.worker}
            exited = [f'{name} exited with {p.returncode}' for name, p in processes.items() if p.poll() is not None]
            try:
                if exited:
                    raise runtime.RuntimeStartError(', '.join(exited))
                runtime.check_worker(front.address, timeout=2, tls=tls)
                break
            except runtime.RuntimeStartError as e:
                if exited or time.monotonic() > deadline:
                    logs = {name: (front.directory / name).read_text()[-2000:] for name in ('nginx.log', 'worker.log')}
                    pytest.fail(f'the worker behind nginx did not come up: {e}; {logs}')
        yield front
    finally:
        front.close()


def _rows(path):
    with open(path, newline='') as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _config(out, **kwargs):
    """FedAvg, 2 rounds on 5 synthetic clients, as tests/test_remote_worker.py runs it."""
    return run_config.make_config(
        output_dir=str(out), algorithm='fedavg', dataset='synthetic', num_clients=5, rounds=2, eval_every=1, **kwargs
    )


def test_a_run_through_the_mutual_tls_front_gives_the_local_runtimes_numbers(front, certs, tmp_path):
    experiment.run_experiment(_config(tmp_path / 'local'), log=lambda line: None)
    before = front.log_lines()
    config = _config(tmp_path / 'tls', workers=(front.address,), **_files(certs))
    experiment.run_experiment(config, log=lambda line: None)
    for name in ('metrics.csv', 'clients.csv'):
        assert _rows(tmp_path / 'tls' / name) == _rows(tmp_path / 'local' / name)
    assert not os.path.exists(tmp_path / 'tls' / 'worker.log')  # no local worker ran
    # The rounds' calls went through the front, from the driver's certificate, to the worker.
    calls = front.calls_since(before)
    assert len(calls) > 10
    assert all('client_verify=SUCCESS client="CN=tff-pfl-driver"' in line for line in calls)
    assert all(f'upstream=127.0.0.1:{front.worker_address.split(":")[1]}' in line for line in calls)
    assert any('/tensorflow_federated.v0.ExecutorGroup/Compute' in line for line in calls)


def _no_client_certificate(monkeypatch, certs):
    """The driver dials with gRPC's TLS credentials but no client certificate."""
    credentials = runtime.TlsCredentials(ca=(certs / 'ours' / 'ca.pem').read_bytes(), cert=None, key=None)
    monkeypatch.setattr(config_parts.RuntimeConfig, 'worker_tls', lambda self: credentials)


# How the driver dials the front -> the one line tff-pfl-train prints (after "--workers: ADDRESS"),
# and the front's verdict on the driver's certificate in its access log (None: no call was logged:
# plain HTTP/2 is no call, and the driver ends a handshake whose certificate it refuses).
REFUSED = {
    'no TLS: plain gRPC': (
        None,
        r' does not speak plain gRPC \(it answers HTTP/1.x\): a TLS front\? give the driver\'s TLS credentials '
        r'\(RemoteRuntime\(tls=...\); --worker_tls_ca',
        None,
    ),
    'TLS, no client certificate': (
        'no_certificate',
        r' refused the driver \(UNAUTHENTICATED\): no client certificate was sent$',
        'client_verify=NONE',
    ),
    'a client certificate of another CA': (
        dict(ca='ours', client='other'),
        r' refused the driver \(UNAUTHENTICATED\): the client certificate is not signed by the CA this front '
        r'trusts \(FAILED:unable to verify the first certificate\)$',
        'client_verify=FAILED:unable to verify the first certificate',
    ),
    "a CA that did not sign the front's certificate": (
        dict(ca='other', client='ours'),
        r'^: the TLS handshake failed: Ssl handshake failed \(TSI_PROTOCOL_FAILURE\): .*CERTIFICATE_VERIFY_FAILED',
        None,
    ),
}


@pytest.mark.parametrize('driver', list(REFUSED))
def test_a_driver_and_front_that_do_not_trust_each_other_are_refused_before_anything_is_written(
    driver, front, certs, tmp_path, train_in_process, monkeypatch
):
    import re

    tls, pattern, verdict = REFUSED[driver]
    flags = []
    if tls == 'no_certificate':
        _no_client_certificate(monkeypatch, certs)
        tls = {}
    if tls is not None:
        flags = [f'--{name}={path}' for name, path in _files(certs, **tls).items()]
    before = front.log_lines()
    out = tmp_path / 'out'
    start = time.monotonic()
    code, err = train_in_process(
        '--algorithm=fedavg',
        '--num_clients=5',
        '--rounds=2',
        f'--workers={front.address}',
        *flags,
        f'--output_dir={out}',
    )
    elapsed = time.monotonic() - start
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    prefix = f'tff-pfl-train: error: --workers: {front.address}'
    assert lines[0].startswith(prefix), lines[0]
    assert re.search(pattern, lines[0][len(prefix) :]), lines[0]
    assert elapsed < 10  # refused at once, not after the 10 s a silent worker is waited for
    assert not os.path.exists(out)
    assert not [p for p in os.listdir(tmp_path) if p != 'out']  # no staging directory either
    # The worker ran nothing: no call the front received since was passed to it.
    calls = front.calls_since(before)
    assert all('upstream=- ' in line for line in calls), calls
    if verdict is None:
        assert not [line for line in calls if 'client_verify=' in line and 'client_verify=- ' not in line], calls
    else:  # the front answered the call itself: refused, with the reason
        assert calls and all(f' 204 {verdict} ' in line for line in calls), calls
    # And the front still serves a driver it trusts.
    runtime.check_worker(front.address, tls=runtime.TlsCredentials.from_files(*_files(certs).values()))


def test_the_binary_prints_one_line_when_the_tls_handshake_fails(front, certs, tmp_path):
    """gRPC's and TensorFlow's own logs (of the failed handshake, of start-up) stay out of the binary's stderr."""
    # The binary's defaults, as in a user's shell.
    env = {k: v for k, v in os.environ.items() if k not in ('TF_CPP_MIN_LOG_LEVEL', 'GRPC_VERBOSITY')}
    env['PYTHONPATH'] = REPO
    flags = [f'--{name}={path}' for name, path in _files(certs, ca='other').items()]
    result = subprocess.run(
        [sys.executable, '-m', 'tff_pfl.cli.train', f'--workers={front.address}', *flags, '--rounds=1']
        + [f'--output_dir={tmp_path / "out"}'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f'tff-pfl-train: error: --workers: {front.address}: the TLS handshake failed: ')
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert not os.path.exists(tmp_path / 'out')


@pytest.mark.parametrize(
    'values, message',
    [
        (
            dict(workers=('a:1',), worker_tls_ca='ca.pem', worker_tls_cert='driver.pem'),
            '--worker_tls_ca, --worker_tls_cert and --worker_tls_key go together: --worker_tls_ca, '
            '--worker_tls_cert given without --worker_tls_key$',
        ),
        (
            dict(worker_tls_key='driver.key'),
            '--worker_tls_ca, --worker_tls_cert and --worker_tls_key go together: --worker_tls_key given '
            'without --worker_tls_ca and --worker_tls_cert$',
        ),
        ('all three, no workers', '--worker_tls_ca, --worker_tls_cert and --worker_tls_key apply to remote workers: '),
        ('missing key', '--worker_tls_key .*/missing.key cannot be read: no such file or directory$'),
        ('cert is not PEM', '--worker_tls_cert .*/driver.key is not a certificate in PEM form$'),
        ('key of another certificate', '--worker_tls_key .*/other/driver.key does not match the certificate .*'),
    ],
)
def test_tls_settings_that_cannot_run_are_refused_in_one_line(values, message, certs):
    files = _files(certs)
    if values == 'all three, no workers':
        values = files
    elif values == 'missing key':
        values = dict(files, workers=('a:1',), worker_tls_key=str(certs / 'missing.key'))
    elif values == 'cert is not PEM':
        values = dict(files, workers=('a:1',), worker_tls_cert=files['worker_tls_key'])
    elif values == 'key of another certificate':
        values = dict(files, workers=('a:1',), worker_tls_key=str(certs / 'other' / 'driver.key'))
    with pytest.raises(run_config.ConfigError, match=f'^{message}') as refused:
        run_config.make_config(output_dir='x', **values).validate()
    assert '\n' not in str(refused.value)


def test_the_cli_refuses_tls_settings_without_workers(certs, tmp_path, train_in_process):
    flags = [f'--{name}={path}' for name, path in _files(certs).items()]
    code, err = train_in_process(*flags, f'--output_dir={tmp_path / "out"}')
    assert (code, err.strip().splitlines()) == (
        2,
        [
            'tff-pfl-train: error: --worker_tls_ca, --worker_tls_cert and --worker_tls_key apply to remote workers: '
            'give --workers'
        ],
    )
    assert not os.path.exists(tmp_path / 'out')


def test_tls_files_are_where_a_run_executes_so_a_resumed_run_may_change_them(certs):
    saved = _config('x', workers=('a:1',)).to_dict()
    assert experiment._changed_fields(saved, _config('x', workers=('a:1',), **_files(certs))) == []
    assert 'key' not in repr(runtime.TlsCredentials.from_files(*_files(certs).values())).split('cert=')[-1]


@pytest.fixture(scope='module')
def fedavg_export(tmp_path_factory):
    """FedAvg on 4 synthetic clients, exported (docs/export.md)."""
    from tff_pfl.program import export

    out = tmp_path_factory.mktemp('export') / 'fedavg'
    config = run_config.make_config(output_dir=str(out), algorithm='fedavg', dataset='synthetic', num_clients=4)
    export.export(config, log=lambda line: None)
    return str(out)


def _loader(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    command = [sys.executable, '-m', 'deploy.loader', *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


def test_the_loader_runs_an_export_through_the_front_as_on_a_local_worker(front, certs, fedavg_export, tmp_path):
    local = _loader(f'--export_dir={fedavg_export}', f'--state_dir={tmp_path / "local"}', '--rounds=2')
    assert local.returncode == 0, local.stderr
    before = front.log_lines()
    flags = [f'--{name}={path}' for name, path in _files(certs).items()]
    tls = _loader(
        f'--export_dir={fedavg_export}',
        f'--state_dir={tmp_path / "tls"}',
        '--rounds=2',
        f'--workers={front.address}',
        *flags,
    )
    assert tls.returncode == 0, tls.stderr
    # The rounds' metrics (each line without its seconds) and every device's state file are equal.
    assert [line.rsplit(None, 1)[0] for line in tls.stdout.splitlines()] == [
        line.rsplit(None, 1)[0] for line in local.stdout.splitlines()
    ]
    states = sorted(os.listdir(tmp_path / 'local'))
    assert states and sorted(os.listdir(tmp_path / 'tls')) == states
    for name in states:
        assert (tmp_path / 'tls' / name).read_bytes() == (tmp_path / 'local' / name).read_bytes(), name
    calls = front.calls_since(before)
    assert any('/tensorflow_federated.v0.ExecutorGroup/Compute' in line for line in calls)
    assert all('client_verify=SUCCESS client="CN=tff-pfl-driver"' in line for line in calls)


def test_the_loader_refuses_a_driver_the_front_does_not_trust_in_one_line(front, certs, fedavg_export, tmp_path):
    before = front.log_lines()
    flags = [f'--{name}={path}' for name, path in _files(certs, ca='ours', client='other').items()]
    state_dir = tmp_path / 'states'
    result = _loader(f'--export_dir={fedavg_export}', f'--state_dir={state_dir}', f'--workers={front.address}', *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f'deploy.loader: error: --workers: {front.address} refused the driver (UNAUTHENTICATED)')
    assert not state_dir.exists()
    assert all('upstream=- ' in line for line in front.calls_since(before))  # the worker ran nothing


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--worker_tls_ca=x.pem'], '--worker_tls_ca, --worker_tls_cert and --worker_tls_key go together'),
        (
            ['--worker_tls_ca=a', '--worker_tls_cert=b', '--worker_tls_key=c'],
            'TLS is for remote workers; give --workers',
        ),
    ],
)
def test_the_loader_refuses_tls_flags_that_cannot_apply(flags, message, tmp_path):
    result = _loader('--export_dir=/nonexistent', f'--state_dir={tmp_path / "s"}', *flags)
    assert result.returncode == 2
    assert message in result.stderr and not (tmp_path / 's').exists()


def test_the_loader_names_an_unreadable_tls_file(certs, tmp_path):
    files = _files(certs)
    files['worker_tls_key'] = str(tmp_path / 'missing.key')
    flags = [f'--{name}={path}' for name, path in files.items()]
    result = _loader('--export_dir=/nonexistent', f'--state_dir={tmp_path / "s"}', '--workers=localhost:1', *flags)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('deploy.loader: error: --worker_tls_key: '), result.stderr
