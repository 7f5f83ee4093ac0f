"""The files of a benchmark's output and results directories, and the lock that guards them.

`bench_run` writes them and `bench_report` reads them; both take the names
from here, so neither imports the other to find a file.
"""

import contextlib
import fcntl
import os

from tff_pfl_bench import bench_suite

RESULT_FILE = 'bench_result.json'
SUITE_FILE = 'suite.toml'
COMMANDS_FILE = 'commands.txt'
RECORDS_DIR = 'records'
# What `bench_run.publish_results` copies besides the records (and the report's plots).
ARCHITECTURES_FILE = 'architectures.csv'  # heterogeneous suites only: accuracy by client architecture
PUBLISHED_FILES = ('report.md', 'results.csv', 'summary.csv', ARCHITECTURES_FILE, SUITE_FILE, COMMANDS_FILE)
# ... and, for a suite with [tuning], every trial's validation scores and each tuned algorithm's choice (`tuning`).
TUNING_CSV = 'tuning.csv'
TUNING_JSON = 'tuning.json'
TUNING_FILES = (TUNING_CSV, TUNING_JSON)
TRIALS_DIR = 'trials'  # a tuned algorithm's trials: runs/<partition>/<algorithm>/trials/<slug>/, and their records


@contextlib.contextmanager
def locked(path: str):
    """An exclusive `flock` on `path` (created if needed), released on exit.

    Args:
      path: the lock file, e.g. `<output_dir>/.lock`.

    Yields:
      None, with the lock held.
    """
    with open(path, 'a') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def file_text(path: str) -> str | None:
    """The text of a file, or None when it does not exist.

    Args:
      path: the file.

    Returns:
      Its text (UTF-8), or None.
    """
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except FileNotFoundError:
        return None


def record_path(results_dir: str, run: bench_suite.Run) -> str:
    """`<results_dir>/records/<partition>/<algorithm>/seed<k>.json`, with the entries' slugs.

    Args:
      results_dir: the suite's results directory.
      run: the run.

    Returns:
      Where the run's record is kept.
    """
    return os.path.join(results_dir, RECORDS_DIR, run.partition.slug, run.algorithm.slug, f'seed{run.seed}.json')


def trial_record_path(results_dir: str, trial) -> str:
    """`<results_dir>/records/<partition>/<algorithm>/trials/<trial slug>.json`.

    Args:
      results_dir: the suite's results directory.
      trial: a `tuning.Trial`.

    Returns:
      Where the trial's record is kept.
    """
    return os.path.join(
        results_dir, RECORDS_DIR, trial.partition.slug, trial.algorithm.slug, TRIALS_DIR, f'{trial.slug}.json'
    )
