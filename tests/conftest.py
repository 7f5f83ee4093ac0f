"""Shared fixtures: one TFF worker for the whole session, tiny client data."""

import numpy as np
import pytest

from tff_pfl import runtime
from tff_pfl.data import client_data_writer

# A test that invokes a computation outside `tff_runtime` fails instead of starting TFF's own,
# never reaped worker (the library leaves that choice to its user: tff_pfl/runtime.py).
runtime.refuse_implicit_runtime()


@pytest.fixture(scope='session')
def tff_runtime():
    """A project-owned TFF worker, ended by PID when the session ends."""
    with runtime.local_runtime() as rt:
        yield rt


def make_linear_problem(root, num_clients=3, sizes=(37, 50, 23), dim=4, num_classes=3, seed=0, public_examples=0):
    """Writes a tiny linearly-generated classification problem; returns its spec.

    Each client's examples are split 1:1:1 into train, val and test;
    `public_examples` more examples, after the clients', are the unlabeled
    public data (KT-pFL, FedDF).
    """
    rng = np.random.default_rng(seed)
    total = sum(3 * n for n in sizes[:num_clients]) + public_examples
    x = rng.normal(size=(total, dim)).astype(np.float32)
    w = rng.normal(size=(dim, num_classes))
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    splits, start = [], 0
    for n in sizes[:num_clients]:
        idx = np.arange(start, start + 3 * n)
        splits.append({'train': idx[:n], 'val': idx[n : 2 * n], 'test': idx[2 * n :]})
        start += 3 * n
    public = np.arange(start, total) if public_examples else None
    return client_data_writer.write_client_data(str(root), x, y, num_classes, splits, public_indices=public)


@pytest.fixture(scope='session')
def tiny_npz(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp('npz') / 'tiny.npz'
    y_train = np.repeat(np.arange(4), 60).astype(np.uint8)
    y_test = np.repeat(np.arange(4), 20).astype(np.uint8)

    def images(y):
        x = rng.integers(0, 60, size=(len(y), 6, 6)).astype(np.uint8)
        x[np.arange(len(y)), y, y] = 255  # a class-specific bright pixel
        return x

    np.savez(path, x_train=images(y_train), y_train=y_train, x_test=images(y_test), y_test=y_test)
    return path


@pytest.fixture
def train_in_process(capsys):
    """Runs tff-pfl-train's flag parsing and `main` in this process (no interpreter start-up).

    Yields `run(*argv) -> (exit code, stderr)`; the network namespace is off.
    """
    from absl import flags as absl_flags

    from tff_pfl.cli import common, train

    def run(*argv):
        absl_flags.FLAGS.unparse_flags()
        capsys.readouterr()
        try:
            rest = common.flags_parser('tff-pfl-train')(['tff-pfl-train', *argv, '--noisolate_network'])
            train.main(rest)
        except SystemExit as exited:
            code = exited.code
        else:  # a run that finished: main returned
            code = 0
        return code, capsys.readouterr().err

    yield run
    absl_flags.FLAGS.unparse_flags()
