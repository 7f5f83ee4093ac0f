"""The records of a benchmark suite, loaded and aggregated: one row per (partition, algorithm).

`load_results` reads the `bench_result.json` of every complete run of a
suite's output directory (`bench_run`), `load_records` the records kept in a
results directory (`bench_layout.record_path`); `aggregate` makes the
summary rows `bench_report` tables and plots (`summary.csv`), and
`architecture_rows` the per-architecture rows of heterogeneous runs.

A record may be a converted one (`CONVERTED_FROM`, written by
benchmarks/convert_results.py from an older results directory that kept only
its CSVs): what the committed files did not give is null and named in its
`UNKNOWN` list, and the aggregate leaves it out (a blank cell), never taking
it for a value.
"""

import collections
import csv
import io
import json
import os
import statistics
from collections.abc import Callable, Mapping, Sequence

from tff_pfl import metrics as metrics_lib
from tff_pfl.computations import heterogeneous
from tff_pfl_bench import bench_layout, bench_suite, tuning

# `aggregate`'s row key, true when a record of the row's minutes counts only the last of several sittings.
LAST_SITTING_ONLY = 'minutes_last_sitting_only'

# A converted record (benchmarks/convert_results.py) names its source here, e.g. "results.csv",
# and lists under UNKNOWN the fields it holds as null because the committed files did not give them.
CONVERTED_FROM = 'converted_from'

UNKNOWN = 'unknown'

# A `[paper]` metric (`bench_suite.PAPER_METRICS`) -> the summary.csv column of
# ours (mean over seeds), the column of its std over seeds, and its label in
# the report.
METRICS = collections.OrderedDict(
    mean=('accuracy_mean', 'accuracy_std_over_seeds', 'mean'),
    weighted=('weighted_mean', 'weighted_mean_std_over_seeds', 'weighted'),
    worst10=('worst_10', 'worst_10_std_over_seeds', 'worst 10%'),
    top10=('top_10_by_samples', 'top_10_by_samples_std_over_seeds', 'top 10%'),
)

# The top (or worst) 10% of N clients are ceil(0.1 * N) of them
# (`metrics_lib.top_by_weight_mean`, `metrics_lib.summarize`).
TOP_FRACTION = 0.1


def load_results(suite: bench_suite.Suite, output_dir: str) -> list[dict]:
    """The `bench_result.json` of every complete run of the suite, in `runs()` order.

    Args:
      suite: the suite.
      output_dir: the benchmark's directory.

    Returns:
      The records, each with the `Run` under `'run'`.

    Raises:
      bench_suite.SuiteError: complete runs of one (partition, seed) have
        different partitions.
    """
    return _load(suite, lambda run: os.path.join(run.directory(output_dir), bench_layout.RESULT_FILE))


def load_records(suite: bench_suite.Suite, results_dir: str) -> list[dict]:
    """The records kept in a results directory (`bench_layout.record_path`), in `runs()` order.

    What `--report_only --results_dir=<results_dir>` aggregates: the records
    it restores are these.

    Args:
      suite: the suite.
      results_dir: the suite's results directory, e.g. `benchmarks/results/<name>_suite`.

    Returns:
      The records, each with the `Run` under `'run'`.

    Raises:
      bench_suite.SuiteError: records of one (partition, seed) have different
        partitions.
    """
    return _load(suite, lambda run: bench_layout.record_path(results_dir, run))


def _load(suite: bench_suite.Suite, path_of: Callable) -> list[dict]:
    records, reference = [], {}
    for run in suite.runs():
        path = path_of(run)
        if not os.path.exists(path):
            continue
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        record['run'] = run
        key = (run.partition.name, run.seed)
        if record.get('partition_csv') is None:  # a converted record: its partition is not known
            pass
        elif key not in reference:
            reference[key] = record
        elif record['partition_csv'] != reference[key]['partition_csv']:
            raise bench_suite.SuiteError(
                f'runs {reference[key]["run"].label} and {run.label} trained on different partitions'
            )
        records.append(record)
    return records


def known(record: Mapping, field: str) -> bool:
    """Whether `record[field]` is the run's value: false for a converted record's `UNKNOWN` fields.

    Args:
      record: a `bench_result.json` record.
      field: a top-level key, e.g. 'seconds'.

    Returns:
      False when the record lists `field` under `UNKNOWN`, else True.
    """
    return field not in (record.get(UNKNOWN) or ())


def client_examples(partition_csv: str | None) -> dict[str, int] | None:
    """Each client's number of examples, from a run's `partition.csv` text.

    Args:
      partition_csv: the text of the run's `partition.csv` (columns
        `client_id`, `train_examples`, `val_examples`, `test_examples`, ...),
        as `bench_result.json` keeps it; None when the run has none.

    Returns:
      client id -> train + val + test examples (all of the client's data),
      or None when there is no partition text.

    Raises:
      ValueError: the text lacks those columns or a count is not an integer.
    """
    if not partition_csv:
        return None
    sizes = {}
    for row in csv.DictReader(io.StringIO(partition_csv)):
        try:
            sizes[row['client_id']] = sum(int(row[f'{split}_examples']) for split in ('train', 'val', 'test'))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f'partition.csv row {dict(row)} has no client_id and train/val/test counts') from None
    return sizes


def record_examples(record: Mapping) -> dict[str, int] | None:
    """Each client's number of examples (train + val + test) in a run's record.

    Args:
      record: a `bench_result.json` record.

    Returns:
      `client_examples` of its `partition_csv`; for a record without one (a
      converted record), its clients' `examples` (the results.csv column it was
      converted from) when every client has them; else None.

    Raises:
      ValueError: the record's partition text is malformed.
    """
    sizes = client_examples(record.get('partition_csv'))
    if sizes is None and record['clients'] and all(c.get('examples') is not None for c in record['clients']):
        sizes = {c['client_id']: int(c['examples']) for c in record['clients']}
    return sizes


def sample_weighted(record: Mapping) -> tuple[float | None, float | None]:
    """A run's sample-weighted accuracy, over all clients and over the top 10% by size.

    Weights are the clients' numbers of examples (train + val + test,
    `client_examples`): Self-FL weights clients "proportional to the sample
    size", and its Table 1 reports the "weighted test accuracy of clients that
    have top 10% most samples". The top 10% of N clients are the
    ceil(0.1 * N) with the most examples, ties broken by client order.

    Args:
      record: a run's `bench_result.json` record.

    Returns:
      `(weighted mean, top-10% weighted mean)` of the test accuracy, in %; both
      None when the record gives no client sizes (`record_examples`) or lacks a
      client in them.

    Raises:
      bench_suite.SuiteError: the record's partition text is malformed.
    """
    try:
        sizes = record_examples(record)
    except ValueError as e:
        raise bench_suite.SuiteError(f'run {record["run"].label}: {e}') from None
    clients = record['clients']
    if sizes is None or any(c['client_id'] not in sizes for c in clients):
        return None, None
    accuracies = [c['accuracy'] for c in clients]
    weights = [sizes[c['client_id']] for c in clients]
    weighted = metrics_lib.summarize(accuracies, weights)['weighted_mean']
    top = metrics_lib.top_by_weight_mean(accuracies, weights, TOP_FRACTION)
    return 100 * weighted, 100 * top


def _all_or_none(values) -> list | None:
    values = list(values)
    return None if any(v is None for v in values) else values


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _stdev(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.stdev(values) if len(values) >= 2 else None


def aggregate(suite: bench_suite.Suite, records: Sequence[Mapping]) -> list[dict]:
    """One summary row per (partition, algorithm) with at least one complete run.

    Accuracies are in %: `accuracy_mean` is the mean over seeds of the
    across-client mean, `accuracy_std_over_seeds` its standard deviation over
    seeds (n - 1), `client_std` the mean over seeds of the across-client
    (population) standard deviation, `worst_10` the mean over seeds of the
    mean of the worst 10% of clients (ceil(0.1 N) of N), `weighted_mean` and
    `top_10_by_samples` the means over seeds of `sample_weighted`'s two
    numbers (None when a run lacks its partition), each `*_std_over_seeds`
    the std over seeds (n - 1) of the statistic before it, `per_client`
    client i's accuracy averaged over seeds, `communication_by_seed` the
    (seed, bytes down, bytes up) per client per round of each record when
    the records disagree (made by different versions of the code), else None;
    `tuning.SUMMARY_COLUMNS` are `tuning.selection_columns`'s (blank without validation curves).

    Args:
      suite: the suite.
      records: `load_results(...)`.

    Returns:
      The rows, partition-major, algorithms in suite order.
    """
    rows = []
    for partition in suite.partitions:
        for algorithm in suite.algorithms:
            mine = [r for r in records if r['run'].partition is partition and r['run'].algorithm is algorithm]
            if not mine:
                continue
            model = algorithm.model
            means = [100 * r['summary'][model]['mean'] for r in mine]
            stds = [100 * r['summary'][model]['std'] for r in mine]
            worst = [100 * r['summary'][model]['worst_10'] for r in mine]
            weighted_pairs = [sample_weighted(r) for r in mine]
            weighted = _all_or_none(w for w, _ in weighted_pairs)
            top = _all_or_none(t for _, t in weighted_pairs)
            num_clients = len(mine[0]['clients'])
            if any(len(r['clients']) != num_clients for r in mine):
                raise bench_suite.SuiteError(
                    f'runs of {partition.name}/{algorithm.name} have different numbers of clients'
                )
            per_client = [statistics.fmean(100 * r['clients'][i]['accuracy'] for r in mine) for i in range(num_clients)]
            # A converted record may not know whether its run reached the target: left out of both counts.
            targeted = [r for r in mine if known(r, 'rounds_to_target')]
            reached = [r['rounds_to_target'] for r in targeted if r['rounds_to_target'] is not None]
            communication = [r['communication'] or {} for r in mine]
            seconds = _all_or_none(r['seconds'] for r in mine)
            rows.append(
                collections.OrderedDict(
                    partition=partition.name,
                    algorithm=algorithm.name,
                    model=model,
                    seeds=' '.join(str(r['seed']) for r in mine),
                    runs=f'{len(mine)}/{len(suite.seeds)}',
                    accuracy_mean=statistics.fmean(means),
                    accuracy_std_over_seeds=_stdev(means),
                    client_std=statistics.fmean(stds),
                    client_std_over_seeds=_stdev(stds),
                    worst_10=statistics.fmean(worst),
                    worst_10_std_over_seeds=_stdev(worst),
                    weighted_mean=None if weighted is None else statistics.fmean(weighted),
                    weighted_mean_std_over_seeds=None if weighted is None else _stdev(weighted),
                    top_10_by_samples=None if top is None else statistics.fmean(top),
                    top_10_by_samples_std_over_seeds=None if top is None else _stdev(top),
                    **tuning.selection_columns(mine),
                    rounds=mine[0]['rounds'],
                    rounds_to_target=_mean(reached),
                    rounds_to_target_reached=f'{len(reached)}/{len(targeted)}' if targeted else None,
                    # Bytes are the code's, not the seed's: records of one cell that disagree were
                    # made by different versions of the code (the report says so).
                    communication_by_seed=_communication_by_seed(mine),
                    bytes_down_per_client_per_round=_mean(
                        c.get('bytes_down_per_client_per_round') for c in communication
                    ),
                    bytes_up_per_client_per_round=_mean(c.get('bytes_up_per_client_per_round') for c in communication),
                    bytes_down_per_client=_mean(c.get('bytes_down_per_client') for c in communication),
                    bytes_up_per_client=_mean(c.get('bytes_up_per_client') for c in communication),
                    minutes_per_run=None if seconds is None else statistics.fmean(seconds) / 60,
                    # A continued run recorded before records counted earlier sittings: its last sitting only.
                    minutes_last_sitting_only=any(r.get('continued') and 'seconds_this_sitting' not in r for r in mine),
                    seconds_per_round=_mean(r.get('seconds_per_round') for r in mine),
                    # The schedule fixes epsilon: every seed spends the same.
                    epsilon=_mean(r.get('dp_epsilon') for r in mine),
                    registry_name=algorithm.algorithm,
                    per_client=per_client,
                )
            )
    return rows


def _communication_by_seed(records: Sequence[Mapping]) -> list[tuple] | None:
    """(seed, bytes down, bytes up per client per round) of each record, when the records disagree."""
    per_seed = [
        (
            r['seed'],
            r['communication'].get('bytes_down_per_client_per_round'),
            r['communication'].get('bytes_up_per_client_per_round'),
        )
        for r in records
        if r['communication']  # a converted record may not know its bytes
    ]
    return per_seed if len({(down, up) for _, down, up in per_seed}) > 1 else None


def client_architectures(record: Mapping) -> dict[str, str] | None:
    """Each client's model name in a run whose settings name two or more architectures.

    The heterogeneous algorithms give clients the `architectures` setting in
    turn (`heterogeneous.in_turn`), in the order of the partition's clients
    (`partition.csv`).

    Args:
      record: a `bench_result.json` record.

    Returns:
      client id -> model name; None when the settings name fewer than two
      distinct architectures (a homogeneous run, or one left to the data's
      default set, which the record does not name) or the record has no
      partition.
    """
    names = ((record.get('config') or {}).get('settings') or {}).get('architectures') or []
    if len(set(names)) < 2 or not record.get('partition_csv'):
        return None
    ids = [row['client_id'] for row in csv.DictReader(io.StringIO(record['partition_csv']))]
    return dict(zip(ids, heterogeneous.in_turn(names, len(ids))))


def architecture_rows(suite: bench_suite.Suite, records: Sequence[Mapping]) -> list[dict]:
    """Test accuracy (%) of each architecture's clients, per (partition, algorithm, architecture).

    `accuracy_mean` is the mean over seeds of the mean over that
    architecture's clients, `accuracy_std_over_seeds` its std over seeds
    (n - 1); `clients` the clients of that architecture in a run; `runs`
    as in `aggregate`. Runs without `client_architectures` are left out.

    Args:
      suite: the suite.
      records: `load_results(...)`.

    Returns:
      The rows, partition-major, algorithms in suite order, architectures in
      the order of the settings; empty when no run names architectures.
    """
    rows = []
    for partition in suite.partitions:
        for algorithm in suite.algorithms:
            per_run = collections.defaultdict(list)  # architecture -> one mean per run
            clients = {}
            for r in records:
                if r['run'].partition is not partition or r['run'].algorithm is not algorithm:
                    continue
                assigned = client_architectures(r)
                if assigned is None:
                    continue
                groups = {name: [] for name in assigned.values()}  # in the settings' order
                for c in r['clients']:
                    if c['client_id'] not in assigned:
                        label, client_id = r['run'].label, c['client_id']
                        raise bench_suite.SuiteError(f'run {label}: client {client_id} is not in its partition.csv')
                    groups[assigned[c['client_id']]].append(100 * c['accuracy'])
                for name, values in groups.items():
                    if values:
                        per_run[name].append(statistics.fmean(values))
                        clients[name] = len(values)
            for name, means in per_run.items():
                rows.append(
                    collections.OrderedDict(
                        partition=partition.name,
                        algorithm=algorithm.name,
                        architecture=name,
                        clients=clients[name],
                        runs=f'{len(means)}/{len(suite.seeds)}',
                        accuracy_mean=statistics.fmean(means),
                        accuracy_std_over_seeds=_stdev(means),
                    )
                )
    return rows
