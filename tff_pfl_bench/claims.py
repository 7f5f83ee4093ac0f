"""The claims table: each paper's headline orderings, checked seed by seed on the committed runs.

    uv run --locked python -m tff_pfl_bench.claims           # writes docs/reports/claims.md
    uv run --locked python -m tff_pfl_bench.claims --check   # exit 1 if that file is out of date

Run from the repository root. Reads `benchmarks/claims.toml`, the suites it
names (`benchmarks/suites/*.toml`, found by their `name`) and their committed
run records (`benchmarks/results/<name>_suite/records/`, read with
`bench_report.load_records`), and writes one page. Nothing is run: the page
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

Claims file (`parse_claims`; docs/benchmarks.md, "Claims"):

    [[claims]]
    id = "kdpdfl-over-fedavg"            # unique: lower-case letters, digits, -
    paper = "KD-PDFL (Jeong & Kountouris, 2023)"   # the page's section
    source = "Table I, EMNIST, M = 10 / 20 / 40"
    claim = "KD-PDFL beats decentralized FedAvg"
    suite = "kdpdfl_fmnist"              # a suite's `name`
    better = "KD-PDFL"                   # algorithm labels of that suite
    worse = "FedAvg"
    paper_margin = { M10 = 2.3, M20 = 5.1, M40 = 4.6 }   # partition -> points > 0,
                                         # or a string: the paper gives no number
    measure = "last"                     # optional: "last" or "val_selected"
    note = "..."                         # optional, shown under the claim
    [[claims.settings]]
    name = "one SGD step per slot"       # unique within the claim
    changes = "..."                      # optional: what the setting changes
    suite = "kdpdfl_fmnist_readings"     # optional (default: the claim's suite)
    better = "KD-PDFL, one step per slot"   # optional (default: the claim's)
    worse = "FedAvg, one step per slot"
    worse_suite = "kdpdfl_fmnist"        # optional: `worse` runs in that suite,
                                         # unchanged by the setting (the same data,
                                         # seed for seed: checked on partition.csv)
    partitions = { M20 = "M20" }         # optional: claim partition -> this
                                         # suite's label (default: the same labels)

Errors (`ClaimsError`) are one line naming the file and the key.
"""

import dataclasses
import math
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence

# Run as a program, TensorFlow's C++ start-up chatter (the suites import it) is noise.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from tff_pfl import reports
from tff_pfl_bench import bench_layout, bench_report, bench_suite, scoreboard

CLAIMS_FILE = os.path.join('benchmarks', 'claims.toml')
OUTPUT = os.path.join('docs', 'reports', 'claims.md')
GENERATE = 'uv run --locked python -m tff_pfl_bench.claims'
# A claim reproduced in fewer seeds than this says how many.
MIN_SEEDS = 3
# What a comparison reads from a record: the across-client mean test accuracy
# of the record's model at the last round, or at the round chosen on
# validation data (`selected.test_accuracy`, kept by newer records).
# Differences smaller than this (points) are ties: two equal means that float
# arithmetic left a hair apart are not an ordering.
TIE = 1e-9
MEASURES = {
    'last': 'the last round',
    'val_selected': 'the round chosen on validation data',
}

_CLAIM_KEYS = (
    'id',
    'paper',
    'source',
    'claim',
    'suite',
    'better',
    'worse',
    'paper_margin',
    'measure',
    'note',
    'settings',
)
_SETTING_KEYS = ('name', 'changes', 'suite', 'better', 'worse', 'worse_suite', 'partitions')
_ID = re.compile(r'[a-z0-9][a-z0-9-]*')


class ClaimsError(ValueError):
    """A claims file, or records, that the page cannot be made from; one-line message."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """`better` against `worse` in one suite, on some of a claim's partitions.

    Attributes:
      setting: the setting's name, or '' for the claim's own comparison.
      changes: what the setting changes ('' for the claim).
      suite: the suite.
      suite_path: its file, relative to the repository root.
      better: an algorithm label of the suite.
      worse: an algorithm label of the suite.
      partitions: claim partition label -> the suite's partition label, in
        the claim's order.
      worse_suite: the suite `worse` runs in when it is another (a setting
        that changes only `better`: its `worse` is the other suite's run on
        the same data), else None.
      worse_suite_path: its file, or ''.
    """

    setting: str
    changes: str
    suite: bench_suite.Suite
    suite_path: str
    better: str
    worse: str
    partitions: Mapping
    worse_suite: bench_suite.Suite | None = None
    worse_suite_path: str = ''

    def suite_of(self, label: str) -> bench_suite.Suite:
        """The suite the algorithm `label` (`better` or `worse`) of this comparison runs in."""
        return self.worse_suite if label == self.worse and self.worse_suite is not None else self.suite


@dataclasses.dataclass(frozen=True)
class Claim:
    """One `[[claims]]` entry.

    Attributes:
      id: the claim's id.
      paper: the paper, e.g. "KD-PDFL (Jeong & Kountouris, 2023)".
      source: where in the paper, e.g. "Table I, EMNIST".
      claim: the ordering in words.
      measure: one of `MEASURES`.
      note: free text, or ''.
      paper_margin: partition label -> the paper's margin in points (> 0),
        or a string when the paper gives no number.
      comparison: the claim's own comparison.
      settings: the settings' comparisons, in file order.
    """

    id: str
    paper: str
    source: str
    claim: str
    measure: str
    note: str
    paper_margin: Mapping
    comparison: Comparison
    settings: tuple


# ----------------------------------------------------------------------------
# The claims file.


def suite_files(root: str) -> dict[str, str]:
    """Every suite's name -> its file, relative to `root`.

    Args:
      root: the repository root.

    Returns:
      `name` of each `benchmarks/suites/*.toml` -> its path (the first file
      of a name, in path order).

    Raises:
      ClaimsError: a suite file is not TOML.
    """
    names = {}
    for path in scoreboard.suite_paths(root):
        try:
            with open(path, 'rb') as f:
                name = tomllib.load(f).get('name')
        except tomllib.TOMLDecodeError as e:
            raise ClaimsError(f'{os.path.relpath(path, root)}: bad TOML: {" ".join(str(e).split())}') from None
        if isinstance(name, str):
            names.setdefault(name, os.path.relpath(path, root))
    return names


def load_claims(root: str, path: str = CLAIMS_FILE) -> list[Claim]:
    """Reads and validates the claims file, loading the suites it names.

    Args:
      root: the repository root (suites are read below it).
      path: the claims file, relative to `root`.

    Returns:
      The claims, in file order.

    Raises:
      ClaimsError: the file is missing or invalid.
      bench_suite.SuiteError: a suite it names does not load.
    """
    text = bench_layout.file_text(os.path.join(root, path))
    if text is None:
        raise ClaimsError(f'{path}: not found')
    files = suite_files(root)
    loaded = {}

    def suite_of(name):
        if name not in files:
            return None
        if name not in loaded:
            loaded[name] = bench_suite.load_suite(os.path.join(root, files[name]))
        return loaded[name], files[name]

    return parse_claims(text, path, suite_of, sorted(files))


def parse_claims(text: str, path: str, suite_of, known_suites: Sequence[str] = ()) -> list[Claim]:
    """Parses and validates claims from TOML text.

    Args:
      text: the TOML text.
      path: the file name used in error messages.
      suite_of: suite name -> (`bench_suite.Suite`, its path), or None for a
        name no suite file has.
      known_suites: the suite names, for the message naming an unknown one.

    Returns:
      The claims, in file order.

    Raises:
      ClaimsError: the text is not TOML or not a valid claims file.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ClaimsError(f'{path}: bad TOML: {" ".join(str(e).split())}') from None

    def fail(where, message):
        raise ClaimsError(f'{path}: {where}: {message}')

    for key in raw:
        if key != 'claims':
            fail(key, 'unknown key; known: claims')
    entries = raw.get('claims')
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        fail('claims', 'required, one or more [[claims]] tables')
    claims, ids = [], set()
    for i, entry in enumerate(entries):
        where = f'claims[{i}]'
        claim_id = entry.get('id')
        if not isinstance(claim_id, str) or not _ID.fullmatch(claim_id):
            fail(f'{where}.id', 'required, lower-case letters, digits and - (e.g. "kdpdfl-over-fedavg")')
        if claim_id in ids:
            fail(f'{where}.id', f'{claim_id!r} is the id of an earlier claim')
        ids.add(claim_id)
        claims.append(_parse_claim(entry, f'claims "{claim_id}"', suite_of, known_suites, fail))
    return claims


def _parse_claim(entry, where, suite_of, known_suites, fail) -> Claim:
    _unknown_keys(entry, _CLAIM_KEYS, where, fail)
    texts = {key: _text(entry, key, where, fail) for key in ('paper', 'source', 'claim')}
    note = entry.get('note', '')
    if not isinstance(note, str):
        fail(f'{where}.note', 'must be a string')
    measure = entry.get('measure', 'last')
    if measure not in MEASURES:
        fail(f'{where}.measure', f'must be one of {", ".join(MEASURES)}, got {measure!r}')
    suite, suite_path = _suite(entry.get('suite'), f'{where}.suite', suite_of, known_suites, fail)
    partitions = [p.name for p in suite.partitions]
    margins = entry.get('paper_margin')
    if not isinstance(margins, dict) or not margins:
        fail(f'{where}.paper_margin', "required, a table: partition label -> the paper's margin in points")
    for partition, margin in margins.items():
        key = f'{where}.paper_margin.{partition}'
        if partition not in partitions:
            fail(key, f'unknown partition label; {suite.name} has {", ".join(partitions)}')
        if isinstance(margin, str):
            if not margin.strip():
                fail(key, 'an empty string; say why the paper gives no number (e.g. "not stated")')
        elif not isinstance(margin, (int, float)) or isinstance(margin, bool) or not math.isfinite(margin):
            fail(key, f'must be points (a number) or a string when the paper gives none, got {margin!r}')
        elif margin <= 0:
            fail(key, f'{margin!r}: a claim is that better beats worse; leave out a partition where it does not')
    better, worse = _labels(entry, entry, where, suite, fail)
    comparison = Comparison('', '', suite, suite_path, better, worse, {p: p for p in margins})
    settings, names = [], set()
    raw_settings = entry.get('settings', [])
    if not isinstance(raw_settings, list) or not all(isinstance(s, dict) for s in raw_settings):
        fail(f'{where}.settings', 'must be [[claims.settings]] tables')
    for i, setting in enumerate(raw_settings):
        name = setting.get('name')
        if not isinstance(name, str) or not name.strip():
            fail(f'{where}.settings[{i}].name', 'required, a non-empty string')
        if name in names:
            fail(f'{where}.settings[{i}].name', f'{name!r} names an earlier setting of the claim')
        names.add(name)
        where_setting = f'{where}.settings "{name}"'
        settings.append(_parse_setting(setting, where_setting, entry, comparison, suite_of, known_suites, fail))
    return Claim(
        id=entry['id'],
        paper=texts['paper'],
        source=texts['source'],
        claim=texts['claim'],
        measure=measure,
        note=' '.join(note.split()),
        paper_margin={p: (m.strip() if isinstance(m, str) else float(m)) for p, m in margins.items()},
        comparison=comparison,
        settings=tuple(settings),
    )


def _parse_setting(setting, where, entry, claim: Comparison, suite_of, known_suites, fail) -> Comparison:
    _unknown_keys(setting, _SETTING_KEYS, where, fail)
    changes = setting.get('changes', '')
    if not isinstance(changes, str):
        fail(f'{where}.changes', 'must be a string')
    if 'suite' in setting:
        suite, suite_path = _suite(setting['suite'], f'{where}.suite', suite_of, known_suites, fail)
    else:
        suite, suite_path = claim.suite, claim.suite_path
    other, other_path = None, ''
    if 'worse_suite' in setting:
        other, other_path = _suite(setting['worse_suite'], f'{where}.worse_suite', suite_of, known_suites, fail)
        (better,) = _labels(setting, entry, where, suite, fail, ('better',))
        (worse,) = _labels({'worse': setting.get('worse', entry.get('worse'))}, {}, where, other, fail, ('worse',))
    else:
        better, worse = _labels(setting, entry, where, suite, fail)
    labels = [p.name for p in suite.partitions]
    if other is not None:
        labels = [p for p in labels if p in {q.name for q in other.partitions}]
    mapping = setting.get('partitions')
    if mapping is None:
        for partition in claim.partitions:
            if partition not in labels:
                fail(
                    f'{where}.partitions',
                    f'{suite.name} has no partition {partition!r} (it has {", ".join(labels)}); '
                    'map the claim\'s partitions to its labels: partitions = { claim label = "suite label" }',
                )
        mapping = {p: p for p in claim.partitions}
    elif not isinstance(mapping, dict) or not mapping:
        fail(f'{where}.partitions', "must be a non-empty table: claim partition label -> this suite's label")
    for partition, label in mapping.items():
        key = f'{where}.partitions.{partition}'
        if partition not in claim.partitions:
            fail(key, f'not a partition of the claim (its paper_margin has {", ".join(claim.partitions)})')
        if label not in labels:
            fail(key, f'{label!r} is no partition label of {suite.name}; it has {", ".join(labels)}')
    ordered = {p: mapping[p] for p in claim.partitions if p in mapping}
    if (suite.name, better, worse, ordered) == (claim.suite.name, claim.better, claim.worse, claim.partitions):
        fail(where, "the claim's own comparison (same suite, algorithms and partitions); a setting changes one")
    return Comparison(
        setting['name'], ' '.join(changes.split()), suite, suite_path, better, worse, ordered, other, other_path
    )


def _labels(table, claim_entry, where, suite: bench_suite.Suite, fail, keys=('better', 'worse')) -> tuple:
    algorithms = [a.name for a in suite.algorithms]
    labels = []
    for key in keys:
        label = table.get(key, claim_entry.get(key))
        if not isinstance(label, str) or not label:
            fail(f'{where}.{key}', 'required, an algorithm label of the suite')
        if label not in algorithms:
            fail(f'{where}.{key}', f'{label!r} is no algorithm label of {suite.name}; it has {", ".join(algorithms)}')
        labels.append(label)
    if len(labels) == 2 and labels[0] == labels[1]:
        fail(f'{where}.worse', f'{labels[1]!r} is also better: a claim compares two algorithms')
    return tuple(labels)


def _suite(name, where, suite_of, known_suites, fail) -> tuple:
    if not isinstance(name, str) or not name:
        fail(where, 'required, the name of a suite in benchmarks/suites')
    found = suite_of(name)
    if found is None:
        known = f'; the suites are {", ".join(known_suites)}' if known_suites else ''
        fail(where, f'no suite file in benchmarks/suites is named {name!r}{known}')
    return found


def _text(entry, key, where, fail) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        fail(f'{where}.{key}', 'required, a non-empty string')
    return ' '.join(value.split())


def _unknown_keys(table, known, where, fail) -> None:
    for key in table:
        if key not in known:
            fail(f'{where}.{key}', f'unknown key; known: {", ".join(known)}')


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


def _signed(points: float) -> str:
    """`+0.41`, `-0.05`; an exact tie `0.00` (it is no win)."""
    return '0.00' if points == 0 else f'{points:+.2f}'


def _seeds_count(n: int) -> str:
    return f'{n} seed{"" if n == 1 else "s"}'


def _known(part: Mapping) -> list[float]:
    return [d for d in part['diffs'].values() if d is not None]


def state(parts: Sequence[Mapping]) -> str:
    """Where a comparison stands over its partitions.

    Args:
      parts: `pair(...)` results, each with its `partition`.

    Returns:
      'negative' when a known difference is <= 0; 'positive' when every
      partition has a known difference and all are > 0; else 'incomplete'.
    """
    if any(d <= 0 for part in parts for d in _known(part)):
        return 'negative'
    if all(part['status'] == 'ok' for part in parts):
        return 'positive'
    return 'incomplete'


def _seeds_note(parts: Sequence[Mapping]) -> str:
    n = min(len(_known(part)) for part in parts)
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
        n = len(_known(part))
        seeds = '' if n >= MIN_SEEDS else f' in {_seeds_count(n)}'
        texts.append(f'{part["partition"]} {_signed(part["mean"])}{seeds}')
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
                    for record in bench_report.load_records(one, scoreboard.results_dir(root, one)):
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
    return ' / '.join('n/a' if part['diffs'][s] is None else _signed(part['diffs'][s]) for s in part['seeds'])


def _ours_text(part: Mapping) -> str:
    if part['status'] != 'ok':
        return f'{part["partition"]} {part["status"]}'
    return f'{part["partition"]} {_signed(part["mean"])} ({seeds_text(part)})'


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
            known = _known(part)
            rows.append(
                {
                    'setting': setting,
                    'what it changes': changes,
                    'suite': suite,
                    'partition': label,
                    'paper margin': _paper_margin_text(item, part['partition']),
                    'ours: mean': part['status'] if part['status'] != 'ok' else _signed(part['mean']),
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
    sys.exit(main(sys.argv[1:]))
