"""The claims file, `benchmarks/claims.toml`: its format, its validation, the claims it holds.

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
import tomllib
from collections.abc import Mapping, Sequence

from tff_pfl_bench import bench_layout, bench_parse, bench_suite, scoreboard

CLAIMS_FILE = os.path.join('benchmarks', 'claims.toml')
# What a comparison reads from a record: the across-client mean test accuracy
# of the record's model at the last round, or at the round chosen on
# validation data (`selected.test_accuracy`, kept by newer records).
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
            loaded[name] = bench_parse.load_suite(os.path.join(root, files[name]))
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
