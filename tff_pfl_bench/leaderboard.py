"""A leaderboard's measure beside ours: the report section of a suite whose paper reports the best round on test.

Published leaderboards (PFLlib's, e.g.) report, for each method, the highest
mean test accuracy over the evaluated rounds: the round is chosen on the test
data, so the number is optimistic. A suite that reproduces such a table says so
in its `[paper_source]` (`measure = "best round on test"`), and its report then
holds this section: for each (algorithm, partition), the paper's number, ours
by the same measure, and ours by the honest ones (the last round, and the round
chosen on validation), each as a mean ± std over seeds, with the rounds run,
the minutes a run took, and whether the method was still climbing when the run
stopped, read from the seed-mean test curve.
"""

import collections
import statistics
from collections.abc import Mapping, Sequence

from tff_pfl import reports

# What a `[paper]` number measures (`[paper_source] measure`): the suite's model at the last round (the
# default, what every other table of the report gives), or the best evaluated round on test.
PAPER_MEASURES = ('last round', 'best round on test')
BEST_ROUND = PAPER_MEASURES[1]
# "Still climbing": the seed-mean test accuracy at the last evaluated round exceeds the one at the evaluated
# round closest to (1 - CLIMB_SHARE) x the last round by more than CLIMB_POINTS points.
CLIMB_SHARE = 0.25
CLIMB_POINTS = 0.5

COLUMNS = (
    'algorithm',
    'partition',
    'runs',
    'paper',
    'best round on test',
    'diff',
    'last round',
    'validation-selected round',
    'rounds run',
    'minutes a run',
    'still climbing',
)


def _mean_std(values: Sequence[float]) -> str:
    """'m ± s' over seeds (s: n - 1), 'm' for one value, '' for none."""
    if not values:
        return ''
    text = f'{statistics.fmean(values):.2f}'
    return text + (f' ± {statistics.stdev(values):.2f}' if len(values) >= 2 else '')


def climbing(curves: Sequence[Sequence[Mapping]]) -> tuple[bool, float, int, int] | None:
    """Whether the seed-mean test curve still rises over its last quarter.

    Args:
      curves: each seed's test curve, `[{'round', 'accuracy'}, ...]` (accuracy in [0, 1]).

    Returns:
      `(climbing, rise in points, from round, to round)`: the rise of the mean over seeds of the accuracy
      from the evaluated round closest to (1 - `CLIMB_SHARE`) x the last one (among the rounds every seed
      evaluated) to the last; climbing when the rise exceeds `CLIMB_POINTS`. None: fewer than two rounds
      common to every seed.
    """
    by_round = collections.defaultdict(list)
    for curve in curves:
        for point in curve or ():
            by_round[point['round']].append(point['accuracy'])
    common = sorted(r for r, values in by_round.items() if len(values) == len(curves))
    if len(common) < 2:
        return None
    last = common[-1]
    start = min(common[:-1], key=lambda r: (abs(r - (1 - CLIMB_SHARE) * last), r))
    rise = 100 * (statistics.fmean(by_round[last]) - statistics.fmean(by_round[start]))
    return rise > CLIMB_POINTS, rise, start, last


def leaderboard_rows(suite, records: Sequence[Mapping]) -> list[dict]:
    """The section's rows, in the suite's (partition, algorithm) order; one per pair with a complete run.

    Args:
      suite: the suite (`bench_suite.Suite`): its partitions, algorithms, seeds and `[paper]`.
      records: the complete runs' records (`bench_aggregate.load_results`), each with its `Run`.

    Returns:
      Dicts with `COLUMNS` as keys, formatted for the table.
    """
    cells = collections.defaultdict(list)
    for record in records:
        cells[(record['run'].partition.name, record['run'].algorithm.name)].append(record)
    rows = []
    for partition in suite.partitions:
        for algorithm in suite.algorithms:
            mine = cells.get((partition.name, algorithm.name))
            if not mine:
                continue
            best = [100 * r['best_test_round']['test_accuracy'] for r in mine if r.get('best_test_round')]
            last = [r['summary'][r['model']]['mean'] * 100 for r in mine]
            selected = [
                100 * r['selected']['test_accuracy']
                for r in mine
                if r.get('selected') and r['selected'].get('test_accuracy') is not None
            ]
            cell = suite.paper.get(algorithm.name, {}).get(partition.name) or {}  # metric -> (value, std)
            paper_mean = cell['mean'][0] if 'mean' in cell else None
            diff = ''
            if paper_mean is not None and len(best) == len(mine):
                diff = f'{statistics.fmean(best) - paper_mean:+.2f}'
            climb = climbing([r.get('curve') for r in mine])
            rounds = sorted({int(r.get('final_round', r.get('rounds', 0))) for r in mine})
            rows.append(
                {
                    'algorithm': algorithm.name,
                    'partition': partition.name,
                    'runs': f'{len(mine)}/{len(suite.seeds)}',
                    'paper': '' if paper_mean is None else f'{paper_mean:.2f}',
                    'best round on test': _mean_std(best) if len(best) == len(mine) else '',
                    'diff': diff,
                    'last round': _mean_std(last),
                    'validation-selected round': _mean_std(selected) if len(selected) == len(mine) else '',
                    'rounds run': ' / '.join(str(r) for r in rounds),
                    'minutes a run': f'{statistics.fmean(r["seconds"] for r in mine) / 60:.0f}',
                    'still climbing': ''
                    if climb is None
                    else f'{"yes" if climb[0] else "no"} ({climb[1]:+.2f} from round {climb[2]} to {climb[3]})',
                }
            )
    return rows


def leaderboard_lines(suite, records: Sequence[Mapping]) -> list[str]:
    """The report's section; empty unless the suite's paper reports the best round on test.

    Args:
      suite: the suite.
      records: the complete runs' records.

    Returns:
      The section's lines.
    """
    if getattr(suite, 'paper_measure', PAPER_MEASURES[0]) != BEST_ROUND or not records:
        return []
    return [
        "## Leaderboard: the paper's measure beside ours (%)",
        '',
        'The paper reports the best round on test: the highest across-client mean test accuracy over the',
        'evaluated rounds, a round chosen on the test data (optimistic). Ours by that measure, and by the',
        "last round and the round chosen on validation (each run's own choice), each the mean over seeds ±",
        'the std over seeds; diff: ours (best round on test) - paper. Rounds run, and the minutes a run took',
        '(mean over seeds, across sittings). Still climbing: the seed-mean test accuracy rose more than',
        f'{CLIMB_POINTS} points over the last {CLIMB_SHARE:.0%} of the rounds (from the evaluated round closest',
        'to it).',
        '',
        reports.markdown_table(leaderboard_rows(suite, records), list(COLUMNS)),
        '',
    ]
