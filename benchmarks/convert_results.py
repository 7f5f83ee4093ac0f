"""Per-run records for committed suite results that kept only their CSVs.

A `tff-pfl-bench --results_dir` results directory keeps one record per complete
run, `<results_dir>/records/<partition>/<algorithm>/seed<k>.json` (the run's
`bench_result.json`, `tff_pfl_bench.bench_run`). Results committed before
the harness kept records hold only `results.csv` (one row per run and client),
`summary.csv` (one row per partition and algorithm), `report.md` and plots.
This script builds, for every run of `results.csv` without a record, a record
in the same format from what those committed files give, so every committed
result is read the same way (`bench_aggregate.load_records`, `--report_only
--results_dir`, `restore_results`):

    uv run --locked python benchmarks/convert_results.py                  # every benchmarks/results/*_suite
    uv run --locked python benchmarks/convert_results.py benchmarks/results/persfl_mnist_suite

A converted record says so: `"converted_from": "results.csv"`, and `"unknown"`
lists the fields it holds as null because no committed file gives them (a
nested one as `summary.weighted_mean`, say); the report's aggregate leaves
those out rather than taking null for a value. Nothing is invented:

- from `results.csv`: each client's test accuracy (as printed there, 6
  significant digits), its id and order, and, where the column exists, its
  `examples` (train + val + test, what the sample-weighted metrics weigh by;
  kept on each client, since the record has no `partition.csv`); the chosen
  model's `summary` (mean, std, worst/best 10%, min, max, clients) computed
  from those accuracies as the experiment does (`tff_pfl.metrics.summarize`);
  its `weighted_mean` (weighted by test examples) and `top_10_by_samples`
  need the test examples, which results.csv does not give: null;
- from the results directory's `suite.toml` (the suite the results belong
  to): `suite`, `registry_name`, `rounds`, `target_accuracy`, and
  `dp_epsilon` / `dp_delta` null for a run without DP;
- from `summary.csv`, only for a cell with one run (its row is then that
  run's values, as printed, 6 significant digits): `seconds` (from
  `minutes_per_run`), `seconds_per_round`, `rounds_to_target` and the bytes
  per client (`communication`); for a cell with several seeds they are
  unknown, except `rounds_to_target`, null for every seed when none reached
  the target (`rounds_to_target_reached` 0/n);
- unknown always: the test curve, the final and diverged round, the
  partition's `partition.csv`, the configuration, whether the run was
  continued over sittings.

A record the harness wrote (no `converted_from`) is never touched; a converted
one is rewritten, so running this again gives the same files.
"""

import collections
import csv
import glob
import json
import os
import sys

# The suites import TensorFlow: its C++ start-up chatter is noise here.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from tff_pfl import metrics as metrics_lib  # noqa: E402
from tff_pfl import reports  # noqa: E402
from tff_pfl_bench import bench_aggregate, bench_layout, bench_parse, bench_suite  # noqa: E402

RESULTS = os.path.join('benchmarks', 'results')
SOURCE = 'results.csv'
CONVERTER = 'benchmarks/convert_results.py'

# Always unknown: no committed file gives them.
ALWAYS_UNKNOWN = (
    'final_round',
    'diverged_round',
    'final_only',
    'curve',
    'partition_csv',
    'config',
    'continued',
    'continued_from_round',
    'seconds_this_sitting',
    'summary.weighted_mean',
    'summary.top_10_by_samples',
    'clients.num_examples',
)
# Per-run values summary.csv gives only for a cell of one run.
_BYTES = (
    'bytes_down_per_client_per_round',
    'bytes_up_per_client_per_round',
    'bytes_down_per_client',
    'bytes_up_per_client',
)


class ConversionError(Exception):
    """The committed files of a results directory do not agree with each other."""


def _read_csv(path: str) -> list[dict]:
    with open(path, newline='', encoding='utf-8') as f:
        return list(csv.DictReader(f))


def _number(row: dict, column: str) -> float | None:
    value = row.get(column)
    return None if value in (None, '') else float(value)


def _integer(value: float | None) -> int | float | None:
    return int(value) if value is not None and float(value).is_integer() else value


def records(results_dir: str) -> list[tuple[bench_suite.Run, dict]]:
    """The converted record of every run of `results_dir`'s results.csv.

    Args:
      results_dir: a suite's results directory holding `suite.toml`,
        `results.csv` and `summary.csv`.

    Returns:
      `(run, record)` in the suite's run order, for every run results.csv
      has (whether or not a record exists already).

    Raises:
      ConversionError: results.csv names a run the suite does not have, a
        cell of summary.csv disagrees with results.csv's seeds, or a run's
        clients are not numbered 0..N-1.
      bench_suite.SuiteError: the suite.toml does not load.
    """
    suite_path = os.path.join(results_dir, bench_layout.SUITE_FILE)
    suite = bench_parse.parse_suite(bench_layout.file_text(suite_path), suite_path)
    by_label = {(run.partition.name, run.algorithm.name, run.seed): run for run in suite.runs()}
    rows = collections.defaultdict(list)
    for row in _read_csv(os.path.join(results_dir, SOURCE)):
        key = (row['partition'], row['algorithm'], int(row['seed']))
        if key not in by_label:
            raise ConversionError(f'{results_dir}/{SOURCE}: run {key} is not a run of {suite_path}')
        rows[key].append(row)
    summary = {(r['partition'], r['algorithm']): r for r in _read_csv(os.path.join(results_dir, 'summary.csv'))}
    result = []
    for run in suite.runs():
        key = (run.partition.name, run.algorithm.name, run.seed)
        if key not in rows:
            continue
        cell = summary.get(key[:2])
        seeds = sorted(s for (p, a, s) in rows if (p, a) == key[:2])
        if cell is None or sorted(int(s) for s in cell['seeds'].split()) != seeds:
            raise ConversionError(f'{results_dir}: summary.csv row {key[:2]} does not cover seeds {seeds} of {SOURCE}')
        result.append((run, _record(suite, run, rows[key], cell, single=len(seeds) == 1)))
    return result


def _record(suite: bench_suite.Suite, run: bench_suite.Run, rows: list[dict], cell: dict, single: bool) -> dict:
    rows = sorted(rows, key=lambda r: int(r['client']))
    if [int(r['client']) for r in rows] != list(range(len(rows))):
        raise ConversionError(f'run {run.label}: clients are not numbered 0..{len(rows) - 1}')
    models = {r['model'] for r in rows}
    if models != {run.algorithm.model}:
        raise ConversionError(f'run {run.label}: model {models} in {SOURCE}, {run.algorithm.model!r} in the suite')
    accuracies = [float(r['accuracy']) for r in rows]
    stats = metrics_lib.summarize(accuracies)
    stats.update(weighted_mean=None, top_10_by_samples=None)
    config = suite.config(run.partition, run.algorithm, run.seed)
    unknown = list(ALWAYS_UNKNOWN)
    no_dp = config.privacy.dp_noise_multiplier is None
    if not no_dp:
        unknown += ['dp_epsilon', 'dp_delta']
    seconds = seconds_per_round = rounds_to_target = communication = None
    if single:
        minutes = _number(cell, 'minutes_per_run')
        seconds = None if minutes is None else minutes * 60
        seconds_per_round = _number(cell, 'seconds_per_round')
        rounds_to_target = _integer(_number(cell, 'rounds_to_target'))
        if any(_number(cell, b) is not None for b in _BYTES):
            communication = {b: _integer(_number(cell, b)) for b in _BYTES}
        unknown += [
            name for name, value in (('seconds', seconds), ('seconds_per_round', seconds_per_round)) if value is None
        ]
        if 'rounds_to_target_reached' not in cell:
            unknown.append('rounds_to_target')
    else:
        unknown += ['seconds', 'seconds_per_round']
        if not cell.get('rounds_to_target_reached', '').startswith('0/'):
            unknown.append('rounds_to_target')
    if communication is None:
        unknown.append('communication')
    examples = [r.get('examples') for r in rows]
    if any(e in (None, '') for e in examples):
        examples = [None] * len(rows)
        unknown.append('clients.examples')
    return collections.OrderedDict(
        suite=suite.name,
        partition=run.partition.name,
        algorithm=run.algorithm.name,
        registry_name=run.algorithm.algorithm,
        seed=run.seed,
        model=run.algorithm.model,
        seconds=seconds,
        seconds_per_round=seconds_per_round,
        rounds=config.schedule.rounds,
        final_round=None,
        diverged_round=None,
        summary={run.algorithm.model: dict(stats)},
        clients=[
            collections.OrderedDict(
                client_id=r['client_id'],
                accuracy=a,
                num_examples=None,
                examples=None if e is None else int(e),
            )
            for r, a, e in zip(rows, accuracies, examples)
        ],
        final_only=None,
        curve=None,
        dp_epsilon=None,
        dp_delta=None,
        target_accuracy=suite.target_accuracy,
        rounds_to_target=rounds_to_target,
        communication=communication,
        partition_csv=None,
        config=None,
        continued=None,
        continued_from_round=None,
        seconds_this_sitting=None,
        **{
            bench_aggregate.CONVERTED_FROM: SOURCE,
            'converted_by': CONVERTER,
            bench_aggregate.UNKNOWN: sorted(set(unknown)),
        },
    )


def convert(results_dir: str) -> tuple[int, int]:
    """Writes the converted record of every run of results.csv that has no harness-written record.

    Args:
      results_dir: a suite's results directory.

    Returns:
      `(written, kept)`: converted records written (or rewritten), and
      harness-written records left alone.
    """
    written = kept = 0
    for run, record in records(results_dir):
        path = bench_layout.record_path(results_dir, run)
        existing = bench_layout.file_text(path)
        if existing is not None and not json.loads(existing).get(bench_aggregate.CONVERTED_FROM):
            kept += 1
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        reports.write_text_atomic(path, json.dumps(record, indent=1) + '\n')
        written += 1
    return written, kept


def main(argv: list[str]) -> int:
    """Converts the given results directories (default: every `benchmarks/results/*_suite`).

    Args:
      argv: results directories.

    Returns:
      The exit code: 0, or 2 on bad input (one line on stderr).
    """
    directories = argv or sorted(
        os.path.dirname(p) for p in glob.glob(os.path.join(RESULTS, '*_suite', bench_layout.SUITE_FILE))
    )
    for directory in directories:
        if not os.path.exists(os.path.join(directory, SOURCE)):
            print(f'convert_results: error: {directory} has no {SOURCE}', file=sys.stderr)
            return 2
        try:
            written, kept = convert(directory)
        except (ConversionError, bench_suite.SuiteError) as e:
            print(f'convert_results: error: {" ".join(str(e).split())}', file=sys.stderr)
            return 2
        print(f'{directory}: {written} converted records written, {kept} harness records kept')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
