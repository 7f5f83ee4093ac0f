"""A run directory's CSVs, for the benchmarks that compare runs made different ways.

`workers_mnist.py`, `workers_scaling.py` and `worker_tls.py` run the same job on
different runtimes and check that the numbers agree: every cell of
metrics.csv and clients.csv but the timing columns.
"""

import csv
import os

# Columns that measure time, not results: left out of every comparison.
TIMING = frozenset({'round_seconds', 'personalize_seconds'})


def rows(path):
    """The rows of a CSV as dicts of strings, timing columns left out.

    Args:
      path: a CSV file with a header.

    Returns:
      A list of dicts, one per row.
    """
    with open(path, newline='') as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def max_relative_difference(rows_, reference):
    """Largest |a - b| / |b| over the cells of two CSVs' rows of the same shape (0: all identical).

    Args:
      rows_: `rows` of one run.
      reference: `rows` of the run compared with.

    Returns:
      The largest relative difference of a cell (cells that are equal as text count 0).
    """
    assert len(rows_) == len(reference)
    worst = 0.0
    for row, ref in zip(rows_, reference):
        assert row.keys() == ref.keys()
        for key, value in ref.items():
            if value != row[key]:
                worst = max(worst, abs(float(row[key]) - float(value)) / max(abs(float(value)), 1e-12))
    return worst


def round_seconds(out):
    """Each round's seconds, from a run directory's metrics.csv.

    Args:
      out: the run's output directory.

    Returns:
      A list of floats, one per round.
    """
    with open(os.path.join(out, 'metrics.csv'), newline='') as f:
        return [float(row['round_seconds']) for row in csv.DictReader(f)]


def run_files(out):
    """`rows` of a run directory's metrics.csv and clients.csv.

    Args:
      out: the run's output directory.

    Returns:
      `(metrics rows, clients rows)`.
    """
    return rows(os.path.join(out, 'metrics.csv')), rows(os.path.join(out, 'clients.csv'))
