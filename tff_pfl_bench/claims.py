"""The claims table: each paper's headline orderings, checked seed by seed on the committed runs.

    uv run --locked python -m tff_pfl_bench.claims           # writes docs/reports/claims.md
    uv run --locked python -m tff_pfl_bench.claims --check   # exit 1 if that file is out of date

Run from the repository root. Reads `benchmarks/claims.toml`, the suites it
names (`benchmarks/suites/*.toml`, found by their `name`) and their committed
run records (`benchmarks/results/<name>_suite/records/`, read with
`bench_aggregate.load_records`), and writes one page. Nothing is run: the page
only reads committed files, so `tests/test_claims.py` can check that it is
current.

A claim is an ordering a paper reports: `better` beats `worse` by the paper's
margin (points of test accuracy) on each partition it names. Ours is the
paired difference better - worse of the across-client mean test accuracy,
seed by seed (same partition, initial weights and client sampling), with the
per-client view of the same pairs (on how many clients `better` is higher,
lower, equal). A claim may carry *settings*: the same comparison under
another setting (a reading of the paper's algorithm box, a cause tested),
in the same or another suite. The verdict (`verdict`): reproduced when the
claim's own difference is positive in every seed of every partition it names;
reproduced under setting S when it is not, but S's is on every partition S
covers; not reproduced otherwise, with the settings tested and their mean
margins.

The claims file's format and its validation: `claims_spec`; the pairing and
the verdicts: `claims_verdict`; this module writes the page.
"""

import os
import sys
from collections.abc import Mapping, Sequence

# Run as a program, TensorFlow's C++ start-up chatter (the suites import it) is noise.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from tff_pfl import reports, runtime
from tff_pfl_bench import bench_layout, bench_suite, scoreboard
from tff_pfl_bench.claims_spec import (  # noqa: F401 (the names users and tests reach through claims)
    CLAIMS_FILE,
    MEASURES,
    Claim,
    ClaimsError,
    Comparison,
    load_claims,
    parse_claims,
)
from tff_pfl_bench.claims_verdict import (  # noqa: F401 (likewise)
    MIN_SEEDS,
    TIE,
    evaluate,
    known_diffs,
    measure_value,
    pair,
    signed,
    verdict,
)

OUTPUT = os.path.join('docs', 'reports', 'claims.md')
GENERATE = 'uv run --locked python -m tff_pfl_bench.claims'

# ----------------------------------------------------------------------------
# The page.


def margin_text(margin: float | str) -> str:
    """A paper's margin as the page shows it: `+2.3`, `+7.46`, or the string.

    Args:
      margin: points, or the claims file's string.

    Returns:
      The number signed, one decimal unless it has two, or the string.
    """
    if isinstance(margin, str):
        return margin
    one = f'{margin:+.1f}'
    return one if float(one) == round(margin, 2) else f'{margin:+.2f}'


def seeds_text(part: Mapping) -> str:
    """Each paired seed's difference, in seed order: `+0.41 / +0.12 / -0.05`.

    Args:
      part: a `pair(...)` result.

    Returns:
      The differences joined by ' / ' (`0.00` for a tie, 'n/a' for a seed
      without the measure), or '' when no seed is paired.
    """
    return ' / '.join('n/a' if part['diffs'][s] is None else signed(part['diffs'][s]) for s in part['seeds'])


def _ours_text(part: Mapping) -> str:
    if part['status'] != 'ok':
        return f'{part["partition"]} {part["status"]}'
    return f'{part["partition"]} {signed(part["mean"])} ({seeds_text(part)})'


def _paper_margin_text(item: Mapping, partition: str) -> str:
    text = margin_text(item['claim'].paper_margin[partition])
    reasons = item['paper_errors'].get(partition)
    return f'{text} (paper error: {"; ".join(reasons)})' if reasons else text


def _suite_link(entry: Mapping) -> str:
    suite = entry['comparison'].suite
    if entry['report'] is None:
        text = f'{suite.name} (`{entry["comparison"].suite_path}`)'
    else:
        text = f'[{suite.name}]({os.path.relpath(entry["report"], os.path.dirname(OUTPUT))})'
    other = entry['comparison'].worse_suite
    if other is not None:
        text += f'; "{entry["comparison"].worse}" from {other.name}'
    return text + (' (results of an older suite.toml)' if entry['stale'] else '')


def _count(n: int, noun: str) -> str:
    return f'{n} {noun}{"" if n == 1 else "s"}'


def _kind(verdict_text: str) -> str:
    for kind in ('reproduced under', 'reproduced', 'not reproduced'):
        if verdict_text.startswith(kind):
            return kind
    return 'not run yet'


def render(items: Sequence[Mapping]) -> str:
    """The claims page.

    Args:
      items: `evaluate(...)`; paths in them are relative to the repository
        root, and the page's links are made relative to docs/reports/.

    Returns:
      The markdown text, ending with a newline.
    """
    papers = list(dict.fromkeys(item['claim'].paper for item in items))
    kinds = [_kind(item['verdict']) for item in items]
    lines = [
        "# Claims: the papers' orderings, seed by seed",
        '',
        f'Generated by `{GENERATE}` from `{CLAIMS_FILE}`, the suites it',
        'names and their committed run records (`benchmarks/results/<suite name>_suite/records/`); do not edit it',
        'by hand: `tests/test_claims.py` fails when it is not current. The format and the rules:',
        '[docs/benchmarks.md](../benchmarks.md#claims).',
        '',
        f'{_count(len(items), "claim")} from {_count(len(papers), "paper")}: '
        f'{kinds.count("reproduced")} reproduced, {kinds.count("reproduced under")} reproduced under a setting, '
        f'{kinds.count("not reproduced")} not reproduced, {kinds.count("not run yet")} not run yet.',
        '',
        "A claim: `better` beats `worse` by the paper's margin (points of test accuracy) on each partition it",
        'names. Ours: the paired difference better - worse of the across-client mean test accuracy (%) of the',
        "model each algorithm's suite reports, at the last round unless the claim says otherwise, seed by seed",
        "(the same partition, initial weights and client sampling): the mean over seeds, then each seed's",
        'difference in seed order (`0.00`: a tie). Clients: over the paired seeds, on how many clients `better`',
        'scores higher, lower, the same (clients matched by id). Verdict: **reproduced** when the difference is',
        f'positive in every seed of every partition the claim names (with fewer than {MIN_SEEDS} seeds, it says how',
        "many); **reproduced under setting S** when the claim's own comparison is not, but S's is, on every",
        'partition S covers; **not reproduced** otherwise, with every setting tested and its mean margins; **not',
        "run yet** when a suite has no committed runs to pair. The verdict reads the signs only: the paper's",
        "margin is there to compare with ours. A paper margin resting on a number the claim's suite marks as the",
        "paper's own error (`[paper_errors]`) says so.",
        '',
        '## Summary',
        '',
    ]
    rows = [
        {
            'paper': f'{item["claim"].paper}, {item["claim"].source}',
            'claim': item['claim'].claim,
            'paper margin': '<br>'.join(f'{p} {_paper_margin_text(item, p)}' for p in item['claim'].paper_margin),
            'ours: mean (per seed)': '<br>'.join(_ours_text(part) for part in item['comparisons'][0]['parts']),
            'verdict': item['verdict'],
        }
        for item in items
    ]
    lines.append(reports.markdown_table(rows, list(rows[0]) if rows else ['paper']) if rows else '(no claims)')
    for paper in papers:
        lines += ['', f'## {paper}']
        for item in (i for i in items if i['claim'].paper == paper):
            lines += _claim_section(item)
    return '\n'.join(lines) + '\n'


def _claim_section(item: Mapping) -> list[str]:
    claim = item['claim']
    own = item['comparisons'][0]
    lines = [
        '',
        f'### {claim.claim}',
        '',
        f'`{claim.id}`: {claim.source}. Suite {_suite_link(own)}: "{own["comparison"].better}" against '
        f'"{own["comparison"].worse}", measured at {MEASURES[claim.measure]}.',
    ]
    if claim.note:
        lines += ['', claim.note]
    lines += ['', f'**Verdict: {item["verdict"]}.**', '']
    rows = []
    for entry in item['comparisons']:
        comparison = entry['comparison']
        if comparison.setting:
            labels = f'; "{comparison.better}" against "{comparison.worse}"'
            if (comparison.better, comparison.worse) == (own['comparison'].better, own['comparison'].worse):
                labels = ''
            setting, changes = comparison.setting, comparison.changes + labels
        else:
            setting, changes = 'the claim, as the suite runs it', ''
        suite = _suite_link(entry)
        for part in entry['parts']:
            label = part['partition']
            if part['suite_partition'] != label:
                label = f'{label} (as {part["suite_partition"]})'
            known = known_diffs(part)
            rows.append(
                {
                    'setting': setting,
                    'what it changes': changes,
                    'suite': suite,
                    'partition': label,
                    'paper margin': _paper_margin_text(item, part['partition']),
                    'ours: mean': part['status'] if part['status'] != 'ok' else signed(part['mean']),
                    'per seed': seeds_text(part),
                    'seeds': ' '.join(str(s) for s in part['seeds'])
                    + ('' if len(known) == len(part['seeds']) else f' ({len(known)} with the measure)'),
                    'clients higher / lower / equal': ' / '.join(map(str, part['clients']))
                    if part['clients'] is not None
                    else '',
                }
            )
            setting = changes = suite = ''  # once per comparison
    lines.append(reports.markdown_table(rows, list(rows[0])))
    lines += ['', 'Commands:', '']
    for entry in item['comparisons']:
        name = entry['comparison'].setting or 'the claim'
        if entry['commands']:
            lines.append(f'- {name}: ' + '<br>'.join(f'`{c}`' for c in entry['commands']))
        elif any(part['seeds'] for part in entry['parts']):
            lines.append(f'- {name}: (no recorded command in `commands.txt`)')
        else:
            lines.append(f'- {name}: to run: `{entry["run"]}`')
    return lines


def generate(root: str = '.') -> str:
    """The claims page of the tree at `root`.

    Args:
      root: the repository root.

    Returns:
      `render(evaluate(root, load_claims(root)))`.
    """
    return render(evaluate(root, load_claims(root)))


def main(argv: Sequence[str]) -> int:
    """Writes docs/reports/claims.md, or with `--check` compares it.

    Args:
      argv: the command line without the program name: empty or `--check`.

    Returns:
      The exit code: 0, 1 when `--check` finds the page out of date, 2 on bad
      input (one line on stderr).
    """
    prog = 'claims'
    if any(arg != '--check' for arg in argv):
        print(f'{prog}: error: unexpected arguments: {" ".join(argv)} (only --check)', file=sys.stderr)
        return 2
    if not os.path.isdir(scoreboard.SUITES_DIR):
        print(f'{prog}: error: {scoreboard.SUITES_DIR} not found; run from the repository root', file=sys.stderr)
        return 2
    try:
        text = generate('.')
    except (ClaimsError, bench_suite.SuiteError) as e:
        print(f'{prog}: error: {" ".join(str(e).split())}', file=sys.stderr)
        return 2
    if '--check' in argv:
        if bench_layout.file_text(OUTPUT) != text:
            print(f'{prog}: {OUTPUT} is out of date; rerun: {GENERATE}', file=sys.stderr)
            return 1
        print(f'{OUTPUT} is current')
        return 0
    reports.write_text_atomic(OUTPUT, text)
    print(f'wrote {OUTPUT}')
    return 0


if __name__ == '__main__':
    # Importing TFF made its own local execution context; dropped now, while the interpreter is
    # whole, its clean-up never prints 'Exception ignored in ... ServiceManager.__del__' at exit.
    runtime.refuse_implicit_runtime()
    sys.exit(main(sys.argv[1:]))
