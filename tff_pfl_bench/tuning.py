"""The tuning protocol of a benchmark suite: trials, the choice on validation, its files and report sections.

A suite with `[tuning]` (`bench_suite`; docs/benchmarks.md, "Tuning
protocol") gives every tuned algorithm the same budget: `trials` combinations
of its `tune` lists (a `Trial` each, per partition), run on the tuning seed.
Each trial is a run of its own (`bench_run` runs, resumes and records it as a
run):

    <output_dir>/runs/<partition>/<algorithm>/trials/<trial slug>/
    <results_dir>/records/<partition>/<algorithm>/trials/<trial slug>.json

When all of an algorithm's trials on a partition are complete, `choice` takes
the trial with the highest validation score (`validation_score`: the
across-client mean validation accuracy at the last round, or at the
validation-selected round, per `[tuning] select`), the first in product
order on ties. It reads the records' validation numbers only
(`validation_view`), never a test number: test accuracy is what the table
reports, so choosing on it would report the best of `trials` draws as if it
were one. The chosen setting then runs on every seed (`bench_suite.Suite.config`
with `tuned`); on the tuning seed that run is the chosen trial, its record
reused.

Every run's record (`bench_record.run_record`) holds, beside the test
`curve`, the validation curve `val_curve` (from the metrics rows'
`val_<model>_accuracy_mean`, written by runs with `eval_validation`),
`selected` (`bench_record.selected_round`: the evaluated round with the highest
validation mean, its validation and test accuracy) and `best_test_round`
(`bench_record.best_test_round`: the best round on test; optimistic).

Written with the report (`bench_report.write_report`):

    <output_dir>/tuning.csv    one row per trial (`tuning_rows`): partition, algorithm,
                               trial, each tuned setting, val_last, val_selected (%),
                               selected_round, chosen (yes / no; blank before the choice)
    <output_dir>/tuning.json   partition -> algorithm -> the chosen settings

and the report's "Tuning" section (`tuning_lines`: validation scores only)
and the test accuracy at the validation-selected round (`selection_lines`,
from `selection_columns` in summary.csv).
"""

import collections
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence

from tff_pfl import reports
from tff_pfl.program import run_config
from tff_pfl_bench import bench_layout, bench_suite

# summary.csv's columns of `selection_columns`, in %: the mean over seeds of the test accuracy at the
# validation-selected round, its std over seeds, the mean selected round, and the mean over seeds of the
# best test accuracy over the evaluated rounds (optimistic: the round is chosen on test).
SUMMARY_COLUMNS = (
    'selected_test_accuracy_mean',
    'selected_test_accuracy_std_over_seeds',
    'selected_round_mean',
    'best_test_accuracy_mean_optimistic',
)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One combination of a tuned algorithm's `tune` lists on one partition, run on the tuning seed.

    It has `bench_suite.Run`'s attributes, so `bench_run` runs and records it as a run.

    Attributes:
      partition: the partition entry.
      algorithm: the (tuned) algorithm entry.
      seed: the tuning seed.
      index: its place in product order (0: the first).
      values: `((setting, value), ...)`, in the `tune` table's order.
    """

    partition: bench_suite.PartitionEntry
    algorithm: bench_suite.AlgorithmEntry
    seed: int
    index: int
    values: tuple

    @property
    def settings(self) -> dict:
        """The trial's settings: `setting -> value`."""
        return dict(self.values)

    @property
    def slug(self) -> str:
        """The trial's directory name (`bench_suite.trial_slug`): `client_learning_rate-0.01-ditto_lambda-0.1`."""
        return bench_suite.trial_slug(self.values)

    @property
    def label(self) -> str:
        """`<partition>/<algorithm>/trials/<slug>`, with the entries' labels."""
        return f'{self.partition.name}/{self.algorithm.name}/trials/{self.slug}'

    def directory(self, output_dir: str) -> str:
        """`<output_dir>/runs/<partition>/<algorithm>/trials/<slug>`.

        Args:
          output_dir: the suite's output directory.

        Returns:
          The trial's run directory, with the entries' slugs.
        """
        return os.path.join(
            output_dir, 'runs', self.partition.slug, self.algorithm.slug, bench_layout.TRIALS_DIR, self.slug
        )


def trials(suite: bench_suite.Suite) -> list[Trial]:
    """Every trial of a suite: partition-major, then algorithm (file order), then product order.

    Args:
      suite: the suite.

    Returns:
      A `Trial` per (partition, tuned algorithm, combination); empty without `[tuning]`.
    """
    if suite.tuning is None:
        return []
    return [
        Trial(p, a, suite.tuning.seed, i, values)
        for p in suite.partitions
        for a in suite.algorithms
        for i, values in enumerate(a.combinations())
    ]


def select_trials(
    suite: bench_suite.Suite,
    *,
    seeds: Sequence[int] | None = None,
    algorithms: Sequence[str] | None = None,
    partitions: Sequence[str] | None = None,
) -> list[Trial]:
    """The trials of a selection (`Suite.select`'s arguments): none when `seeds` leaves out the tuning seed.

    Args:
      suite: the suite.
      seeds: seeds to run; None: all of the suite's.
      algorithms: algorithm labels; None: all.
      partitions: partition labels; None: all.

    Returns:
      The selected trials, in `trials()` order.
    """
    return [
        trial
        for trial in trials(suite)
        if (seeds is None or trial.seed in seeds)
        and (algorithms is None or trial.algorithm.name in algorithms)
        and (partitions is None or trial.partition.name in partitions)
    ]


def trial_config(suite: bench_suite.Suite, trial: Trial, output_dir: str = '') -> run_config.ExperimentConfig:
    """A trial's configuration: its run's on the tuning seed, updated by the trial's values.

    Args:
      suite: the suite.
      trial: one of `trials(suite)`.
      output_dir: the trial's directory.

    Returns:
      `suite.config(..., tuned=trial.settings)`.
    """
    return suite.config(trial.partition, trial.algorithm, trial.seed, output_dir, tuned=trial.settings)


# ----------------------------------------------------------------------------
# The choice: validation numbers only.


def validation_view(record: Mapping) -> dict:
    """What the choice may read of a trial's record: its validation numbers, and no test number.

    Args:
      record: a trial's `bench_result.json` record.

    Returns:
      `final_round`, `val_curve` and the validation-selected round and
      accuracy (`selected_round`, `selected_val_accuracy`; None without a
      validation curve).
    """
    selected = record.get('selected') or {}
    return {
        'final_round': record['final_round'],
        'val_curve': [dict(p) for p in record.get('val_curve') or ()],
        'selected_round': selected.get('round'),
        'selected_val_accuracy': selected.get('val_accuracy'),
    }


def validation_score(view: Mapping, select: str) -> float | None:
    """A trial's score: its across-client mean validation accuracy (a fraction).

    Args:
      view: `validation_view(record)`.
      select: 'last', the accuracy at the run's last round; 'selected', at
        its validation-selected round (`bench_suite.TUNING_SELECT`).

    Returns:
      The score, or None when the record has no validation curve.
    """
    if select == 'selected':
        return view['selected_val_accuracy']
    last = [p['accuracy'] for p in view['val_curve'] if p['round'] == view['final_round']]
    return last[0] if last else None


def choose(scores: Sequence[float | None]) -> int | None:
    """The index of the highest finite score, the first on ties; None when no score is finite.

    Args:
      scores: one per trial, in product order.

    Returns:
      The chosen trial's index.
    """
    best = None
    for i, score in enumerate(scores):
        if score is not None and math.isfinite(score) and (best is None or score > scores[best]):
            best = i
    return best


@dataclasses.dataclass(frozen=True)
class Choice:
    """A tuned algorithm's choice on one partition.

    Attributes:
      trial: the chosen trial.
      scores: every trial's validation score (`validation_score`), in product order.
    """

    trial: Trial
    scores: tuple


def _trial_record(output_dir: str, trial: Trial) -> dict | None:
    text = bench_layout.file_text(os.path.join(trial.directory(output_dir), bench_layout.RESULT_FILE))
    return None if text is None else json.loads(text)


def decide(suite: bench_suite.Suite, mine: Sequence[Trial], views: Sequence[Mapping | None]) -> Choice | None:
    """The choice among an algorithm's trials on a partition, from their validation views.

    Args:
      suite: the suite (its `[tuning] select`).
      mine: the algorithm's trials on the partition, in product order.
      views: `validation_view` of each trial's record; None for a trial not complete.

    Returns:
      The `Choice`, or None while a trial is not complete.

    Raises:
      bench_suite.SuiteError: every trial is complete but none has a validation score.
    """
    if not mine or any(view is None for view in views):
        return None
    scores = tuple(validation_score(view, suite.tuning.select) for view in views)
    index = choose(scores)
    if index is None:
        first = mine[0]
        raise bench_suite.SuiteError(
            f'{first.partition.name}/{first.algorithm.name}: no trial has a finite validation accuracy (records '
            f'without a validation curve: runs with {bench_suite.VALIDATION_SETTING} = true write one)'
        )
    return Choice(mine[index], scores)


def choice(
    suite: bench_suite.Suite,
    output_dir: str,
    partition: bench_suite.PartitionEntry,
    algorithm: bench_suite.AlgorithmEntry,
) -> Choice | None:
    """A tuned algorithm's choice on a partition, from its trials' records in `output_dir`.

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.
      partition: the partition entry.
      algorithm: a tuned algorithm entry.

    Returns:
      `decide`'s choice; None while a trial is not complete.
    """
    mine = [t for t in trials(suite) if t.partition is partition and t.algorithm is algorithm]
    records = [_trial_record(output_dir, t) for t in mine]
    return decide(suite, mine, [None if r is None else validation_view(r) for r in records])


# ----------------------------------------------------------------------------
# tuning.csv, tuning.json and the report's sections.


def _value_text(value):
    return json.dumps(list(value)) if isinstance(value, tuple) else value


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _decisions(suite: bench_suite.Suite, output_dir: str):
    """(partition, algorithm, its trials, their validation views, the choice or None) per tuned cell."""
    for partition in suite.partitions:
        for algorithm in suite.algorithms:
            if not algorithm.tune:
                continue
            mine = [t for t in trials(suite) if t.partition is partition and t.algorithm is algorithm]
            views = [_trial_record(output_dir, t) for t in mine]
            views = [None if r is None else validation_view(r) for r in views]
            try:
                decided = decide(suite, mine, views)
            except bench_suite.SuiteError:  # no validation scores: the report says so, the run loop refuses
                decided = None
            yield partition, algorithm, mine, views, decided


def tuning_rows(suite: bench_suite.Suite, output_dir: str) -> list[dict]:
    """One row per trial of the suite: its settings, validation scores and whether it was chosen.

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.

    Returns:
      Rows in `trials()` order: `partition`, `algorithm`, `trial` (slug),
      every tuned setting of the suite (blank where the algorithm does not
      tune it), `val_last` and `val_selected` (%; blank while the trial is not
      complete or has no validation curve), `selected_round`, `chosen`
      ('yes' / 'no'; blank while the algorithm has no choice), and
      `complete` (the trial has its record; not a column of tuning.csv). No
      test number.
    """
    keys = list(dict.fromkeys(key for a in suite.algorithms for key, _ in a.tune))
    rows = []
    for partition, algorithm, mine, views, decided in _decisions(suite, output_dir):
        for trial, view in zip(mine, views):
            row = collections.OrderedDict(partition=partition.name, algorithm=algorithm.name, trial=trial.slug)
            row.update((key, _value_text(trial.settings[key]) if key in trial.settings else None) for key in keys)
            row.update(
                val_last=None if view is None else _percent(validation_score(view, 'last')),
                val_selected=None if view is None else _percent(validation_score(view, 'selected')),
                selected_round=None if view is None else view['selected_round'],
                chosen=None if decided is None else ('yes' if decided.trial == trial else 'no'),
                complete=view is not None,
            )
            rows.append(row)
    return rows


def write_files(suite: bench_suite.Suite, output_dir: str) -> list[dict]:
    """Writes tuning.csv and tuning.json into `output_dir` (a suite with `[tuning]` only).

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.

    Returns:
      `tuning_rows`; empty (nothing written) without `[tuning]`.
    """
    if suite.tuning is None:
        return []
    rows = tuning_rows(suite, output_dir)
    chosen = collections.OrderedDict()
    for partition, algorithm, _, _, decided in _decisions(suite, output_dir):
        if decided is not None:
            chosen.setdefault(partition.name, collections.OrderedDict())[algorithm.name] = {
                key: list(value) if isinstance(value, tuple) else value for key, value in decided.trial.values
            }
    reports.write_csv(os.path.join(output_dir, bench_layout.TUNING_CSV), [_csv_row(row) for row in rows])
    reports.write_text_atomic(os.path.join(output_dir, bench_layout.TUNING_JSON), json.dumps(chosen, indent=1) + '\n')
    return rows


def _csv_row(row: Mapping) -> dict:
    return {k: v for k, v in row.items() if k != 'complete'}


def _cell(value: float | None) -> str:
    return '' if value is None else f'{value:.2f}'


def tuning_lines(suite: bench_suite.Suite, rows: Sequence[Mapping]) -> list[str]:
    """The report's "Tuning" section: the budget, each partition's trials with their validation scores.

    Args:
      suite: the suite.
      rows: `tuning_rows(...)`.

    Returns:
      The lines; empty without `[tuning]`. No test number: the chosen
      setting's test accuracy is in the other tables, as every run's.
    """
    if suite.tuning is None:
        return []
    select = {
        'last': 'at the last round',
        'selected': 'at its validation-selected round (the evaluated round where it is highest)',
    }[suite.tuning.select]
    lines = [
        '## Tuning',
        '',
        f'Budget: {suite.tuning.trials} trials for every tuned algorithm (the product of its `tune` lists), each run',
        f'on seed {suite.tuning.seed}. The choice is the trial with the highest mean validation accuracy across',
        f'clients {select} (`select = "{suite.tuning.select}"`), the first in product order on ties; it reads no',
        'test number. The chosen setting runs on every seed; on the tuning seed that run is the chosen trial.',
        'val last / val selected: mean validation accuracy across clients (%) at the last round / at the',
        'validation-selected round.',
        '',
    ]
    keys = list(dict.fromkeys(key for a in suite.algorithms for key, _ in a.tune))
    for partition in suite.partitions:
        mine = [row for row in rows if row['partition'] == partition.name]
        table = []
        for row in mine:
            entry = {'algorithm': row['algorithm'], 'trial': row['trial']}
            entry.update((key, '' if row[key] is None else str(row[key])) for key in keys)
            round_text = '' if row['selected_round'] is None else f' (round {row["selected_round"]})'
            entry['val last'] = _cell(row['val_last'])
            entry['val selected'] = _cell(row['val_selected']) + ('' if row['val_selected'] is None else round_text)
            entry['chosen'] = {'yes': '**chosen**', 'no': '', None: ''}[row['chosen']]
            table.append(entry)
        used = [key for key in keys if any(row[key] is not None for row in mine)]
        lines += [f'### {partition.name}', '']
        if table:
            columns = ['algorithm', 'trial', *used, 'val last', 'val selected', 'chosen']
            lines += [reports.markdown_table(table, columns), '']
        for algorithm in suite.algorithms:
            done = [row for row in mine if row['algorithm'] == algorithm.name]
            complete = sum(row['complete'] for row in done)
            if algorithm.tune and complete < len(done):
                lines.append(f'- {algorithm.name}: {complete} of {len(done)} trials complete; no choice yet.')
            elif algorithm.tune and any(row['chosen'] is None for row in done):
                lines.append(f'- {algorithm.name}: no choice: no trial has a validation accuracy.')
            elif algorithm.untuned:
                lines.append(f'- {algorithm.name}: untuned ({algorithm.untuned}).')
        lines.append('')
    return lines


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
      rows: `bench_aggregate.aggregate`'s rows (with `SUMMARY_COLUMNS`).

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
