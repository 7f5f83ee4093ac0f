"""Shared fixtures: one TFF worker for the whole session, tiny client data."""

import numpy as np
import pytest

from tff_pfl import runtime
from tff_pfl.data import client_data


@pytest.fixture(scope='session')
def tff_runtime():
    """A project-owned TFF worker, ended by PID when the session ends."""
    with runtime.local_runtime() as rt:
        yield rt


def make_linear_problem(root, num_clients=3, sizes=(37, 50, 23), dim=4, num_classes=3, seed=0):
    """Writes a tiny linearly-generated classification problem; returns its spec."""
    rng = np.random.default_rng(seed)
    total = sum(3 * n for n in sizes[:num_clients])
    x = rng.normal(size=(total, dim)).astype(np.float32)
    w = rng.normal(size=(dim, num_classes))
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    splits, start = [], 0
    for n in sizes[:num_clients]:
        idx = np.arange(start, start + 3 * n)
        splits.append({'train': idx[:n], 'val': idx[n : 2 * n], 'test': idx[2 * n :]})
        start += 3 * n
    return client_data.write_client_data(str(root), x, y, num_classes, splits)
