"""What a finished run writes for a reader: clients.csv, the plots and report.md, and the tables.

The algorithm's own clients.csv columns and plots come from its declaration
(`tff_pfl.algorithm.Algorithm.client_columns`, `.plots`).
"""

import collections
import json
import os

from tff_pfl import reports
from tff_pfl.program import algorithms, training_loop

# report.md lists this many clients; clients.csv has them all.
REPORT_CLIENTS = 100


def write_partition_summary(out: str, spec, histogram) -> None:
    """Writes `partition.csv` (examples per split and class of each client) and `partition.png`.

    Args:
      out: the run's directory.
      spec: the run's `client_data.ClientDataSpec`.
      histogram: `[clients, classes]` training examples per class.
    """
    rows = []
    source_ids = spec.source_ids or (None,) * spec.num_clients
    splits = ('train', 'val', 'test')
    for i, (client_id, source_id, counts) in enumerate(zip(spec.client_ids, source_ids, histogram)):
        row = collections.OrderedDict(client_id=client_id)
        if source_id is not None:
            row['source_id'] = source_id  # the client's own id in a naturally federated source
        for split in splits:
            row[f'{split}_examples'] = int(spec.split_sizes[split][i])
        row.update((f'class_{c}', int(n)) for c, n in enumerate(counts))
        rows.append(row)
    reports.write_csv(os.path.join(out, 'partition.csv'), rows)
    reports.plot_class_histogram(histogram, os.path.join(out, 'partition.png'), 'Examples per class and client')


def _add_client_columns(config, result) -> None:
    """Appends the algorithm's client-state columns to the per-client rows."""
    columns = algorithms.get(config.algorithm).client_columns
    if columns is None:
        return
    for row in result.clients:
        row.update(columns(result.client_states[row['client_id']]))


def write_results(out: str, config, spec, result: training_loop.RunResult, process) -> list:
    """Writes clients.csv (with the algorithm's columns), the plots and report.md.

    Args:
      out: the run's directory.
      config: the run's `run_config.ExperimentConfig`.
      spec: its `client_data.ClientDataSpec`.
      result: the finished run.
      process: its process (what the algorithm's plots read).

    Returns:
      The algorithm's own plots, `(title, file)` pairs.
    """
    _add_client_columns(config, result)
    reports.write_csv(os.path.join(out, 'clients.csv'), result.clients)
    test_columns = [k for k in result.rounds[-1] if k.startswith('test_') and k.endswith('_accuracy_mean')]
    x_axis = 'slot' if 'slot' in result.rounds[-1] else 'round'  # serverless runs count time slots
    reports.plot_curves(
        result.rounds,
        x_axis,
        ['train_accuracy'] + test_columns,
        os.path.join(out, 'accuracy.png'),
        f'{config.algorithm}: accuracy per {x_axis}',
        'accuracy',
    )
    series = collections.OrderedDict(
        (name, [row[f'{name}_accuracy'] for row in result.clients]) for name in result.summary
    )
    reports.plot_client_bars(
        [row['client_id'] for row in result.clients],
        series,
        os.path.join(out, 'clients.png'),
        f'{config.algorithm}: test accuracy per client',
        'test accuracy',
    )
    plots = algorithms.get(config.algorithm).plots
    extra = plots(out, result, process) if plots else []
    reports.write_text_atomic(os.path.join(out, 'report.md'), render_report(config, spec, result, extra))
    return extra


def client_table(result: training_loop.RunResult) -> tuple[list, list]:
    """Rows and columns of the per-client result table (accuracy in %).

    Columns: client id (and the source's own id, where it has them), test
    examples, each model's test accuracy, then any algorithm columns (e.g.
    PersFL's teacher round, T and lambda).

    Args:
      result: a finished run's `RunResult`.

    Returns:
      `(rows, columns)`: one dict per client, and the column names in order.
    """
    names = list(result.summary)
    ids = ['client_id'] + (['source_id'] if 'source_id' in result.clients[0] else [])
    columns = ids + ['test_examples'] + [f'{name}_accuracy' for name in names]
    known = set(columns) | {f'{n}_{m}' for n in names for m in ('loss', 'accuracy', 'num_examples')}
    extra = [k for k in result.clients[0] if k not in known]
    rows = []
    for row in result.clients:
        shown = {k: row[k] for k in ids}
        shown['test_examples'] = int(row[f'{names[0]}_num_examples'])
        for name in names:
            shown[f'{name}_accuracy'] = 100.0 * row[f'{name}_accuracy']
        shown.update((k, row[k]) for k in extra)
        rows.append(shown)
    return rows, columns + extra


def summary_table(result: training_loop.RunResult) -> tuple[list, list]:
    """Rows and columns of the across-client summary (accuracy in %).

    Args:
      result: a finished run's `RunResult`.

    Returns:
      `(rows, columns)`: one dict per evaluated model (`model`, `mean`,
      `weighted_mean`, `std`, `worst_10`, `best_10`, `top_10_by_samples`),
      and those column names.
    """
    columns = ['model', 'mean', 'weighted_mean', 'std', 'worst_10', 'best_10', 'top_10_by_samples']
    rows = []
    for name, summary in result.summary.items():
        rows.append({'model': name, **{c: 100.0 * summary[c] for c in columns[1:]}})
    return rows, columns


def privacy_lines(config, num_clients: int, rounds) -> list[str]:
    """The report's paragraph on user-level DP (empty without DP).

    Args:
      config: the run's configuration.
      num_clients: the population N.
      rounds: the metrics rows (the last one's `dp_epsilon` is the privacy spent).

    Returns:
      Lines of markdown, starting with an empty one.
    """
    dp = config.dp_mechanism(num_clients)
    if dp is None:
        return []
    clipping = (
        f'fixed clip {dp.clip:g}'
        if not dp.adaptive
        else (f'adaptive clip towards the {dp.target_quantile:g} quantile of upload norms (from {dp.initial_clip:g})')
    )
    sampling = (
        f'Poisson sampling of clients with q = {config.schedule.client_fraction:g}'
        if config.schedule.client_fraction < 1
        else 'every client in every round'
    )
    spent = rounds[-1].get('dp_epsilon', float('nan')) if rounds else float('nan')
    entry = algorithms.get(config.algorithm)
    where = (
        f'each upload gets noise of stddev 2 x {dp.noise_multiplier:g} x {dp.clip:g} on its client; epsilon of a '
        'client that took part in every round (no amplification by sampling)'
        if entry.privacy.local
        else f'the noised sum is divided by {dp.clients_per_round:g} expected clients'
    )
    return [
        '',
        f'User-level DP ({entry.privacy.uploads}): noise multiplier '
        f'{dp.noise_multiplier:g}, {clipping}, {sampling}; {where}. epsilon = {spent:.4g} at delta = '
        f'{config.privacy.delta_for(num_clients):.3g} after {len(rounds)} rounds (RDP accountant; docs/privacy.md).',
    ]


def divergence_lines(result: training_loop.RunResult) -> list[str]:
    """The report's paragraph on a run that stopped at a diverged round (empty if it ran every round).

    Args:
      result: the run's `RunResult`.

    Returns:
      Lines of markdown, starting with an empty one.
    """
    if result.diverged_round is None:
        return []
    return [
        '',
        f'**Diverged at round {result.diverged_round}**: its mean training loss was '
        f'{result.rounds[-1].get("train_loss")}, and the run stopped there (`--stop_on_divergence`); the '
        'accuracies below are of the models after that round.',
    ]


def warning_lines(result: training_loop.RunResult) -> list[str]:
    """The report's Warnings section: the pre-run warnings and the rounds' STALLED / DIVERGING findings.

    Args:
      result: the run's `RunResult` (its `warnings`).

    Returns:
      Lines of markdown, starting with an empty one (none without warnings).
    """
    if not result.warnings:
        return []
    return ['', '## Warnings', '', *(f'- {line}' for line in result.warnings)]


def render_report(config, spec, result, extra_plots=()) -> str:
    """The markdown report of a run.

    Args:
      config: the run's `ExperimentConfig`.
      spec: the run's `client_data.ClientDataSpec`.
      result: the run's `RunResult`.
      extra_plots: `(title, file name)` pairs of the algorithm's own plots,
        relative to the output directory.

    Returns:
      The `report.md` text, ending with a newline.
    """
    client_rows, client_columns = client_table(result)
    summary_rows, summary_columns = summary_table(result)
    last = result.rounds[-1]
    seconds = [row['round_seconds'] for row in result.rounds]
    lines = [
        f'# {config.algorithm} on {config.data.dataset}',
        '',
        f'{spec.num_clients} clients, partition `{config.data.partition.name}`, model `{config.model_name()}`, '
        f'{config.schedule.rounds} rounds, client fraction {config.schedule.client_fraction}, seed {config.seed}.',
        f'Median round time {sorted(seconds)[len(seconds) // 2]:.3f} s; final train loss '
        f'{last.get("train_loss", float("nan")):.4f}.',
        *divergence_lines(result),
        *privacy_lines(config, spec.num_clients, result.rounds),
        *warning_lines(result),
        '',
        '## Test accuracy across clients (%)',
        '',
        reports.markdown_table(summary_rows, summary_columns, '{:.2f}'),
        '',
        'std is the population standard deviation across clients (the fairness measure);',
        'worst_10/best_10 average the lowest/highest 10% of clients; top_10_by_samples is the',
        'sample-weighted accuracy of the 10% of clients with the most data.',
        '',
        '## Per-client test accuracy (%)',
        '',
        reports.markdown_table(
            client_rows, client_columns, '{:.2f}', max_rows=REPORT_CLIENTS, more='clients in [clients.csv](clients.csv)'
        ),
        '',
        '![accuracy per round](accuracy.png)',
        '![per-client accuracy](clients.png)',
        '![partition](partition.png)',
    ]
    lines += [f'![{title}]({path})' for title, path in extra_plots]
    lines += ['', f'## Settings ({config.algorithm} and common; `config.json` holds the same)', '']
    lines += [f'- `{name}`: {json.dumps(value)}' for name, value in config.to_dict().items() if name != 'output_dir']
    return '\n'.join(lines) + '\n'
