"""The local TFF worker's port: open to every process without isolation, closed to all of them with it."""

import csv
import os
import socket
import subprocess
import sys
import time

import pytest

from tff_pfl import netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import sys
from tff_pfl import runtime
try:
    runtime.check_worker(sys.argv[1], timeout=3)
    print('answers')
except runtime.RuntimeStartError:
    print('unreachable')
"""


def _probe(address):
    """Whether a TFF worker answers at `address`, asked from a second process."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    result = subprocess.run(
        [sys.executable, '-c', PROBE, address], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return result.stdout.strip().splitlines()[-1]


def _external_address():
    """This machine's address on its first non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(('192.0.2.1', 9))  # no packet is sent; picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith('127.') else address


def test_without_isolation_any_process_can_reach_the_worker(tff_runtime):
    assert _probe(f'127.0.0.1:{tff_runtime.port}') == 'answers'
    external = _external_address()
    if external is not None:  # it listens on every interface, not only loopback
        assert _probe(f'{external}:{tff_runtime.port}') == 'answers'


def _children(pid):
    with open(f'/proc/{pid}/task/{pid}/children') as f:
        return [int(p) for p in f.read().split()]


def _rows(path):
    try:
        with open(path) as f:
            return max(0, len(f.read().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def test_the_binary_runs_its_worker_in_a_private_network_namespace(tiny_npz, tmp_path):
    if not netns.namespaces_allowed():
        pytest.skip('this kernel does not allow unprivileged network namespaces')
    out = tmp_path / 'run'
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    train = subprocess.Popen(
        [
            sys.executable,
            '-m',
            'tff_pfl.cli.train',
            f'--dataset=npz:{tiny_npz}',
            '--partition=iid',
            '--num_clients=4',
            '--rounds=400',
            '--eval_every=0',
            '--batch_size=8',
            f'--output_dir={out}',
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        # A finished round (a row after the header) means the worker runs; the
        # CSV release manager creates the file itself before the worker starts.
        while not _rows(out / 'metrics.csv') and train.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert train.poll() is None, train.stderr.read()[-2000:]
        workers = [p for p in _children(train.pid) if 'worker_binary' in open(f'/proc/{p}/cmdline').read()]
        assert len(workers) == 1
        worker = workers[0]
        port = [a for a in open(f'/proc/{worker}/cmdline').read().split('\0') if a.startswith('--port=')][0][7:]
        assert os.readlink(f'/proc/{worker}/ns/net') != os.readlink('/proc/self/ns/net')
        assert os.readlink(f'/proc/{worker}/ns/net') == os.readlink(f'/proc/{train.pid}/ns/net')
        assert _probe(f'127.0.0.1:{port}') == 'unreachable'
    finally:
        train.terminate()
        train.wait(timeout=60)
    rows = list(csv.DictReader(open(out / 'metrics.csv')))
    assert rows  # it was training while it was probed
