"""A claim against the committed run records: paired differences seed by seed, and the verdict.

Ours is the paired difference better - worse of the across-client mean test
accuracy, seed by seed (same partition, initial weights and client sampling),
with the per-client view of the same pairs (on how many clients `better` is
higher, lower, equal). The verdict (`verdict`): reproduced when the claim's own
difference is positive in every seed of every partition it names; reproduced
under setting S when it is not, but S's is on every partition S covers; not
reproduced otherwise, with the settings tested and their mean margins.
"""

import os
from collections.abc import Mapping, Sequence

from tff_pfl_bench import bench_aggregate, bench_layout, bench_suite, scoreboard
from tff_pfl_bench.claims_spec import Claim, ClaimsError

# A claim reproduced in fewer seeds than this says how many.
MIN_SEEDS = 3
# Differences smaller than this (points) are ties: two equal means that float
# arithmetic left a hair apart are not an ordering.
TIE = 1e-9

# ----------------------------------------------------------------------------
# Pairing records.


def measure_value(record: Mapping, measure: str) -> float | None:
    """A record's across-client mean test accuracy (a fraction) under a measure.

    Args:
      record: a `bench_result.json` record.
      measure: one of `MEASURES`.

    Returns:
      'last': `summary.<record's model>.mean`; 'val_selected':
      `selected.test_accuracy`; None when the record does not hold it.
    """
    if measure == 'val_selected':
        value = (record.get('selected') or {}).get('test_accuracy')
    else:
        value = ((record.get('summary') or {}).get(record.get('model')) or {}).get('mean')
    return None if value is None else float(value)


def pair(better: Mapping[int, Mapping], worse: Mapping[int, Mapping], measure: str, where: str) -> dict:
    """`better` against `worse` on one partition, seed by seed.

    Args:
      better: seed -> the record of `better`'s run.
      worse: seed -> the record of `worse`'s run.
      measure: one of `MEASURES`.
      where: what is paired, for error messages (suite, partition, labels).

    Returns:
      A dict: `seeds` (those with both records, sorted), `diffs` (seed ->
      better - worse in points, None when a record lacks the measure), `mean`
      (the mean of the known diffs, or None), `status` ('ok', 'not run yet'
      when no seed has both records, 'not available' when none has the
      measure) and `clients` ((higher, lower, equal) over the paired seeds'
      clients, matched by client_id, or None: measure 'val_selected', whose
      records keep no per-client numbers).

    Raises:
      ClaimsError: two records of a seed trained on different partitions
        (their `partition_csv`), or do not hold the same clients.
    """
    seeds = sorted(set(better) & set(worse))
    diffs, counts = {}, [0, 0, 0]
    for seed in seeds:
        b, w = better[seed], worse[seed]
        partitions = b.get('partition_csv'), w.get('partition_csv')
        if None not in partitions and partitions[0] != partitions[1]:
            raise ClaimsError(f'{where}, seed {seed}: the two runs trained on different partitions (partition_csv)')
        vb, vw = measure_value(b, measure), measure_value(w, measure)
        diffs[seed] = None if vb is None or vw is None else _points(vb - vw)
        if measure == 'last':
            ours = {c['client_id']: c['accuracy'] for c in b.get('clients') or ()}
            theirs = {c['client_id']: c['accuracy'] for c in w.get('clients') or ()}
            if set(ours) != set(theirs):
                raise ClaimsError(f'{where}, seed {seed}: the two runs do not hold the same clients')
            for client, accuracy in ours.items():
                counts[0 if accuracy > theirs[client] else 1 if accuracy < theirs[client] else 2] += 1
    known = [d for d in diffs.values() if d is not None]
    status = 'not run yet' if not seeds else 'ok' if known else 'not available'
    return dict(
        seeds=seeds,
        diffs=diffs,
        mean=sum(known) / len(known) if known else None,
        status=status,
        clients=tuple(counts) if measure == 'last' and seeds else None,
    )


def _points(difference: float) -> float:
    points = 100.0 * difference
    return 0.0 if abs(points) < TIE else points


def signed(points: float) -> str:
    """A difference in points as the page shows it.

    Args:
      points: the difference.

    Returns:
      `+0.41`, `-0.05`; an exact tie `0.00` (it is no win).
    """
    return '0.00' if points == 0 else f'{points:+.2f}'


def _seeds_count(n: int) -> str:
    return f'{n} seed{"" if n == 1 else "s"}'


def known_diffs(part: Mapping) -> list[float]:
    """The differences of a partition's seeds whose records hold the measure.

    Args:
      part: a `pair(...)` result.

    Returns:
      Its known per-seed differences, in seed order.
    """
    return [d for d in part['diffs'].values() if d is not None]


def state(parts: Sequence[Mapping]) -> str:
    """Where a comparison stands over its partitions.

    Args:
      parts: `pair(...)` results, each with its `partition`.

    Returns:
      'negative' when a known difference is <= 0; 'positive' when every
      partition has a known difference and all are > 0; else 'incomplete'.
    """
    if any(d <= 0 for part in parts for d in known_diffs(part)):
        return 'negative'
    if all(part['status'] == 'ok' for part in parts):
        return 'positive'
    return 'incomplete'


def _seeds_note(parts: Sequence[Mapping]) -> str:
    n = min(len(known_diffs(part)) for part in parts)
    return '' if n >= MIN_SEEDS else f' ({_seeds_count(n)})'


def margins_text(parts: Sequence[Mapping]) -> str:
    """A comparison's mean margin per partition, on one line.

    Args:
      parts: `pair(...)` results, each with its `partition` (the claim's label).

    Returns:
      E.g. "M10 -2.17, M20 +0.40 in 1 seed, M40 not run yet".
    """
    texts = []
    for part in parts:
        if part['status'] != 'ok':
            texts.append(f'{part["partition"]} {part["status"]}')
            continue
        n = len(known_diffs(part))
        seeds = '' if n >= MIN_SEEDS else f' in {_seeds_count(n)}'
        texts.append(f'{part["partition"]} {signed(part["mean"])}{seeds}')
    return ', '.join(texts)


def verdict(claim: Sequence[Mapping], settings: Sequence[tuple[str, Sequence[Mapping]]]) -> str:
    """The verdict on a claim.

    Args:
      claim: the claim's own comparison: `pair(...)` results, one per
        partition it names, each with its `partition`.
      settings: (setting name, its `pair(...)` results) per setting.

    Returns:
      'reproduced' when the claim's own difference is positive in every seed
      of every partition it names (with fewer than `MIN_SEEDS` seeds:
      'reproduced (n seeds)'); else 'reproduced under setting "S"' (every
      such S) when a setting's difference is positive in every seed of every
      partition it covers; else 'not reproduced' (a difference <= 0),
      'not run yet' (nothing to pair) or 'not run yet on P' (some partitions
      paired, all positive), followed by the settings tested (any partition
      paired) and their mean margins, then the settings not run yet.
    """
    own = state(claim)
    if own == 'positive':
        return 'reproduced' + _seeds_note(claim)
    under = [(name, parts) for name, parts in settings if state(parts) == 'positive']
    if under:
        names = ', '.join(f'"{name}"{_seeds_note(parts)}' for name, parts in under)
        return f'reproduced under setting{"s" if len(under) > 1 else ""} {names}'
    if own == 'negative':
        head = 'not reproduced'
    else:
        missing = {}
        for part in claim:
            if part['status'] != 'ok':
                missing.setdefault(part['status'], []).append(part['partition'])
        if len(missing) == 1 and sum(map(len, missing.values())) == len(claim):
            head = next(iter(missing))
        else:
            head = '; '.join(f'{status} on {", ".join(parts)}' for status, parts in missing.items())
    tested = [(name, parts) for name, parts in settings if any(part['status'] == 'ok' for part in parts)]
    untested = [f'"{name}"' for name, parts in settings if (name, parts) not in tested]
    text = head
    if tested:
        text += '; settings tested: ' + '; '.join(f'"{name}" ({margins_text(parts)})' for name, parts in tested)
    elif own == 'negative':
        text += '; no other setting tested'
    if untested:
        text += f'; not run yet: {", ".join(untested)}'
    return text


# ----------------------------------------------------------------------------
# The claims against the committed records.


def evaluate(root: str, claims: Sequence[Claim]) -> list[dict]:
    """Every claim's comparisons on the committed records, and its verdict.

    Args:
      root: the repository root (results are read below it).
      claims: `load_claims(root)`.

    Returns:
      One dict per claim: `claim` (the `Claim`), `comparisons` (the claim's
      own, then its settings': dicts with `comparison` (the `Comparison`),
      `parts` (a `pair(...)` per partition, with `partition` and
      `suite_partition`), `report` (the committed report.md relative to
      `root`, or None), `stale` (the results' suite.toml gives other runs
      than the suite file), `commands` (the recorded invocations covering
      its runs) and `run` (the command that runs its suite)), `paper_errors`
      (partition -> the suite's `[paper_errors]` reasons for `better` or
      `worse` there) and `verdict`.

    Raises:
      bench_suite.SuiteError: records of one (partition, seed) trained on
        different partitions.
      ClaimsError: paired records that do not hold the same clients.
    """
    records_of = {}
    result = []
    for claim in claims:
        comparisons = []
        for comparison in (claim.comparison, *claim.settings):
            suite = comparison.suite
            directory = scoreboard.results_dir(root, suite)
            for one in {
                suite.name: suite,
                comparison.suite_of(comparison.worse).name: comparison.suite_of(comparison.worse),
            }.values():
                if one.name not in records_of:
                    index = {}
                    for record in bench_aggregate.load_records(one, scoreboard.results_dir(root, one)):
                        run = record['run']
                        index[(run.partition.name, run.algorithm.name, run.seed)] = record
                    records_of[one.name] = index
            parts = []
            for partition, label in comparison.partitions.items():
                where = f'{suite.name}, {label}, "{comparison.better}" against "{comparison.worse}"'
                runs = {}
                for name in (comparison.better, comparison.worse):
                    index = records_of[comparison.suite_of(name).name]
                    runs[name] = {s: index[(label, name, s)] for s in suite.seeds if (label, name, s) in index}
                part = pair(runs[comparison.better], runs[comparison.worse], claim.measure, where)
                parts.append(dict(part, partition=partition, suite_partition=label))
            commands = (bench_layout.file_text(os.path.join(directory, bench_layout.COMMANDS_FILE)) or '').splitlines()
            covering = set()
            for label in comparison.partitions.values():
                for name in (comparison.better, comparison.worse):
                    covering.update(scoreboard.covering_commands(commands, label, name))
            has_records = any(part['seeds'] for part in parts)
            report = os.path.join(directory, 'report.md')
            comparisons.append(
                dict(
                    comparison=comparison,
                    parts=parts,
                    report=os.path.relpath(report, root) if os.path.exists(report) else None,
                    stale=has_records
                    and not bench_suite.same_runs(
                        bench_layout.file_text(os.path.join(directory, bench_layout.SUITE_FILE)), suite
                    ),
                    commands=[c for c in dict.fromkeys(commands) if c in covering] if has_records else [],
                    run=scoreboard.run_command(suite, comparison.suite_path),
                )
            )
        errors = claim.comparison.suite.paper_errors
        paper_errors = {
            partition: [
                f'{label}: {errors[label][partition]}'
                for label in (claim.comparison.better, claim.comparison.worse)
                if partition in errors.get(label, {})
            ]
            for partition in claim.paper_margin
        }
        result.append(
            dict(
                claim=claim,
                comparisons=comparisons,
                paper_errors={p: reasons for p, reasons in paper_errors.items() if reasons},
                verdict=verdict(
                    comparisons[0]['parts'], [(c['comparison'].setting, c['parts']) for c in comparisons[1:]]
                ),
            )
        )
    return result
