"""The test accuracy at the validation-selected round: summary.csv's columns and the report's section.

Every run's record (`bench_run._bench_result`) holds, beside the test
`curve`, the validation curve `val_curve` (from the metrics rows'
`val_<model>_accuracy_mean`, written by runs with `eval_validation`),
`selected` (`bench_run.selected_round`: the evaluated round with the highest
validation mean, its validation and test accuracy) and `best_test_round`
(`bench_run.best_test_round`: the best round on test; optimistic).
summary.csv gets `SUMMARY_COLUMNS` (`selection_columns`) and the report a
table of the test accuracy at the last and at the validation-selected round
(`selection_lines`).
"""

import statistics
from collections.abc import Mapping, Sequence

from tff_pfl import reports

# summary.csv's columns of `selection_columns`, in %: the mean over seeds of the test accuracy at the
# validation-selected round, its std over seeds, the mean selected round, and the mean over seeds of the
# best test accuracy over the evaluated rounds (optimistic: the round is chosen on test).
SUMMARY_COLUMNS = (
    'selected_test_accuracy_mean',
    'selected_test_accuracy_std_over_seeds',
    'selected_round_mean',
    'best_test_accuracy_mean_optimistic',
)


def _cell(value: float | None) -> str:
    return '' if value is None else f'{value:.2f}'


def selection_columns(records: Sequence[Mapping]) -> dict:
    """summary.csv's `SUMMARY_COLUMNS` of one (partition, algorithm), in %.

    Args:
      records: the cell's records.

    Returns:
      The mean over seeds of the test accuracy at the validation-selected
      round, its std over seeds (n - 1), the mean selected round, and the
      mean over seeds of the best test accuracy over the evaluated rounds;
      every one None unless each record has a validation curve.
    """
    selected = [r.get('selected') for r in records]
    best = [r.get('best_test_round') for r in records]
    if (
        not records
        or any(s is None or s.get('test_accuracy') is None for s in selected)
        or any(b is None for b in best)
    ):
        return dict.fromkeys(SUMMARY_COLUMNS)
    tests = [100 * s['test_accuracy'] for s in selected]
    return dict(
        zip(
            SUMMARY_COLUMNS,
            (
                statistics.fmean(tests),
                statistics.stdev(tests) if len(tests) >= 2 else None,
                statistics.fmean(s['round'] for s in selected),
                statistics.fmean(100 * b['test_accuracy'] for b in best),
            ),
        )
    )


def selection_lines(rows: Sequence[Mapping]) -> list[str]:
    """The report's table of the test accuracy at the last and at the validation-selected round.

    Args:
      rows: `bench_report.aggregate`'s rows (with `SUMMARY_COLUMNS`).

    Returns:
      The section's lines; empty when no row has a validation curve.
    """
    if not any(row.get(SUMMARY_COLUMNS[0]) is not None for row in rows):
        return []
    table = []
    for row in rows:
        mean, std, selected, best = (row.get(column) for column in SUMMARY_COLUMNS)
        last = _cell(row['accuracy_mean'])
        if row['accuracy_std_over_seeds'] is not None:
            last += f' ± {row["accuracy_std_over_seeds"]:.2f}'
        table.append(
            {
                'algorithm': row['algorithm'],
                'partition': row['partition'],
                'runs': row['runs'],
                'last round': last,
                'validation-selected round': _cell(mean) + ('' if std is None else f' ± {std:.2f}'),
                'selected round': '' if selected is None else f'{selected:.1f}',
                'best round on test (optimistic)': _cell(best),
            }
        )
    columns = [
        'algorithm',
        'partition',
        'runs',
        'last round',
        'validation-selected round',
        'selected round',
        'best round on test (optimistic)',
    ]
    return [
        '## Test accuracy at the validation-selected round (%)',
        '',
        "Mean over seeds ± std over seeds of the across-client mean test accuracy of the algorithm's model:",
        'at the last round (the other tables), and at the evaluated round where the mean validation accuracy',
        "is highest (each run's own choice, the earliest on ties); selected round: its mean over seeds. Best",
        'round on test: the highest test accuracy over the evaluated rounds, mean over seeds; the round is',
        'chosen on test, so the number is optimistic, shown only beside the validation-selected one. Blank:',
        'records without a validation curve.',
        '',
        reports.markdown_table(table, columns),
        '',
    ]
