"""The report of a benchmark suite: its complete runs aggregated, tabled and plotted.

Reads the `bench_result.json` of every complete run of a suite's output
directory (`bench_run`) and writes, next to them (`write_report`):

    <output_dir>/results.csv           one row per run and client
    <output_dir>/summary.csv           one row per partition and algorithm
    <output_dir>/report.md             the tables and plots below
    <output_dir>/curves_<p>.png, clients_<p>.png, std_<p>.png
    <output_dir>/tuning.csv, tuning.json   a suite with [tuning]: its trials and choices (`tuning`)

The records are loaded and aggregated by `bench_aggregate`; this module
tables and plots its rows.
"""

import collections
import os
import statistics
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tff_pfl import reports
from tff_pfl_bench import bench_aggregate, bench_layout, bench_suite, leaderboard, tuning

# The per-client table lists every client up to this many; beyond, it gives
# these quantiles of the clients' (seed-averaged) accuracies instead.
MAX_CLIENT_ROWS = 50
CLIENT_QUANTILES = (
    ('min', 0.0),
    ('10th percentile', 0.1),
    ('25th percentile', 0.25),
    ('median', 0.5),
    ('75th percentile', 0.75),
    ('90th percentile', 0.9),
    ('max', 1.0),
)


def _architecture_lines(arch_rows: Sequence[Mapping]) -> list[str]:
    """The report's section on `bench_aggregate.architecture_rows`, one table row per (algorithm, partition)."""
    if not arch_rows:
        return []
    names = list(dict.fromkeys(row['architecture'] for row in arch_rows))
    headers = {row['architecture']: f'{row["architecture"]} ({row["clients"]})' for row in arch_rows}
    table = {}
    for row in arch_rows:
        entry = table.setdefault(
            (row['partition'], row['algorithm']),
            {'algorithm': row['algorithm'], 'partition': row['partition'], 'runs': row['runs']},
        )
        entry[headers[row['architecture']]] = _mean_std(row['accuracy_mean'], row['accuracy_std_over_seeds'])
    return [
        '## Test accuracy by client architecture (%)',
        '',
        "Clients take the run's `architectures` in turn, in partition.csv order (clients per architecture in",
        "brackets). Each cell: mean over seeds of the mean test accuracy of that architecture's clients ± std",
        'over seeds. Also in architectures.csv and architectures_<partition>.png.',
        '',
        reports.markdown_table(list(table.values()), ['algorithm', 'partition', 'runs'] + [headers[n] for n in names]),
        '',
    ]


def write_report(
    suite: bench_suite.Suite,
    output_dir: str,
    *,
    published: bool = False,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Writes results.csv, summary.csv, report.md and the plots from the complete runs.

    Args:
      suite: the suite.
      output_dir: the benchmark's directory (holding `suite.toml`).
      published: the report goes to a results directory (`render_report`).
      log: receives where the report is.

    Returns:
      `aggregate`'s rows.
    """
    output_dir = os.path.abspath(output_dir)
    with bench_layout.locked(os.path.join(output_dir, '.lock')):
        records = bench_aggregate.load_results(suite, output_dir)
        rows = bench_aggregate.aggregate(suite, records)
        results = []
        for r in records:
            sizes = bench_aggregate.record_examples(r) or {}  # well formed: aggregate read it
            for i, c in enumerate(r['clients']):
                results.append(
                    collections.OrderedDict(
                        partition=r['partition'],
                        algorithm=r['algorithm'],
                        seed=r['seed'],
                        client=i,
                        client_id=c['client_id'],
                        model=r['model'],
                        accuracy=c['accuracy'],
                        examples=sizes.get(c['client_id']),
                    )
                )
        reports.write_csv(os.path.join(output_dir, 'results.csv'), results)
        reports.write_csv(
            os.path.join(output_dir, 'summary.csv'),
            [
                {
                    k: v
                    for k, v in row.items()
                    if k not in ('per_client', 'communication_by_seed', bench_aggregate.LAST_SITTING_ONLY)
                }
                for row in rows
            ],
        )
        arch_rows = bench_aggregate.architecture_rows(suite, records)
        if arch_rows:
            reports.write_csv(os.path.join(output_dir, bench_layout.ARCHITECTURES_FILE), arch_rows)
        plots = _write_plots(suite, output_dir, records, rows) + _write_architecture_plots(suite, output_dir, arch_rows)
        commands = (bench_layout.file_text(os.path.join(output_dir, bench_layout.COMMANDS_FILE)) or '').splitlines()
        sections = dict(arch_rows=arch_rows, trial_rows=tuning.write_files(suite, output_dir))  # with tuning.csv, .json
        text = render_report(suite, output_dir, records, rows, plots, commands, published=published, **sections)
        reports.write_text_atomic(os.path.join(output_dir, 'report.md'), text)
    log(f'report: {os.path.join(output_dir, "report.md")} ({len(records)} of {len(suite.runs())} runs complete)')
    return rows


def _write_plots(suite, output_dir, records, rows) -> list[tuple[str, str]]:
    plots = []
    for partition in suite.partitions:
        mine = [row for row in rows if row['partition'] == partition.name]
        if not mine:
            continue
        labels = [row['algorithm'] for row in mine]
        curves = collections.defaultdict(dict)
        for row in mine:
            points = collections.defaultdict(list)
            for record in records:
                if record['run'].partition is partition and record['algorithm'] == row['algorithm']:
                    for point in record['curve'] or ():  # a converted record has no curve
                        points[point['round']].append(100 * point['accuracy'])
            for round_num, values in points.items():
                curves[round_num][row['algorithm']] = statistics.fmean(values)
        curve_rows = [{'round': r, **curves[r]} for r in sorted(curves)]
        name = f'curves_{partition.slug}.png'
        reports.plot_curves(
            curve_rows,
            'round',
            labels,
            os.path.join(output_dir, name),
            f"{suite.name}, {partition.name}: test accuracy of each algorithm's model (mean over seeds)",
            'test accuracy (%)',
        )
        plots.append((f'Test accuracy per round, {partition.name}', name))
        num_clients = max(len(row['per_client']) for row in mine)
        series = {row['algorithm']: row['per_client'] for row in mine if len(row['per_client']) == num_clients}
        name = f'clients_{partition.slug}.png'
        reports.plot_client_bars(
            [str(i) for i in range(num_clients)],
            series,
            os.path.join(output_dir, name),
            f'{suite.name}, {partition.name}: test accuracy per client (mean over seeds)',
            'test accuracy (%)',
        )
        plots.append((f'Per-client accuracy, {partition.name}', name))
        name = f'std_{partition.slug}.png'
        reports.plot_bars(
            labels,
            [row['client_std'] for row in mine],
            os.path.join(output_dir, name),
            f'{suite.name}, {partition.name}: std of accuracy across clients (error bar: std over seeds)',
            'std across clients (%)',
            errors=[row['client_std_over_seeds'] for row in mine],
        )
        plots.append((f'Std across clients, {partition.name}', name))
        if any(row['epsilon'] is not None for row in mine):
            name = f'epsilon_{partition.slug}.png'
            reports.plot_accuracy_vs_epsilon(
                mine,
                os.path.join(output_dir, name),
                f'{suite.name}, {partition.name}: accuracy against the privacy spent (mean over seeds)',
            )
            plots.append((f'Accuracy against epsilon, {partition.name}', name))
    return plots


def _write_architecture_plots(suite, output_dir, arch_rows) -> list[tuple[str, str]]:
    plots = []
    for partition in suite.partitions:
        mine = [row for row in arch_rows if row['partition'] == partition.name]
        if not mine:
            continue
        names = list(dict.fromkeys(row['architecture'] for row in mine))
        series = collections.defaultdict(dict)
        for row in mine:
            series[row['algorithm']][row['architecture']] = row['accuracy_mean']
        name = f'architectures_{partition.slug}.png'
        reports.plot_client_bars(
            names,
            {algorithm: [values.get(n, float('nan')) for n in names] for algorithm, values in series.items()},
            os.path.join(output_dir, name),
            f"{suite.name}, {partition.name}: test accuracy of each architecture's clients (mean over seeds)",
            'test accuracy (%)',
            xlabel='architecture',
        )
        plots.append((f'Accuracy by client architecture, {partition.name}', name))
    return plots


def _epsilon(value: float | None) -> str:
    return 'no DP' if value is None else f'{value:.3g}'


def default_output_dir(suite: bench_suite.Suite) -> str:
    """Where `tff-pfl-bench` writes `suite` without `--output_dir`.

    Args:
      suite: the parsed `bench_suite.Suite`.

    Returns:
      `runs/bench/<slug of the suite's name>`, relative to the working directory.
    """
    return os.path.join('runs', 'bench', bench_suite.slug(suite.name))


def _display_path(path: str) -> str:
    """`path` relative to the working directory when it is inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith('..') else relative


def _communication_lines(rows: Sequence[Mapping]) -> list[str]:
    """A note for each row whose seeds' records give different bytes per round."""
    notes = []
    for row in rows:
        if row['communication_by_seed']:
            seeds = '; '.join(
                f'seed {seed}: {_kilobytes(down)} kB down, {_kilobytes(up)} kB up'
                for seed, down, up in row['communication_by_seed']
            )
            notes.append(f'- {row["partition"]}/{row["algorithm"]}: {seeds}.')
    if not notes:
        return []
    return [
        'Records of one row that give different bytes per round were made by different versions of the code',
        "(bytes depend on the round's type signature, not on the seed); the table shows their mean:",
        '',
        *notes,
        '',
    ]


def _kilobytes(value: float | None) -> str:
    return '' if value is None else f'{value / 1e3:.1f}'


def _pct(value: float | None, decimals: int = 2) -> str:
    return '' if value is None else f'{value:.{decimals}f}'


def _paper_number(value: float | None) -> str:
    """A paper's number as printed: one decimal, or two when it has them."""
    if value is None:
        return ''
    one = f'{value:.1f}'
    return one if float(one) == round(value, 2) else f'{value:.2f}'


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return ''
    return _pct(mean) if std is None else f'{_pct(mean)} ± {_pct(std)}'


def paper_table(suite: bench_suite.Suite, rows: Sequence[Mapping]) -> tuple[list, list]:
    """The PersFL paper's Table 3 shape: User i rows, Avg. Acc., Std Dev.

    Columns are `<algorithm> <partition>`, grouped by algorithm. A cell is
    client i's test accuracy (%) averaged over seeds; Avg. Acc. is the mean
    over seeds of the across-client mean and Std Dev the mean over seeds of
    the across-client (population) standard deviation. With more than
    `MAX_CLIENT_ROWS` clients the User rows give way to the quantiles
    `CLIENT_QUANTILES` of those seed-averaged client accuracies (linear
    interpolation); every client stays in results.csv.

    Args:
      suite: the suite.
      rows: `bench_aggregate.aggregate`'s rows.

    Returns:
      `(table rows, columns)` for `reports.markdown_table`.
    """
    by_key = {(row['algorithm'], row['partition']): row for row in rows}
    columns = ['']
    for algorithm in suite.algorithms:
        for partition in suite.partitions:
            if (algorithm.name, partition.name) in by_key:
                columns.append(f'{algorithm.name} {partition.name}')
    num_clients = max([len(row['per_client']) for row in rows] or [0])
    collapsed = num_clients > MAX_CLIENT_ROWS
    if collapsed:
        table = [{'': label} for label, _ in CLIENT_QUANTILES]
    else:
        table = [{'': f'User {i}'} for i in range(num_clients)]
    table += [{'': 'Avg. Acc.'}, {'': 'Std Dev'}]
    body = len(table) - 2
    for (algorithm, partition), row in by_key.items():
        column = f'{algorithm} {partition}'
        if collapsed:
            values = np.asarray(row['per_client'], dtype=np.float64)
            for i, (_, q) in enumerate(CLIENT_QUANTILES):
                table[i][column] = _pct(float(np.quantile(values, q)))
        else:
            for i, value in enumerate(row['per_client']):
                table[i][column] = _pct(value)
        table[body][column] = _pct(row['accuracy_mean'])
        table[body + 1][column] = _pct(row['client_std'])
    return table, columns


def _diverged_lines(records: Sequence[Mapping]) -> list[str]:
    """A paragraph naming the runs that stopped at a diverged round (`training_loop.diverged`); empty if none."""
    stopped = [r for r in records if r.get('diverged_round') is not None]
    if not stopped:
        return []
    runs = '; '.join(
        f'{r["run"].algorithm.name} {r["run"].partition.name} seed {r["run"].seed} at round {r["diverged_round"]}'
        for r in stopped
    )
    return [
        f'Diverged (mean training loss NaN or infinite; the run stopped there and its models were evaluated): {runs}.',
        '',
    ]


def _converted_lines(records: Sequence[Mapping]) -> list[str]:
    """A paragraph counting the converted records (`CONVERTED_FROM`); empty if none."""
    converted = [r for r in records if r.get(bench_aggregate.CONVERTED_FROM)]
    if not converted:
        return []
    sources = ', '.join(sorted({str(r[bench_aggregate.CONVERTED_FROM]) for r in converted}))
    return [
        f'{len(converted)} of the {len(records)} records were converted from committed files ({sources};',
        '`benchmarks/convert_results.py`), not written by the runs: their per-client accuracies are as those',
        'files give them (6 significant digits); what the files did not give (the test curve, and the time,',
        'bytes or rounds to target of a cell with several seeds) is unknown: blank cells, or runs left out.',
        '',
    ]


def distinct_commands(commands: Sequence[str]) -> list[str]:
    """`commands` in first-seen order, each once; one given n > 1 times ends `  # n sittings`.

    `commands.txt` gains a line per invocation, so a run interrupted and continued
    with the same command line appears once per sitting.

    Args:
      commands: the lines of `commands.txt`.

    Returns:
      The lines to show.
    """
    counts = collections.Counter(commands)
    return [command if counts[command] == 1 else f'{command}  # {counts[command]} sittings' for command in counts]


def render_report(
    suite: bench_suite.Suite,
    output_dir: str,
    records: Sequence[Mapping],
    rows: Sequence[Mapping],
    plots: Sequence[tuple[str, str]],
    commands: Sequence[str],
    *,
    published: bool = False,
    arch_rows: Sequence[Mapping] = (),
    trial_rows: Sequence[Mapping] = (),
) -> str:
    """The markdown report of a suite's complete runs.

    Args:
      suite: the suite.
      output_dir: the benchmark's directory.
      records: `bench_aggregate.load_results(...)`.
      rows: `bench_aggregate.aggregate(...)`.
      plots: `(title, file)` of the plots.
      commands: the recorded invocations.
      published: the report is copied to a results directory, where the
        directory it was rebuilt in means nothing: its reproduce line names the
        default output directory, `runs/bench/<suite name>`.
      arch_rows: `bench_aggregate.architecture_rows(...)` (empty: no such section).
      trial_rows: `tuning.tuning_rows(...)`, for the "Tuning" section of a suite with `[tuning]`.

    Returns:
      The report's text.
    """
    total = len(suite.runs())
    defaults = ', '.join(f'{k}={v}' for k, v in suite.defaults.items())
    reproduce_dir = default_output_dir(suite) if published else _display_path(output_dir)
    lines = [f'# {suite.name}', '']
    if suite.description:
        lines += [suite.description.strip(), '']
    lines += [
        f'Suite `{suite.path}`; seeds {", ".join(str(s) for s in suite.seeds)}; {len(records)} of {total} runs '
        'complete.',
        f'Defaults: {defaults}.',
        '',
        *_diverged_lines(records),
        *_converted_lines(records),
        '## Test accuracy per client (%)',
        '',
        "Each cell is client i's test accuracy of the algorithm's model, averaged over seeds. Avg. Acc. is the",
        'mean over seeds of the across-client mean; Std Dev the mean over seeds of the across-client (population)',
        'standard deviation of each run (so it is not the std of the column above, which is seed-averaged).',
        '',
    ]
    if max([len(row['per_client']) for row in rows] or [0]) > MAX_CLIENT_ROWS:
        lines += [
            f'More than {MAX_CLIENT_ROWS} clients: the rows are quantiles of those seed-averaged client accuracies',
            '(linear interpolation), not single clients; every client is in results.csv and clients_<partition>.png.',
            '',
        ]
    table, columns = paper_table(suite, rows)
    lines += [reports.markdown_table(table, columns) if rows else '(no complete runs)', '']
    lines += leaderboard.leaderboard_lines(suite, records)
    lines += [
        '## Ours vs the paper (%)',
        '',
    ]
    if suite.paper_source:
        lines += [f'Paper: {suite.paper_source}.', '']
    lines += [
        'ours: mean over seeds ± std over seeds of the across-client mean; ours std: of the across-client std;',
        "weighted: of the sample-weighted mean (weight: the client's train + val + test examples, partition.csv);",
        'worst 10%: of the mean of the ceil(0.1 N) worst of the N clients; top 10%: of the sample-weighted mean of',
        "the ceil(0.1 N) clients with the most examples (Self-FL's Table 1); each a mean over seeds. paper, paper",
        "std: the across-client mean and std of the suite's [paper] table; paper <metric>: the other metrics it",
        'gives; diff: ours - paper.',
        '',
    ]
    targeted = [
        m
        for m in bench_aggregate.METRICS
        if any(m in cell for cells in suite.paper.values() for cell in cells.values())
    ]
    comparison = []
    for row in rows:
        cell = suite.paper.get(row['algorithm'], {}).get(row['partition'], {})
        paper_mean, paper_std = cell.get('mean', (None, None))
        entry = {
            'algorithm': row['algorithm'],
            'partition': row['partition'],
            'model': row['model'],
            'runs': row['runs'],
            'ours': _mean_std(row['accuracy_mean'], row['accuracy_std_over_seeds']),
            'ours std': _pct(row['client_std']),
            'weighted': _pct(row['weighted_mean']),
            'worst 10%': _pct(row['worst_10']),
            'top 10%': _pct(row['top_10_by_samples']),
            'paper': _paper_number(paper_mean),
            'paper std': _paper_number(paper_std),
            'diff': '' if paper_mean is None else f'{row["accuracy_mean"] - paper_mean:+.2f}',
            'diff std': '' if paper_std is None else f'{row["client_std"] - paper_std:+.2f}',
            'epsilon': _epsilon(row['epsilon']),
        }
        for metric in targeted:
            if metric == 'mean':  # the columns above
                continue
            column, _, label = bench_aggregate.METRICS[metric]
            paper_value = cell.get(metric, (None, None))[0]
            ours = row[column]
            entry[f'paper {label}'] = _paper_number(paper_value)
            entry[f'diff {label}'] = '' if paper_value is None or ours is None else f'{ours - paper_value:+.2f}'
        comparison.append(entry)
    columns = ['algorithm', 'partition', 'model', 'runs', 'ours', 'ours std', 'weighted', 'worst 10%', 'top 10%']
    columns += ['paper', 'paper std', 'diff', 'diff std']
    for metric in targeted:
        if metric != 'mean':
            label = bench_aggregate.METRICS[metric][2]
            columns += [f'paper {label}', f'diff {label}']
    if any(row['epsilon'] is not None for row in rows):
        columns.append('epsilon')
        lines += ['epsilon: user-level DP spent by the end of the run (docs/privacy.md); "no DP" without it.', '']
    lines += [reports.markdown_table(comparison, columns), '', *_architecture_lines(arch_rows)]
    lines += [*tuning.selection_lines(rows), *tuning.tuning_lines(suite, trial_rows)]
    target = (
        'no target_accuracy set'
        if suite.target_accuracy is None
        else (
            f'first evaluated round whose mean test accuracy across clients is >= {100 * suite.target_accuracy:g}%, '
            'averaged over the seeds that reach it (reached: seeds that do)'
        )
    )
    lines += [
        '## Communication and rounds to target',
        '',
        f'Rounds to target: {target}. A model made by a final `personalize` stage exists only at the last round.',
        "Communication: bytes of one round per participating client, read from the round's type signature",
        '(`audit.communication_bytes`: every `federated_broadcast` down, every CLIENTS -> SERVER aggregation up),',
        "times the clients of each round, summed over the rounds, plus a final `personalize` stage's bytes for",
        'every client; divided by the number of clients. Evaluation is not counted. kB = 10^3 bytes, MB = 10^6.',
        "Per round: one participating client's bytes in one training round.",
        '',
    ]
    cost = []
    for row in rows:
        cost.append(
            {
                'algorithm': row['algorithm'],
                'partition': row['partition'],
                'rounds': row['rounds'],
                'rounds to target': f'{row["rounds_to_target"]:.1f}'
                if row['rounds_to_target'] is not None
                else ('not reached' if suite.target_accuracy is not None and row['rounds_to_target_reached'] else ''),
                'reached': row['rounds_to_target_reached'],
                'kB down / client / round': _kilobytes(row['bytes_down_per_client_per_round']),
                'kB up / client / round': _kilobytes(row['bytes_up_per_client_per_round']),
                'MB down / client': ''
                if row['bytes_down_per_client'] is None
                else f'{row["bytes_down_per_client"] / 1e6:.3f}',
                'MB up / client': ''
                if row['bytes_up_per_client'] is None
                else f'{row["bytes_up_per_client"] / 1e6:.3f}',
                'minutes / run': ''
                if row['minutes_per_run'] is None
                else f'{row["minutes_per_run"]:.2f}' + (' *' if row[bench_aggregate.LAST_SITTING_ONLY] else ''),
                's / round': '' if row['seconds_per_round'] is None else f'{row["seconds_per_round"]:.2f}',
            }
        )
    columns = [
        'algorithm',
        'partition',
        'rounds',
        'rounds to target',
        'reached',
        'kB down / client / round',
        'kB up / client / round',
        'MB down / client',
        'MB up / client',
        'minutes / run',
        's / round',
    ]
    lines += [reports.markdown_table(cost, columns), '']
    if any(row[bench_aggregate.LAST_SITTING_ONLY] for row in rows):
        lines += [
            "\\* Counts only the last sitting of a run continued over sittings (its record predates records' counting",
            'the earlier sittings too).',
            '',
        ]
    lines += _communication_lines(rows)
    lines += [
        '## Commands',
        '',
        'Reproduce (skips complete runs; add `--seeds=`, `--algorithms=`, `--partitions=` to split the work):',
        '',
        f'    tff-pfl-bench --suite={suite.path} --output_dir={reproduce_dir}',
        '',
    ]
    if commands:
        lines += ['Invocations that wrote this directory:', '']
        lines += [f'    {command}' for command in distinct_commands(commands)]
        lines += ['']
    lines += [f'![{title}]({path})' for title, path in plots]
    return '\n'.join(lines) + '\n'
