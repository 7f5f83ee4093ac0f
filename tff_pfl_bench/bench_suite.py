"""Benchmark suites: the validated suite, its runs and each run's configuration.

A suite is a TOML file: algorithms x partitions x seeds on one dataset. Every
(partition, algorithm, seed) of it is one `experiment.run_experiment` run in
its own directory (`bench_run` runs and resumes them); the complete runs are
aggregated into a paper-style report (`bench_report`). `bench_parse` reads
and validates the file (its format and the order in which a run's
configuration is assembled: there and docs/benchmarks.md) into the `Suite`
defined here.

An algorithm entry may also name one of TFF's own processes (`bench_peers`,
e.g. `tff_fed_recon`): its configuration is that of the registered algorithm
holding its settings, and a setting it does not take is an error too.
"""

import dataclasses
import itertools
import os
import re
import tomllib
from collections.abc import Mapping, Sequence

from tff_pfl.program import algorithms as algorithms_lib
from tff_pfl.program import run_config
from tff_pfl_bench import bench_peers

MODELS = ('global_model', 'personalized_model')

# What a `[paper]` number can be: the across-client mean, the sample-weighted
# mean, the mean of the worst 10% of clients, and the sample-weighted mean of
# the 10% of clients with the most examples (`bench_aggregate.METRICS`).
PAPER_METRICS = ('mean', 'weighted', 'worst10', 'top10')
# How a trial is scored (`tuning.validation_score`): the across-client mean validation accuracy at the
# last round, or at the round where it was highest (the record's `selected`).
TUNING_SELECT = ('last', 'selected')
# The run setting that makes every evaluated round score each client's validation split
# (`val_<model>_accuracy_mean`); a suite with `[tuning]` must set it true.
VALIDATION_SETTING = 'eval_validation'


# Keys of a suite that do not change its runs: results written under a suite
# that differs from another only there belong to both.
RESULT_NEUTRAL_KEYS = ('description', 'paper', 'paper_source', 'paper_errors')


def same_runs(stored_text: str | None, suite: 'Suite') -> bool:
    """Whether every run a stored suite.toml gives is a run of `suite`, with the same settings.

    Comments, layout, the description, the paper numbers and their errors
    aside (`RESULT_NEUTRAL_KEYS`). `suite` may add runs to the stored one:
    seeds, partitions and algorithms (the stored ones unchanged, by name), so
    that a suite grows without discarding the results it holds.

    Args:
      stored_text: the stored suite.toml's text, or None when there is none.
      suite: the suite.

    Returns:
      True when the stored suite's runs are runs of `suite`.
    """
    if stored_text is None:
        return False
    try:
        old = tomllib.loads(stored_text)
    except tomllib.TOMLDecodeError:
        return False
    new = tomllib.loads(suite.text)
    for key in RESULT_NEUTRAL_KEYS:
        old.pop(key, None)
        new.pop(key, None)
    if old == new:
        return True
    old_defaults, new_defaults = dict(old.pop('defaults', {})), dict(new.pop('defaults', {}))
    old_seeds, new_seeds = old_defaults.pop('seeds', []), new_defaults.pop('seeds', [])
    if old_defaults != new_defaults or not set(old_seeds) <= set(new_seeds):
        return False
    for key in ('partitions', 'algorithms'):
        old_tables, new_tables = old.pop(key, []), new.pop(key, [])
        by_name = {t.get('name'): t for t in new_tables}
        if any(by_name.get(t.get('name')) != t for t in old_tables):
            return False
    return old == new


class SuiteError(ValueError):
    """A suite, selection or output directory that cannot run; one-line message."""


@dataclasses.dataclass(frozen=True)
class PartitionEntry:
    """One `[[partitions]]` entry.

    Attributes:
      name: the label used in tables.
      slug: the label as a directory name.
      fields: ExperimentConfig fields of the entry, `partition` included.
    """

    name: str
    slug: str
    fields: Mapping


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """One `[[algorithms]]` entry.

    Attributes:
      name: the label used in tables.
      slug: the label as a directory name.
      algorithm: the `algorithms` registry name, or a `bench_peers` name.
      model: which evaluated model is the row's result.
      overrides: ExperimentConfig fields for every partition.
      partition_overrides: partition label -> ExperimentConfig fields.
      tune: `((setting, (value, ...)), ...)`, the `tune` table in file order
        (empty: not tuned).
      untuned: why the algorithm is not tuned, in a suite with `[tuning]`; else None.
    """

    name: str
    slug: str
    algorithm: str
    model: str
    overrides: Mapping
    partition_overrides: Mapping
    tune: tuple = ()
    untuned: str | None = None

    def combinations(self) -> list[tuple]:
        """The trials' values: the cartesian product of the `tune` lists, keys in file order.

        Returns:
          `((setting, value), ...)` per trial, the last key varying fastest;
          empty when the algorithm is not tuned.
        """
        return combinations(self.tune)


def combinations(tune: Sequence[tuple]) -> list[tuple]:
    """`((setting, value), ...)` per element of the product of `tune`'s lists, the last key varying fastest."""
    if not tune:
        return []
    keys = [key for key, _ in tune]
    return [tuple(zip(keys, values)) for values in itertools.product(*(values for _, values in tune))]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The `[tuning]` table: one budget for every tuned algorithm of the suite.

    Attributes:
      seed: the seed the trials run on (one of the suite's).
      trials: every tuned algorithm's number of trials.
      select: how a trial is scored on validation (`TUNING_SELECT`).
    """

    seed: int
    trials: int
    select: str


@dataclasses.dataclass(frozen=True)
class Run:
    """One (partition, algorithm, seed) of a suite."""

    partition: PartitionEntry
    algorithm: AlgorithmEntry
    seed: int

    @property
    def label(self) -> str:
        """`<partition>/<algorithm>/seed<k>`, with the entries' labels."""
        return f'{self.partition.name}/{self.algorithm.name}/seed{self.seed}'

    def directory(self, output_dir: str) -> str:
        """`<output_dir>/runs/<partition>/<algorithm>/seed<k>`.

        Args:
          output_dir: the suite's output directory.

        Returns:
          The run's directory, with the entries' slugs.
        """
        return os.path.join(output_dir, 'runs', self.partition.slug, self.algorithm.slug, f'seed{self.seed}')


def trial_slug(values: Sequence[tuple]) -> str:
    """A trial's directory name from its `((setting, value), ...)`.

    Args:
      values: the trial's settings, in the `tune` table's order.

    Returns:
      `setting-value` pairs joined by `-`, as `slug` makes labels (a tuple
      value's items joined by `-`, booleans lower-cased).
    """

    def text(value):
        if isinstance(value, tuple):
            return '-'.join(text(v) for v in value)
        return str(value).lower() if isinstance(value, bool) else str(value)

    return slug('-'.join(f'{key}-{text(value)}' for key, value in values))


@dataclasses.dataclass(frozen=True)
class Suite:
    """A validated benchmark suite.

    Attributes:
      name: the suite's name.
      description: free text.
      path: the file it was read from.
      text: the file's text (stored with the results).
      defaults: ExperimentConfig fields shared by every run.
      seeds: the seeds every (partition, algorithm) runs with.
      target_accuracy: accuracy (fraction) for rounds-to-target, or None.
      partitions: the partition entries, in file order.
      algorithms: the algorithm entries, in file order.
      paper: algorithm label -> partition label -> metric (`PAPER_METRICS`)
        -> (value, std or None), in %; only `mean` has a std (across clients).
      paper_source: where the `[paper]` numbers come from, or ''.
      paper_measure: what the `[paper]` numbers measure
        (`leaderboard.PAPER_MEASURES`): the last round, or the best round on
        test (then the report has a leaderboard section).
      paper_errors: algorithm label -> partition label -> why that `[paper]`
        cell is the paper's own error (a reason, one line).
      tuning: the `[tuning]` table, or None (no algorithm is tuned).
    """

    name: str
    description: str
    path: str
    text: str
    defaults: Mapping
    seeds: tuple
    target_accuracy: float | None
    partitions: tuple
    algorithms: tuple
    paper: Mapping
    paper_source: str = ''
    paper_measure: str = 'last round'
    paper_errors: Mapping = dataclasses.field(default_factory=dict)
    tuning: Tuning | None = None

    def config(
        self,
        partition: PartitionEntry,
        algorithm: AlgorithmEntry,
        seed: int,
        output_dir: str = '',
        tuned: Mapping | None = None,
    ) -> run_config.ExperimentConfig:
        """The run's configuration (not validated; `bench_parse.load_suite` did that).

        Args:
          partition: the partition entry.
          algorithm: the algorithm entry.
          seed: the run's seed.
          output_dir: the run's directory.
          tuned: a trial's settings (`tuning.Trial.settings`), or the chosen ones of
            a tuned algorithm's run; None: none.

        Returns:
          defaults < partition entry < algorithm overrides < the algorithm's
          overrides for this partition < `tuned`, as an `ExperimentConfig`.
        """
        # `[defaults]` and partition entries are shared by algorithms with
        # different settings: each run takes those that are common or its
        # algorithm's. The entries'
        # own keys must apply (ExperimentConfig.from_dict refuses the others).
        own = set(setting_names(algorithm.algorithm))
        common = set(run_config.ExperimentConfig.common_fields())
        values = {k: v for k, v in self.defaults.items() if k in common or k in own}
        values.update((k, v) for k, v in partition.fields.items() if k in common or k in own)
        values.update(algorithm.overrides)
        values.update(algorithm.partition_overrides.get(partition.name, {}))
        values.update(tuned or {})
        values.update(output_dir=output_dir, algorithm=algorithm.algorithm, seed=seed)
        if bench_peers.is_peer(algorithm.algorithm):  # TFF's own process: the configuration of its settings' algorithm
            config = run_config.ExperimentConfig.from_dict(bench_peers.config_values(algorithm.algorithm, values))
            bench_peers.check_config(algorithm.algorithm, config)
            return config
        return run_config.ExperimentConfig.from_dict(values)

    def runs(self) -> list[Run]:
        """Every run, partition-major, then seed, then algorithm.

        Returns:
          A `Run` per (partition, seed, algorithm) of the suite.
        """
        return [Run(p, a, s) for p in self.partitions for s in self.seeds for a in self.algorithms]

    def select(
        self,
        *,
        seeds: Sequence[int] | None = None,
        algorithms: Sequence[str] | None = None,
        partitions: Sequence[str] | None = None,
    ) -> list[Run]:
        """The runs of a subset of the suite.

        Args:
          seeds: seeds to run; None: all of the suite's.
          algorithms: algorithm labels; None: all.
          partitions: partition labels; None: all.

        Returns:
          The selected runs, in `runs()` order.

        Raises:
          SuiteError: a selection names a seed or label the suite does not have.
        """
        _check_selection('seed', seeds, self.seeds)
        _check_selection('algorithm', algorithms, [a.name for a in self.algorithms])
        _check_selection('partition', partitions, [p.name for p in self.partitions])
        return [
            run
            for run in self.runs()
            if (seeds is None or run.seed in seeds)
            and (algorithms is None or run.algorithm.name in algorithms)
            and (partitions is None or run.partition.name in partitions)
        ]


def _check_selection(what: str, selected, known) -> None:
    if selected is None:
        return
    unknown = [str(s) for s in selected if s not in known]
    if unknown:
        # A label with commas, given unquoted, arrives split at them (the flag is a comma-separated list).
        split = [str(k) for k in known if ',' in str(k) and str(k) in ', '.join(unknown)]
        hint = f'; a label with commas goes in double quotes: \'--{what}s="{split[0]}"\'' if split else ''
        raise SuiteError(f'unknown {what} {", ".join(unknown)}; the suite has {", ".join(str(k) for k in known)}{hint}')
    if not selected:
        raise SuiteError(f'empty {what} selection')


def slug(label: str) -> str:
    """A label as a directory name: `Per-FedAvg` -> `per-fedavg`.

    Args:
      label: a partition or algorithm label.

    Returns:
      `label` lower-cased, each run of characters other than `a-z0-9_.`
      replaced by `-`, without leading or trailing `-` and `.`.
    """
    return re.sub(r'[^a-z0-9_.]+', '-', label.lower()).strip('-.')


def known_algorithms() -> list[str]:
    """What a suite's `algorithm = ...` may name: the registry's algorithms, then TFF's own (`bench_peers`).

    Returns:
      `algorithms.names()` followed by `bench_peers.names()`.
    """
    return algorithms_lib.names() + bench_peers.names()


def setting_names(name: str) -> list[str]:
    """The algorithm settings (not the common ones) of a registered algorithm or a peer.

    Args:
      name: one of `known_algorithms()`.

    Returns:
      Its settings dataclass's field names; a peer's: those it takes.
    """
    if bench_peers.is_peer(name):
        return list(bench_peers.PEERS[name].settings)
    return algorithms_lib.get(name).settings.field_names()
