"""The scoreboard: every paper number the benchmark suites target, next to ours.

    uv run --locked python -m tff_pfl_bench.scoreboard           # writes docs/reports/scoreboard.md
    uv run --locked python -m tff_pfl_bench.scoreboard --check   # exit 1 if that file is out of date

Run from the repository root. Reads every `benchmarks/suites/*.toml` that has a
`[paper]` table (`bench_suite`) and the suite's committed results,
`benchmarks/results/<name>_suite/` (`summary.csv`, `commands.txt`,
`suite.toml`: a copy of a `tff-pfl-bench` output directory without its
`runs/`), and writes one row per paper number: the paper (the suite's
`[paper_source]`), dataset and partition, algorithm, metric, the paper's
value, ours (mean ± std over seeds, from `summary.csv`), the seeds complete,
the difference, whether it is within 2 points, and the commands that
produced it (`commands.txt`). A number whose cell has no committed result is
a "not run yet" row. A number the suite's `[paper_errors]` marks as the
paper's own error says so, with the reason, and is left out of the counts.
Suites without a `[paper]` table follow in a short
list (what each runs, runs complete, its report). Nothing is run or recomputed: the page only reads
committed files, so `tests/test_scoreboard.py` can check that it is current.

One rule places every suite's results: `<slug of the suite's name>_suite`,
the folder `--results_dir` is given in the suite files and docs. A results
folder holding another name's `suite.toml` would go unread (its suite shown
as not run): `misplaced_results` lists such folders, and the generator
refuses to write the page while there are any.
"""

import csv
import glob
import os
import shlex
import sys
import tomllib
from collections.abc import Mapping, Sequence

# Run as a program, TensorFlow's C++ start-up chatter (the suites import it) is noise.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from tff_pfl import reports, runtime
from tff_pfl_bench import bench_aggregate, bench_layout, bench_parse, bench_suite, leaderboard, tuning

SUITES_DIR = os.path.join('benchmarks', 'suites')
RESULTS_DIR = os.path.join('benchmarks', 'results')
OUTPUT = os.path.join('docs', 'reports', 'scoreboard.md')
# Ours is "within" the paper when |ours - paper| <= TOLERANCE points (%).
TOLERANCE = 2.0
GENERATE = 'uv run --locked python -m tff_pfl_bench.scoreboard'

_METRIC_TEXT = {
    'mean': 'mean',
    'weighted': 'weighted',
    'worst10': 'worst 10%',
    'top10': 'top 10% by samples',
    # A suite whose [paper_source] measure is the best round on test (a leaderboard): ours by that measure.
    'best round': 'mean, best round on test',
}


def results_dir(root: str, suite: bench_suite.Suite) -> str:
    """The suite's committed results: `<root>/benchmarks/results/<slug of its name>_suite`.

    The one place a suite's results are read from and written to (`--results_dir`).

    Args:
      root: the repository root.
      suite: the suite.

    Returns:
      The directory (it may not exist).
    """
    return os.path.join(root, RESULTS_DIR, f'{bench_suite.slug(suite.name)}_suite')


def misplaced_results(root: str) -> list[str]:
    """Results folders the scoreboard would not read: a `suite.toml` elsewhere than its suite's `results_dir`.

    Args:
      root: the repository root.

    Returns:
      One line per folder of `<root>/benchmarks/results/` holding a
      `suite.toml` whose suite has no file in `benchmarks/suites/` or whose
      `results_dir` is another folder, sorted; empty when every committed
      result is read.
    """
    names = {}
    for path in suite_paths(root):
        with open(path, 'rb') as f:
            names[tomllib.load(f).get('name')] = os.path.relpath(path, root)
    problems = []
    for stored in sorted(glob.glob(os.path.join(root, RESULTS_DIR, '*', bench_layout.SUITE_FILE))):
        folder = os.path.relpath(os.path.dirname(stored), root)
        with open(stored, 'rb') as f:
            name = tomllib.load(f).get('name')
        expected = os.path.join(RESULTS_DIR, f'{bench_suite.slug(str(name))}_suite')
        if name not in names:
            problems.append(f'{folder} holds results of suite {name!r}, which has no file in {SUITES_DIR}')
        elif folder != expected:
            problems.append(f'{folder} holds results of {names[name]}, read from {expected}: rename the folder')
    return problems


def suite_paths(root: str) -> list[str]:
    """Every suite file, sorted: `<root>/benchmarks/suites/*.toml`.

    Args:
      root: the repository root.

    Returns:
      The paths.
    """
    directory = os.path.join(root, SUITES_DIR)
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.endswith('.toml'))


def _read_summary(directory: str) -> dict | None:
    path = os.path.join(directory, 'summary.csv')
    if not os.path.exists(path):
        return None
    with open(path, newline='', encoding='utf-8') as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:  # no run complete yet (a sitting that finished only tuning trials)
            return None
        if not {'partition', 'algorithm', 'runs'} <= set(reader.fieldnames):
            raise bench_suite.SuiteError(f'{path}: not a tff-pfl-bench summary.csv (no partition, algorithm, runs)')
        return {(row['partition'], row['algorithm']): row for row in reader}


def _list_values(value: str) -> list[str]:
    """A list flag's values as absl's `DEFINE_list` reads them: CSV, so `"a, b",c` is two labels."""
    return [item.strip() for item in next(csv.reader([value]))]


def _selection(args: Sequence[str], flag: str) -> list[str] | None:
    """The values of `--flag=a,b` (or `--flag a,b`) in a command, or None when absent."""
    for i, arg in enumerate(args):
        if arg.startswith(f'--{flag}='):
            return _list_values(arg.split('=', 1)[1])
        if arg == f'--{flag}' and i + 1 < len(args):
            return _list_values(args[i + 1])
    return None


def covering_commands(commands: Sequence[str], partition: str, algorithm: str) -> list[str]:
    """The recorded invocations whose selection includes (partition, algorithm).

    Args:
      commands: the lines of `commands.txt`.
      partition: a partition label.
      algorithm: an algorithm label.

    Returns:
      The commands without `--partitions`/`--algorithms`, or whose lists hold
      the labels (a command that does not parse is kept), each once, in the
      order of its first invocation (a resumed run repeats its command).
    """
    covering = []
    for command in dict.fromkeys(commands):
        try:
            args = shlex.split(command)
        except ValueError:
            covering.append(command)
            continue
        partitions, algorithms = _selection(args, 'partitions'), _selection(args, 'algorithms')
        if (partitions is None or partition in partitions) and (algorithms is None or algorithm in algorithms):
            covering.append(command)
    return covering


def dataset_label(dataset: str) -> str:
    """A short name of a dataset setting: `npz:../shared/data/mnist.npz` -> `mnist`.

    Args:
      dataset: `ExperimentConfig.dataset`.

    Returns:
      The file or folder name without `.npz` for `npz:`/`folder:` (and bare
      `.npz` paths), the name for `tfds:`, else `dataset` itself.
    """
    kind, _, arg = dataset.partition(':')
    if kind == 'tfds':
        return arg
    if kind in ('npz', 'folder') or dataset.endswith('.npz'):
        path = arg if kind in ('npz', 'folder') else dataset
        name = os.path.basename(path.rstrip('/'))
        return name[: -len('.npz')] if name.endswith('.npz') else name
    return dataset


def _number(row: Mapping, column: str) -> float | None:
    value = row.get(column)
    return None if value in (None, '') else float(value)


def run_command(suite: bench_suite.Suite, suite_path: str) -> str:
    """The command that runs the whole suite, adding to its committed results.

    Args:
      suite: the suite.
      suite_path: its file, relative to the repository root.

    Returns:
      `tff-pfl-bench --suite=... --output_dir=runs/bench/<slug> --results_dir=<results_dir>`.
    """
    output_dir = os.path.join('runs', 'bench', bench_suite.slug(suite.name))
    results = results_dir('', suite)
    return f'tff-pfl-bench --suite={suite_path} --output_dir={output_dir} --results_dir={results}'


def entries(root: str, paths: Sequence[str] | None = None) -> list[dict]:
    """One entry per paper number of the suites, with ours from the committed results.

    Args:
      root: the repository root (results are read below it).
      paths: suite files; default `suite_paths(root)`.

    Returns:
      Dicts, suites in path order, then partition, algorithm (suite order) and
      metric (`bench_suite.PAPER_METRICS` order): `source`, `suite` (name),
      `suite_path` (relative to `root`), `report` (the committed report.md
      relative to `root`, or None), `dataset`, `partition`, `algorithm`,
      `metric`, `paper` (%), `ours` and `ours_std` (% or None), `runs`
      ("complete/seeds"), `status` ('ok', 'not run yet', 'no such column'
      for results written before the metric was reported, 'not available'
      for a blank cell), `stale` (the results' suite.toml gives other runs
      than the suite file), `diff` (ours - paper or None), `within` (bool or
      None), `paper_error` (the suite's `[paper_errors]` reason for the
      cell, or None) and `commands` (the recorded invocations covering the
      cell, or the command to run it when it is not run yet).

    Raises:
      bench_suite.SuiteError: a suite file does not load, or a summary.csv
        is not one.
    """
    result = []
    for path in suite_paths(root) if paths is None else paths:
        suite = bench_parse.load_suite(path)
        if not suite.paper:
            continue
        suite_path = os.path.relpath(path, root)
        directory = results_dir(root, suite)
        summary = _read_summary(directory)
        commands = (bench_layout.file_text(os.path.join(directory, bench_layout.COMMANDS_FILE)) or '').splitlines()
        stale = summary is not None and not bench_suite.same_runs(
            bench_layout.file_text(os.path.join(directory, bench_layout.SUITE_FILE)), suite
        )
        report = os.path.join(directory, 'report.md')
        command = run_command(suite, suite_path)
        for partition in suite.partitions:
            for algorithm in suite.algorithms:
                cell = suite.paper.get(algorithm.name, {}).get(partition.name)
                if not cell:
                    continue
                row = (summary or {}).get((partition.name, algorithm.name))
                dataset = dataset_label(suite.config(partition, algorithm, suite.seeds[0]).data.dataset)
                for metric, (paper, _) in cell.items():
                    column, std_column, _ = bench_aggregate.METRICS[metric]
                    if metric == 'mean' and suite.paper_measure == leaderboard.BEST_ROUND:
                        metric, column, std_column = 'best round', tuning.SUMMARY_COLUMNS[3], None
                    entry = dict(
                        source=suite.paper_source,
                        suite=suite.name,
                        suite_path=suite_path,
                        report=os.path.relpath(report, root) if os.path.exists(report) else None,
                        dataset=dataset,
                        partition=partition.name,
                        algorithm=algorithm.name,
                        metric=metric,
                        paper=paper,
                        ours=None,
                        ours_std=None,
                        runs=f'0/{len(suite.seeds)}',
                        status='not run yet',
                        stale=False,
                        diff=None,
                        within=None,
                        paper_error=suite.paper_errors.get(algorithm.name, {}).get(partition.name),
                        commands=[command],
                    )
                    if row is not None:
                        entry.update(
                            runs=row.get('runs', ''),
                            stale=stale,
                            commands=covering_commands(commands, partition.name, algorithm.name),
                        )
                        if column not in row:
                            entry['status'] = 'no such column'
                        elif _number(row, column) is None:
                            entry['status'] = 'not available'
                        else:
                            ours = _number(row, column)
                            diff = ours - paper
                            entry.update(
                                status='ok',
                                ours=ours,
                                ours_std=_number(row, std_column),
                                diff=diff,
                                within=abs(diff) <= TOLERANCE + 1e-9,
                            )
                    result.append(entry)
    return result


def unscored(root: str, paths: Sequence[str] | None = None) -> list[dict]:
    """One entry per suite without a `[paper]` table: a protocol with no paper number to meet.

    Args:
      root: the repository root (results are read below it).
      paths: suite files; default `suite_paths(root)`.

    Returns:
      Dicts in path order: `suite` (name), `suite_path` (relative to `root`),
      `report` (the committed report.md relative to `root`, or None), `what`
      (the description on one line), `runs` ("complete/total" over the
      committed summary.csv's cells) and `command` (the command that runs the
      suite).

    Raises:
      bench_suite.SuiteError: a suite file does not load, or a summary.csv
        is not one.
    """
    result = []
    for path in suite_paths(root) if paths is None else paths:
        suite = bench_parse.load_suite(path)
        if suite.paper:
            continue
        suite_path = os.path.relpath(path, root)
        directory = results_dir(root, suite)
        summary = _read_summary(directory) or {}
        complete = sum(int(row['runs'].split('/')[0] or 0) for row in summary.values())
        report = os.path.join(directory, 'report.md')
        result.append(
            dict(
                suite=suite.name,
                suite_path=suite_path,
                report=os.path.relpath(report, root) if os.path.exists(report) else None,
                what=' '.join(suite.description.split()),
                runs=f'{complete}/{len(suite.runs())}',
                command=run_command(suite, suite_path),
            )
        )
    return result


def _paper_text(value: float) -> str:
    one = f'{value:.1f}'
    return one if float(one) == round(value, 2) else f'{value:.2f}'


def _ours_text(entry: Mapping) -> str:
    if entry['status'] == 'not run yet':
        return 'not run yet'
    if entry['status'] == 'no such column':
        return 'not in summary.csv (written before this metric was reported)'
    if entry['status'] == 'not available':
        if entry['metric'] == 'best round':
            return 'not available (a run without a validation curve)'
        return 'not available (no partition sizes)'
    if entry['ours_std'] is None:
        return f'{entry["ours"]:.2f}'
    return f'{entry["ours"]:.2f} ± {entry["ours_std"]:.2f}'


def _within_text(entry: Mapping) -> str:
    if entry.get('paper_error'):
        return f'paper error: {entry["paper_error"]}'
    return '' if entry['within'] is None else ('yes' if entry['within'] else 'no')


def _headline(numbers: int, suites: int, errors: int, done: int, within: int, not_run: int) -> str:
    """The page's count line; the paper's own errors are left out of every count after the first."""
    head = f'{numbers} paper numbers from {suites} suite{"s" if suites != 1 else ""}'
    counts = f'{done} with a result, {within} of them within {TOLERANCE:g} points of the paper; {not_run} not run yet.'
    if not errors:
        return f'{head}: {counts}'
    marked = f'{errors} of them {"a paper error" if errors == 1 else "paper errors"}'
    return f'{head}, {marked} (marked below, not counted); of the other {numbers - errors}: {counts}'


def render(items: Sequence[Mapping], others: Sequence[Mapping] = ()) -> str:
    """The scoreboard page.

    Args:
      items: `entries(...)`; paths in them are relative to the repository
        root, and the page's links are made relative to docs/reports/.
      others: `unscored(...)`, listed after the paper numbers.

    Returns:
      The markdown text, ending with a newline.
    """
    suites = list(dict.fromkeys(e['suite'] for e in items))
    errors = [e for e in items if e.get('paper_error')]
    counted = [e for e in items if not e.get('paper_error')]
    done = [e for e in counted if e['status'] == 'ok']
    within = [e for e in done if e['within']]
    not_run = [e for e in counted if e['status'] == 'not run yet']
    link_base = os.path.dirname(OUTPUT)
    rows = []
    for e in items:
        if e['report'] is not None:
            suite = f'[{e["suite"]}]({os.path.relpath(e["report"], link_base)})'
        else:
            suite = f'{e["suite"]} (`{e["suite_path"]}`)'
        runs = e['runs'] + (' (results of an older suite.toml)' if e['stale'] else '')
        prefix = 'to run: ' if e['status'] == 'not run yet' else ''
        rows.append(
            {
                'paper / table': e['source'] or '(no [paper_source])',
                'suite': suite,
                'dataset / partition': f'{e["dataset"]} / {e["partition"]}',
                'algorithm': e['algorithm'],
                'metric': _METRIC_TEXT[e['metric']],
                'paper': _paper_text(e['paper']),
                'ours': _ours_text(e),
                'seeds': runs,
                'diff': '' if e['diff'] is None else f'{e["diff"]:+.2f}',
                f'within {TOLERANCE:g}': _within_text(e),
                'command': '<br>'.join(f'{prefix}`{c}`' for c in e['commands']),
            }
        )
    columns = [
        'paper / table',
        'suite',
        'dataset / partition',
        'algorithm',
        'metric',
        'paper',
        'ours',
        'seeds',
        'diff',
        f'within {TOLERANCE:g}',
        'command',
    ]
    lines = [
        '# Scoreboard: ours vs the papers',
        '',
        f'Generated by `{GENERATE}` from every `benchmarks/suites/*.toml`',
        'with a `[paper]` table and its committed results `benchmarks/results/<suite name>_suite/` (`summary.csv`,',
        '`commands.txt`, `suite.toml`); do not edit it by hand: `tests/test_scoreboard.py` fails when it is not',
        'current. The suite format and the metrics:',
        '[docs/benchmarks.md](../benchmarks.md#paper-numbers-and-the-scoreboard).',
        '',
        _headline(len(items), len(suites), len(errors), len(done), len(within), len(not_run)),
        '',
        'All values are test accuracy in %. metric: mean, the mean over clients; weighted, the mean weighted by',
        "each client's examples (train + val + test); worst 10%, the mean of the ceil(0.1 N) worst of N clients;",
        'top 10% by samples, the sample-weighted mean of the ceil(0.1 N) clients with the most examples. ours:',
        'mean over seeds ± std over seeds (n - 1) of that metric; seeds: runs complete / seeds of the suite;',
        f'diff: ours - paper; within {TOLERANCE:g}: |diff| <= {TOLERANCE:g}, or "paper error" and why, for a number',
        "the suite's `[paper_errors]` marks as the paper's own mistake (left out of the counts above). command: the",
        "recorded invocations that cover the row's partition and algorithm (`commands.txt`), each once, or, for a row",
        'not run yet, the command to run.',
        '',
        reports.markdown_table(rows, columns) if rows else '(no suite has a [paper] table)',
    ]
    if others:
        table = [
            {
                'suite': f'[{o["suite"]}]({os.path.relpath(o["report"], link_base)})'
                if o['report']
                else f'{o["suite"]} (`{o["suite_path"]}`)',
                'what it runs': o['what'],
                'runs complete': o['runs'],
                'command': f'`{o["command"]}`',
            }
            for o in others
        ]
        lines += [
            '',
            '## Suites without a paper number',
            '',
            "A paper's protocol on data or settings the paper did not report, or a comparison of our own: there is",
            "no published number to meet. Each suite's report gives every algorithm's result; runs complete counts",
            'the runs in its committed results.',
            '',
            reports.markdown_table(table, ['suite', 'what it runs', 'runs complete', 'command']),
        ]
    return '\n'.join(lines) + '\n'


def generate(root: str = '.') -> str:
    """The scoreboard of the tree at `root`.

    Args:
      root: the repository root.

    Returns:
      `render(entries(root), unscored(root))`.
    """
    return render(entries(root), unscored(root))


def main(argv: Sequence[str]) -> int:
    """Writes docs/reports/scoreboard.md, or with `--check` compares it.

    Args:
      argv: the command line without the program name: empty or `--check`.

    Returns:
      The exit code: 0, 1 when `--check` finds the page out of date, 2 on bad
      input or a misplaced results folder (`misplaced_results`; one line on
      stderr).
    """
    prog = 'scoreboard'
    if any(arg not in ('--check',) for arg in argv):
        print(f'{prog}: error: unexpected arguments: {" ".join(argv)} (only --check)', file=sys.stderr)
        return 2
    if not os.path.isdir(SUITES_DIR):
        print(f'{prog}: error: {SUITES_DIR} not found; run from the repository root', file=sys.stderr)
        return 2
    try:
        misplaced = misplaced_results('.')
        if misplaced:
            raise bench_suite.SuiteError(f'results the scoreboard would not read: {"; ".join(misplaced)}')
        items, others = entries('.'), unscored('.')
    except (bench_suite.SuiteError, tomllib.TOMLDecodeError) as e:
        print(f'{prog}: error: {" ".join(str(e).split())}', file=sys.stderr)
        return 2
    text = render(items, others)
    if '--check' in argv:
        current = bench_layout.file_text(OUTPUT)
        if current != text:
            print(f'{prog}: {OUTPUT} is out of date; rerun: {GENERATE}', file=sys.stderr)
            return 1
        print(f'{OUTPUT} is current')
        return 0
    reports.write_text_atomic(OUTPUT, text)
    print(f'wrote {OUTPUT} ({len(items)} paper numbers)')
    return 0


if __name__ == '__main__':
    # Importing TFF made its own local execution context; dropped now, while the interpreter is
    # whole, its clean-up never prints 'Exception ignored in ... ServiceManager.__del__' at exit.
    runtime.refuse_implicit_runtime()
    sys.exit(main(sys.argv[1:]))
