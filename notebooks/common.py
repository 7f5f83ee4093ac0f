"""Paths and small readers shared by the notebooks in this directory.

`RUNS` is where the notebooks write their runs (`TFF_PFL_RUNS`, default
`<repo>/runs/notebooks`). `MNIST` is an `.npz` in Keras layout (`x_train`,
`y_train`, `x_test`, `y_test`): `TFF_PFL_MNIST` if set, else
`<repo>/../shared/data/mnist.npz`, else a copy fetched once through
`tf.keras.datasets.mnist` into `RUNS`. `shakespeare_cache()` is a directory
holding TFF's `shakespeare.sqlite`: `TFF_PFL_TFF_CACHE` if set, else
`<repo>/../shared/data/tff`, else TFF's default cache `~/.tff`, where TFF's
loader downloads it the first time.
"""

import csv
import os
import pathlib

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
RUNS = pathlib.Path(os.environ.get('TFF_PFL_RUNS', REPO / 'runs' / 'notebooks'))


def mnist_npz() -> pathlib.Path:
    """Returns the path of MNIST as an `.npz`, fetching it once if needed.

    Returns:
      `TFF_PFL_MNIST`, or `<repo>/../shared/data/mnist.npz` when it exists, or
      `RUNS/mnist.npz`, written from `tf.keras.datasets.mnist` (which needs the
      network) the first time.
    """
    if 'TFF_PFL_MNIST' in os.environ:
        return pathlib.Path(os.environ['TFF_PFL_MNIST'])
    shared = REPO.parent / 'shared' / 'data' / 'mnist.npz'
    if shared.exists():
        return shared
    fetched = RUNS / 'mnist.npz'
    if not fetched.exists():
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        (x_train, y_train), (x_test, y_test) = tf.keras.datasets.mnist.load_data()
        fetched.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(fetched, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return fetched


def shakespeare_cache() -> pathlib.Path:
    """Returns a directory for TFF's Shakespeare loader (`cache_dir`), downloading the file once if needed.

    Returns:
      `TFF_PFL_TFF_CACHE`, or `<repo>/../shared/data/tff` when it holds
      `shakespeare.sqlite`, or `~/.tff` (TFF's loader fetches the file there,
      which needs the network, the first time).
    """
    if 'TFF_PFL_TFF_CACHE' in os.environ:
        return pathlib.Path(os.environ['TFF_PFL_TFF_CACHE'])
    shared = REPO.parent / 'shared' / 'data' / 'tff'
    if (shared / 'shakespeare.sqlite').exists():
        return shared
    cache = pathlib.Path.home() / '.tff'
    if not (cache / 'shakespeare.sqlite').exists():
        import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

        tff.simulation.datasets.shakespeare.load_data(cache_dir=str(cache))
    return cache


def read_csv(path) -> list[dict]:
    """Reads a CSV the runs write (metrics.csv, clients.csv, ...).

    Args:
      path: the file.

    Returns:
      One dict per row; cells that parse as numbers are floats, empty cells None.
    """

    def cell(value):
        if value == '':
            return None
        try:
            return float(value)
        except ValueError:
            return value

    with open(path, newline='') as f:
        return [{k: cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def client_matrix(path) -> tuple[list[str], np.ndarray]:
    """Reads a clients x clients CSV (first column `client_id`) as a matrix.

    Args:
      path: e.g. `knowledge_coefficients.csv` or `collaboration_graph.csv`.

    Returns:
      `(client_ids, matrix)`, the matrix `[N, N]` float.
    """
    rows = read_csv(path)
    ids = [r['client_id'] for r in rows]
    return ids, np.array([[v for k, v in r.items() if k != 'client_id'] for r in rows], dtype=float)
