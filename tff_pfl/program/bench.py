"""Benchmark suites: algorithms x partitions x seeds on one dataset, one report.

A suite is a TOML file. Every (partition, algorithm, seed) of it is one
`experiment.run_experiment` run in its own directory; the harness skips runs
that are already complete, so a suite can be resumed after an interruption,
run in several sittings, or split over processes by seed, algorithm or
partition. At the end it aggregates whatever is complete into a paper-style
report.

Suite format (`tomllib`; see docs/benchmarks.md):

    name = "persfl_mnist"              # required
    description = "..."                # optional
    [defaults]                         # ExperimentConfig fields, except
    dataset = "npz:../shared/data/mnist.npz"   # output_dir, algorithm,
    num_clients = 10                   # partition and seed; paths are
    rounds = 100                       # relative to the working directory
    seeds = [0, 1, 2]                  # required: the suite's seeds
    target_accuracy = 0.95             # optional: for rounds-to-target
    headline_model = "global_model"    # optional: default `model` below
    [[partitions]]
    name = "ds1"                       # label used in tables and paths
    partition = "ds1"                  # ExperimentConfig.partition
    classes_per_client = 4             # any other ExperimentConfig fields
    [[algorithms]]
    name = "FedAvg"                    # label used in tables
    algorithm = "fedavg"               # ExperimentConfig.algorithm
    model = "global_model"             # global_model | personalized_model
    [algorithms.overrides]             # ExperimentConfig fields
    client_learning_rate = 0.05
    [algorithms.partition_overrides.ds2]   # fields for one partition label
    rounds = 50
    [paper]                            # optional reference numbers (%):
    "FedAvg" = { ds1 = [92.0, 1.7] }   # algorithm label -> partition -> [mean, std]

A run's configuration is the `ExperimentConfig` defaults, updated in this
order (later wins): `[defaults]`, the partition entry, the algorithm's
`overrides`, the algorithm's `partition_overrides` for that partition. The
whole suite is validated when it is loaded (`load_suite`): unknown keys,
unknown fields, unknown algorithms, every resulting configuration's
`validate()`, and that every algorithm of a partition trains on the same
client data; errors are `SuiteError`s with a one-line message naming the file
and the key.

Output directory (`run_suite`, `write_report`):

    <output_dir>/suite.toml            the suite the results belong to
    <output_dir>/commands.txt          every invocation, one per line
    <output_dir>/runs/<partition>/<algorithm>/seed<k>/
                                       a `run_experiment` directory, plus
                                       bench_result.json, written last: a
                                       run is complete when it exists
    <output_dir>/results.csv           one row per run and client
    <output_dir>/summary.csv           one row per partition and algorithm
    <output_dir>/report.md             the tables and plots below
    <output_dir>/curves_<p>.png, clients_<p>.png, std_<p>.png
"""

import collections
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence

import tensorflow_federated as tff

from tff_pfl.computations import audit
from tff_pfl.program import algorithms as algorithms_lib
from tff_pfl.program import experiment, reports

RESULT_FILE = 'bench_result.json'
SUITE_FILE = 'suite.toml'
COMMANDS_FILE = 'commands.txt'
MODELS = ('global_model', 'personalized_model')

_RESERVED = ('output_dir', 'algorithm', 'partition', 'seed')
_FIELDS = {f.name: f for f in dataclasses.fields(experiment.ExperimentConfig)}
_SUITE_KEYS = ('name', 'description', 'defaults', 'partitions', 'algorithms', 'paper')
_DEFAULTS_EXTRA = ('seeds', 'target_accuracy', 'headline_model')
_ALGORITHM_KEYS = ('name', 'algorithm', 'model', 'overrides', 'partition_overrides')
# What decides a run's client data besides `partition_params()` and the seed.
_DATA_FIELDS = ('dataset', 'data_dir', 'num_clients', 'split_fractions', 'public_examples')


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
      algorithm: the `algorithms` registry name.
      model: which evaluated model is the row's result.
      overrides: ExperimentConfig fields for every partition.
      partition_overrides: partition label -> ExperimentConfig fields.
    """

    name: str
    slug: str
    algorithm: str
    model: str
    overrides: Mapping
    partition_overrides: Mapping


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
      paper: algorithm label -> partition label -> (mean, std), in %.
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

    def config(
        self, partition: PartitionEntry, algorithm: AlgorithmEntry, seed: int, output_dir: str = ''
    ) -> experiment.ExperimentConfig:
        """The run's configuration (not validated; `load_suite` did that).

        Args:
          partition: the partition entry.
          algorithm: the algorithm entry.
          seed: the run's seed.
          output_dir: the run's directory.

        Returns:
          defaults < partition entry < algorithm overrides < the algorithm's
          overrides for this partition, as an `ExperimentConfig`.
        """
        values = dict(self.defaults)
        values.update(partition.fields)
        values.update(algorithm.overrides)
        values.update(algorithm.partition_overrides.get(partition.name, {}))
        return experiment.ExperimentConfig(output_dir=output_dir, algorithm=algorithm.algorithm, seed=seed, **values)

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
        raise SuiteError(f'unknown {what} {", ".join(unknown)}; the suite has {", ".join(str(k) for k in known)}')
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


# ----------------------------------------------------------------------------
# Loading and validation.


def load_suite(path: str) -> Suite:
    """Reads and validates a suite file.

    Args:
      path: the TOML file.

    Returns:
      The `Suite`.

    Raises:
      SuiteError: the file is missing or unreadable, is not TOML, or does not
        describe a valid suite.
    """
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        raise SuiteError(f'suite file not found: {path}') from None
    except OSError as e:
        raise SuiteError(f'cannot read suite file {path}: {e.strerror}') from None
    try:
        text = data.decode('utf-8')
    except UnicodeDecodeError:
        raise SuiteError(f'{path}: not UTF-8 text') from None
    return parse_suite(text, path)


def parse_suite(text: str, path: str = '<suite>') -> Suite:
    """Parses and validates a suite from its TOML text.

    Args:
      text: the TOML text.
      path: the file name used in error messages and in the report.

    Returns:
      The `Suite`.

    Raises:
      SuiteError: the text is not TOML or does not describe a valid suite.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f'{path}: bad TOML: {_one_line(e)}') from None

    def fail(where, message):
        raise SuiteError(f'{path}: {where}: {message}')

    _unknown_keys(raw, _SUITE_KEYS, '(top level)', fail)
    name = raw.get('name')
    if not isinstance(name, str) or not name.strip():
        fail('name', 'required, a non-empty string')
    description = raw.get('description', '')
    if not isinstance(description, str):
        fail('description', 'must be a string')

    defaults = _table(raw.get('defaults', {}), 'defaults', fail)
    seeds = defaults.get('seeds')
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
    ):
        fail('defaults.seeds', 'required, a non-empty list of non-negative integers')
    if len(set(seeds)) != len(seeds):
        fail('defaults.seeds', f'repeated seed in {seeds}')
    target = defaults.get('target_accuracy')
    if target is not None and (not _is_number(target) or not 0 < target <= 1):
        fail('defaults.target_accuracy', f'must be a number in (0, 1], got {target!r}')
    headline_model = defaults.get('headline_model', 'global_model')
    if headline_model not in MODELS:
        fail('defaults.headline_model', f'must be one of {", ".join(MODELS)}, got {headline_model!r}')
    config_defaults = _config_fields(
        {k: v for k, v in defaults.items() if k not in _DEFAULTS_EXTRA}, 'defaults', fail, _RESERVED
    )

    partitions = []
    raw_partitions = raw.get('partitions')
    if not isinstance(raw_partitions, list) or not raw_partitions:
        fail('partitions', 'required, at least one [[partitions]] table')
    for i, entry in enumerate(raw_partitions):
        where = f'partitions[{i}]'
        entry = _table(entry, where, fail)
        label = _label(entry, where, fail)
        where = f'partitions "{label}"'
        if not isinstance(entry.get('partition'), str):
            fail(f'{where}.partition', 'required, a string (ExperimentConfig.partition)')
        fields = _config_fields(
            {k: v for k, v in entry.items() if k != 'name'}, where, fail, ('output_dir', 'algorithm', 'seed')
        )
        partitions.append(PartitionEntry(label, slug(label), fields))
    _unique_labels(partitions, 'partitions', fail)
    partition_names = [p.name for p in partitions]

    entries = []
    raw_algorithms = raw.get('algorithms')
    if not isinstance(raw_algorithms, list) or not raw_algorithms:
        fail('algorithms', 'required, at least one [[algorithms]] table')
    for i, entry in enumerate(raw_algorithms):
        where = f'algorithms[{i}]'
        entry = _table(entry, where, fail)
        label = _label(entry, where, fail)
        where = f'algorithms "{label}"'
        _unknown_keys(entry, _ALGORITHM_KEYS, where, fail)
        registry = entry.get('algorithm')
        if not isinstance(registry, str):
            fail(f'{where}.algorithm', 'required, a string (ExperimentConfig.algorithm)')
        if registry not in algorithms_lib.names():
            fail(f'{where}.algorithm', f'unknown algorithm {registry!r}; known: {", ".join(algorithms_lib.names())}')
        model = entry.get('model', headline_model)
        if model not in MODELS:
            fail(f'{where}.model', f'must be one of {", ".join(MODELS)}, got {model!r}')
        overrides = _config_fields(
            _table(entry.get('overrides', {}), f'{where}.overrides', fail), f'{where}.overrides', fail, _RESERVED
        )
        per_partition = {}
        for partition_name, values in _table(
            entry.get('partition_overrides', {}), f'{where}.partition_overrides', fail
        ).items():
            key = f'{where}.partition_overrides.{partition_name}'
            if partition_name not in partition_names:
                fail(key, f'unknown partition; the suite has {", ".join(partition_names)}')
            per_partition[partition_name] = _config_fields(_table(values, key, fail), key, fail, _RESERVED)
        entries.append(AlgorithmEntry(label, slug(label), registry, model, overrides, per_partition))
    _unique_labels(entries, 'algorithms', fail)
    algorithm_names = [a.name for a in entries]

    paper = {}
    for algorithm_name, cells in _table(raw.get('paper', {}), 'paper', fail).items():
        if algorithm_name not in algorithm_names:
            fail(f'paper.{algorithm_name}', f'unknown algorithm label; the suite has {", ".join(algorithm_names)}')
        paper[algorithm_name] = {}
        for partition_name, value in _table(cells, f'paper.{algorithm_name}', fail).items():
            key = f'paper.{algorithm_name}.{partition_name}'
            if partition_name not in partition_names:
                fail(key, f'unknown partition label; the suite has {", ".join(partition_names)}')
            if not (isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value)):
                fail(key, f'must be [mean, std] in %, got {value!r}')
            paper[algorithm_name][partition_name] = (float(value[0]), float(value[1]))

    suite = Suite(
        name=name,
        description=description,
        path=path,
        text=text,
        defaults=config_defaults,
        seeds=tuple(seeds),
        target_accuracy=None if target is None else float(target),
        partitions=tuple(partitions),
        algorithms=tuple(entries),
        paper=paper,
    )
    _validate_configs(suite, fail)
    return suite


def _validate_configs(suite: Suite, fail) -> None:
    """Every run's configuration validates; a partition's client data are shared."""
    for partition in suite.partitions:
        reference = None
        for algorithm in suite.algorithms:
            where = f'algorithms "{algorithm.name}" on partitions "{partition.name}"'
            try:
                config = suite.config(partition, algorithm, suite.seeds[0]).validate()
            except experiment.ConfigError as e:
                fail(where, str(e))
            data = _data_key(config)
            if reference is None:
                reference = (algorithm.name, data)
                continue
            for field, value in data.items():
                if value != reference[1][field]:
                    fail(
                        where,
                        f'changes the client data ({field} {value!r}, but {reference[1][field]!r} for '
                        f'"{reference[0]}"); every algorithm of a partition must train on the same partition',
                    )


def _data_key(config: experiment.ExperimentConfig) -> dict:
    """What decides a run's client data, seed aside."""
    key = {field: getattr(config, field) for field in _DATA_FIELDS}
    key['partition'] = config.partition
    key.update((f'partition_params.{k}', v) for k, v in sorted(config.partition_params().items()))
    return key


def _one_line(error: BaseException) -> str:
    return ' '.join(str(error).split())


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _table(value, where, fail) -> dict:
    if not isinstance(value, dict):
        fail(where, f'must be a table, got {type(value).__name__}')
    return value


def _unknown_keys(table, known, where, fail) -> None:
    for key in table:
        if key not in known:
            fail(f'{where}.{key}' if where != '(top level)' else key, f'unknown key; known: {", ".join(known)}')


def _label(entry, where, fail) -> str:
    label = entry.get('name')
    if not isinstance(label, str) or not slug(label):
        fail(f'{where}.name', 'required, a string with a letter or digit')
    return label


def _unique_labels(entries, where, fail) -> None:
    seen = {}
    for entry in entries:
        if entry.slug in seen:
            fail(where, f'labels "{seen[entry.slug]}" and "{entry.name}" name the same directory {entry.slug!r}')
        seen[entry.slug] = entry.name


def _config_fields(table: Mapping, where: str, fail, reserved: Sequence[str]) -> dict:
    """TOML values -> ExperimentConfig field values, type-checked."""
    values = {}
    for key, value in table.items():
        if key in reserved:
            fail(f'{where}.{key}', 'set by the harness, not allowed here')
        if key not in _FIELDS:
            fail(f'{where}.{key}', 'unknown key (not an ExperimentConfig field)')
        values[key] = _coerce(_FIELDS[key], value, f'{where}.{key}', fail)
    return values


def _coerce(field: dataclasses.Field, value, where: str, fail):
    """One TOML value as the type of an ExperimentConfig field."""
    kind = field.type
    if typing.get_origin(kind) is typing.Union:  # Optional[X]; TOML has no null
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is tuple:
        if not isinstance(value, list):
            fail(where, f'must be a list, got {value!r}')
        element = type(field.default[0]) if field.default else float
        return tuple(_coerce_scalar(element, v, where, fail) for v in value)
    return _coerce_scalar(kind, value, where, fail)


def _coerce_scalar(kind, value, where, fail):
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = _is_number(value)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        fail(where, f'must be {getattr(kind, "__name__", kind)}, got {value!r}')
    return value


# ----------------------------------------------------------------------------
# The output directory.


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive `flock` on `path` (created if needed), released on exit."""
    with open(path, 'a') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stored_suite(output_dir: str) -> str | None:
    path = os.path.join(output_dir, SUITE_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding='utf-8') as f:
        return f.read()


def _same_suite(stored: str, suite: Suite) -> bool:
    """Same parsed content (comments and layout aside)."""
    try:
        return tomllib.loads(stored) == tomllib.loads(suite.text)
    except tomllib.TOMLDecodeError:
        return False


def _check_output_dir(suite: Suite, output_dir: str, overwrite: bool) -> None:
    """Refuses an output directory that cannot hold this suite's results; writes nothing."""
    if os.path.exists(output_dir):
        if not os.path.isdir(output_dir):
            raise SuiteError(f'output_dir {output_dir} exists and is not a directory')
        stored = _stored_suite(output_dir)
        if not overwrite:
            if stored is None and os.listdir(output_dir):
                raise SuiteError(
                    f'output_dir {output_dir} is not empty and holds no benchmark; pass --overwrite to replace it'
                )
            if stored is not None and not _same_suite(stored, suite):
                raise SuiteError(
                    f'output_dir {output_dir} holds results of a different suite '
                    f'(see {os.path.join(output_dir, SUITE_FILE)}); pass --overwrite to replace them'
                )
        probe_dir = output_dir
    else:
        probe_dir = os.path.dirname(output_dir) or '.'
        while not os.path.exists(probe_dir):
            probe_dir = os.path.dirname(probe_dir) or '.'
    try:
        tempfile.NamedTemporaryFile(dir=probe_dir, prefix='.probe.').close()
    except OSError as e:
        raise SuiteError(f'output_dir {output_dir} is not writable: {e.strerror}') from None


def _prepare_output_dir(suite: Suite, output_dir: str, overwrite: bool, command: str | None) -> None:
    _check_output_dir(suite, output_dir, overwrite)
    os.makedirs(output_dir, exist_ok=True)
    with _locked(os.path.join(output_dir, '.lock')):
        stored = _stored_suite(output_dir)
        if overwrite:
            for name in os.listdir(output_dir):
                if name == '.lock':
                    continue
                path = os.path.join(output_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
        elif stored is not None and not _same_suite(stored, suite):  # another process got here first
            raise SuiteError(f'output_dir {output_dir} holds results of a different suite')
        if _stored_suite(output_dir) is None:
            reports.write_text_atomic(os.path.join(output_dir, SUITE_FILE), suite.text)
        if command:
            with open(os.path.join(output_dir, COMMANDS_FILE), 'a', encoding='utf-8') as f:
                f.write(command.replace('\n', ' ') + '\n')


def check_report_dir(suite: Suite, output_dir: str) -> None:
    """Raises SuiteError unless `output_dir` holds results of `suite`.

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.
    """
    if not os.path.isdir(output_dir):
        raise SuiteError(f'output_dir {output_dir} does not exist')
    stored = _stored_suite(output_dir)
    if stored is None:
        raise SuiteError(f'output_dir {output_dir} holds no benchmark ({SUITE_FILE} is missing)')
    if not _same_suite(stored, suite):
        raise SuiteError(
            f'output_dir {output_dir} holds results of a different suite (see {os.path.join(output_dir, SUITE_FILE)})'
        )


def _check_data(suite: Suite, runs: Sequence[Run]) -> None:
    """Data files named by the selected runs exist (cheap; before anything is written)."""
    for run in runs:
        dataset = suite.config(run.partition, run.algorithm, run.seed).dataset
        kind, _, arg = dataset.partition(':')
        path = arg if kind in ('npz', 'folder') else (dataset if dataset.endswith('.npz') else None)
        if path is not None and not os.path.exists(path):
            raise SuiteError(
                f'{suite.path}: dataset {dataset!r} of partitions "{run.partition.name}": '
                f'{path} not found (paths are relative to the working directory)'
            )


# ----------------------------------------------------------------------------
# Running.


def _format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    return f'{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


class _RunLog:
    """A run's own progress lines, appended to `<run dir>/progress.log`."""

    def __init__(self, directory: str):
        self._path = os.path.join(directory, 'progress.log')
        self._pending = []

    def __call__(self, line: str) -> None:
        self._pending.append(line)
        if os.path.isdir(os.path.dirname(self._path)):  # run_experiment creates it
            with open(self._path, 'a', encoding='utf-8') as f:
                f.write('\n'.join(self._pending) + '\n')
            self._pending = []


def _file_text(path: str) -> str | None:
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except FileNotFoundError:
        return None


def _reference_partition(suite: Suite, output_dir: str, run: Run) -> tuple[str | None, str | None]:
    """`partition.csv` of the first complete run of the same (partition, seed)."""
    for other in suite.runs():
        if other.partition is run.partition and other.seed == run.seed and other != run:
            directory = other.directory(output_dir)
            if os.path.exists(os.path.join(directory, RESULT_FILE)):
                return other.label, _file_text(os.path.join(directory, 'partition.csv'))
    return None, None


def _check_process(run: Run, process, partition_text: str | None, reference) -> dict:
    """Before training: the chosen model exists, the partition is shared; communication."""
    models = [name for name, _ in tff.structure.iter_elements(process.evaluate.type_signature.result.member)]
    if run.algorithm.model not in models:
        raise SuiteError(
            f'algorithms "{run.algorithm.name}" ({run.algorithm.algorithm}) evaluates '
            f'{", ".join(models)}, not model {run.algorithm.model!r}'
        )
    reference_label, reference_text = reference
    if reference_text is not None and partition_text != reference_text:
        raise SuiteError(
            f'run {run.label} trains on another partition than {reference_label} '
            '(partition.csv differs); every algorithm of a partition must share it'
        )
    communication = {'has_personalize': process.personalize is not None}
    try:
        communication.update(audit.communication_bytes(process.next))
        if process.personalize is not None:
            personalize = audit.communication_bytes(process.personalize)
            communication['personalize_bytes_down_per_client'] = personalize['bytes_down_per_client']
            communication['personalize_bytes_up_per_client'] = personalize['bytes_up_per_client']
    except ValueError as e:  # a type without a fixed size
        communication['error'] = _one_line(e)
    return communication


def _participants(config: experiment.ExperimentConfig, num_clients: int, row: Mapping) -> int:
    if row.get('num_clients') is not None:
        return int(row['num_clients'])
    if config.client_fraction >= 1.0:
        return num_clients
    return max(1, int(math.ceil(config.client_fraction * num_clients)))


def communication_totals(
    per_call: Mapping, config: experiment.ExperimentConfig, rounds: Sequence[Mapping], num_clients: int
) -> dict:
    """Bytes of a whole run from the bytes of one call per client.

    Args:
      per_call: `_check_process`'s communication: `bytes_down_per_client`,
        `bytes_up_per_client` of one round, and those of `personalize`.
      config: the run's configuration (client fraction, for rounds whose
        metrics do not count their clients).
      rounds: the run's metrics rows.
      num_clients: clients of the partition.

    Returns:
      `has_personalize` and the `personalize_*` entries of `per_call`;
      `bytes_down_per_client_per_round` / `bytes_up_per_client_per_round`
      (`per_call`'s `bytes_*_per_client`); `client_rounds`, the clients of
      every round summed over rounds; `bytes_down_total` / `bytes_up_total`,
      rounds and `personalize` for every client; and `bytes_down_per_client`
      / `bytes_up_per_client`, the totals divided by `num_clients`. Only
      `per_call` when it holds an `error` (a type without a fixed size).
    """
    result = dict(per_call)
    if 'error' in per_call:
        return result
    client_rounds = sum(_participants(config, num_clients, row) for row in rounds)
    down = client_rounds * per_call['bytes_down_per_client']
    up = client_rounds * per_call['bytes_up_per_client']
    if per_call.get('has_personalize'):
        down += num_clients * per_call['personalize_bytes_down_per_client']
        up += num_clients * per_call['personalize_bytes_up_per_client']
    result['bytes_down_per_client_per_round'] = result.pop('bytes_down_per_client')
    result['bytes_up_per_client_per_round'] = result.pop('bytes_up_per_client')
    result.update(
        client_rounds=client_rounds,
        bytes_down_total=down,
        bytes_up_total=up,
        bytes_down_per_client=down / num_clients,
        bytes_up_per_client=up / num_clients,
    )
    return result


def model_curve(rounds: Sequence[Mapping], model: str, final_only: bool) -> list[dict]:
    """Per-round mean test accuracy of `model` on the rounds where it was evaluated.

    Args:
      rounds: the run's metrics rows.
      model: e.g. 'global_model'.
      final_only: the model is made by a final `personalize` stage, so only
        the last round's value is that model.

    Returns:
      `[{'round': r, 'accuracy': a}, ...]`, accuracy as a fraction.
    """
    key = f'test_{model}_accuracy_mean'
    points = [
        {'round': int(row['round']), 'accuracy': float(row[key])}
        for row in rounds
        if row.get(key) is not None and row.get(key) != ''
    ]
    if final_only and points:
        last = int(rounds[-1]['round'])
        points = [p for p in points if p['round'] == last]
    return points


def rounds_to_target(curve: Sequence[Mapping], target: float | None) -> int | None:
    """The first round of `curve` whose accuracy is >= `target`; None if none is.

    Args:
      curve: `[{'round': r, 'accuracy': a}, ...]` in round order, as
        `model_curve` returns.
      target: accuracy as a fraction, or None.

    Returns:
      The round number, or None when `target` is None or never reached.
    """
    if target is None:
        return None
    for point in curve:
        if point['accuracy'] >= target:
            return point['round']
    return None


def _bench_result(suite, run, config, result, seconds, communication, partition_text) -> dict:
    model = run.algorithm.model
    num_clients = len(result.clients)
    final_only = communication['has_personalize'] and model != 'global_model'
    curve = model_curve(result.rounds, model, final_only)
    return collections.OrderedDict(
        suite=suite.name,
        partition=run.partition.name,
        algorithm=run.algorithm.name,
        registry_name=run.algorithm.algorithm,
        seed=run.seed,
        model=model,
        seconds=seconds,
        rounds=config.rounds,
        final_round=int(result.rounds[-1]['round']),
        summary={name: {k: float(v) for k, v in s.items()} for name, s in result.summary.items()},
        clients=[
            collections.OrderedDict(
                client_id=row['client_id'],
                accuracy=float(row[f'{model}_accuracy']),
                num_examples=int(row[f'{model}_num_examples']),
            )
            for row in result.clients
        ],
        final_only=final_only,
        curve=curve,
        target_accuracy=suite.target_accuracy,
        rounds_to_target=rounds_to_target(curve, suite.target_accuracy),
        communication=communication_totals(communication, config, result.rounds, num_clients),
        partition_csv=partition_text,
        config=dataclasses.asdict(config),
    )


def run_suite(
    suite: Suite,
    output_dir: str,
    *,
    seeds: Sequence[int] | None = None,
    algorithms: Sequence[str] | None = None,
    partitions: Sequence[str] | None = None,
    overwrite: bool = False,
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Runs the selected runs of a suite that are not complete, then writes the report.

    Each run is `experiment.run_experiment(config, overwrite=True)` into
    `<output_dir>/runs/<partition>/<algorithm>/seed<k>/` (its per-round lines
    go to `progress.log` there), then `bench_result.json` is written last. A
    run whose directory lacks `bench_result.json` is removed and redone; a
    run another process is doing (its lock is held) is left alone.

    Args:
      suite: the suite (`load_suite`).
      output_dir: the benchmark's directory; created if needed.
      seeds: run only these seeds (None: all).
      algorithms: run only these algorithm labels (None: all).
      partitions: run only these partition labels (None: all).
      overwrite: discard everything in `output_dir` first (required when it
        holds results of a different suite).
      command: recorded in `commands.txt` and shown in the report.
      log: receives one line per run.

    Returns:
      `write_report`'s summary rows.

    Raises:
      SuiteError: bad selection, an output directory that does not fit, a
        missing data file (all raised before anything is written), or a run
        that does not share its partition with the others of its seed.
    """
    output_dir = os.path.abspath(output_dir)
    runs = suite.select(seeds=seeds, algorithms=algorithms, partitions=partitions)
    _check_output_dir(suite, output_dir, overwrite)
    _check_data(suite, runs)
    _prepare_output_dir(suite, output_dir, overwrite, command)
    todo = [run for run in runs if not os.path.exists(os.path.join(run.directory(output_dir), RESULT_FILE))]
    log(f'{suite.name}: {len(runs)} runs selected, {len(runs) - len(todo)} already complete, {len(todo)} to run')
    spent, done = 0.0, 0
    for i, run in enumerate(todo, start=1):
        directory = run.directory(output_dir)
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        with open(os.path.join(os.path.dirname(directory), f'.seed{run.seed}.lock'), 'a') as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f'run {i}/{len(todo)} {run.label}: another process is running it, skipped')
                continue
            if os.path.exists(os.path.join(directory, RESULT_FILE)):  # finished elsewhere meanwhile
                continue
            if os.path.exists(directory):
                log(f'run {i}/{len(todo)} {run.label}: incomplete, redoing it')
                shutil.rmtree(directory)
            started = time.monotonic()
            record = _run_one(suite, output_dir, run)
            seconds = time.monotonic() - started
            spent, done = spent + seconds, done + 1
            eta = spent / done * (len(todo) - i)
            accuracy = record['summary'][run.algorithm.model]['mean']
            log(
                f'run {i}/{len(todo)} {run.label}: {seconds:.1f}s  test_acc[{run.algorithm.model}] '
                f'{accuracy:.4f}  ETA {_format_seconds(eta)}'
            )
    return write_report(suite, output_dir, log=log)


def _run_one(suite: Suite, output_dir: str, run: Run) -> dict:
    directory = run.directory(output_dir)
    config = suite.config(run.partition, run.algorithm, run.seed, directory)
    reference = _reference_partition(suite, output_dir, run)
    found = {}

    def on_process(process):
        found['partition'] = _file_text(os.path.join(directory, 'partition.csv'))
        found['communication'] = _check_process(run, process, found['partition'], reference)

    started = time.monotonic()
    result = experiment.run_experiment(config, overwrite=True, log=_RunLog(directory), on_process=on_process)
    seconds = time.monotonic() - started
    record = _bench_result(suite, run, config, result, seconds, found['communication'], found['partition'])
    reports.write_text_atomic(os.path.join(directory, RESULT_FILE), json.dumps(record, indent=1) + '\n')
    return record


# ----------------------------------------------------------------------------
# Aggregation.


def load_results(suite: Suite, output_dir: str) -> list[dict]:
    """The `bench_result.json` of every complete run of the suite, in `runs()` order.

    Args:
      suite: the suite.
      output_dir: the benchmark's directory.

    Returns:
      The records, each with the `Run` under `'run'`.

    Raises:
      SuiteError: complete runs of one (partition, seed) have different
        partitions.
    """
    records, reference = [], {}
    for run in suite.runs():
        path = os.path.join(run.directory(output_dir), RESULT_FILE)
        if not os.path.exists(path):
            continue
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        record['run'] = run
        key = (run.partition.name, run.seed)
        if key not in reference:
            reference[key] = record
        elif record['partition_csv'] != reference[key]['partition_csv']:
            raise SuiteError(f'runs {reference[key]["run"].label} and {run.label} trained on different partitions')
        records.append(record)
    return records


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _stdev(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.stdev(values) if len(values) >= 2 else None


def aggregate(suite: Suite, records: Sequence[Mapping]) -> list[dict]:
    """One summary row per (partition, algorithm) with at least one complete run.

    Accuracies are in %: `accuracy_mean` is the mean over seeds of the
    across-client mean, `accuracy_std_over_seeds` its standard deviation over
    seeds (n - 1), `client_std` the mean over seeds of the across-client
    (population) standard deviation, `worst_10` the mean over seeds of the
    mean of the worst 10% of clients, `per_client` client i's accuracy
    averaged over seeds.

    Args:
      suite: the suite.
      records: `load_results(...)`.

    Returns:
      The rows, partition-major, algorithms in suite order.
    """
    rows = []
    for partition in suite.partitions:
        for algorithm in suite.algorithms:
            mine = [r for r in records if r['run'].partition is partition and r['run'].algorithm is algorithm]
            if not mine:
                continue
            model = algorithm.model
            means = [100 * r['summary'][model]['mean'] for r in mine]
            stds = [100 * r['summary'][model]['std'] for r in mine]
            worst = [100 * r['summary'][model]['worst_10'] for r in mine]
            num_clients = len(mine[0]['clients'])
            if any(len(r['clients']) != num_clients for r in mine):
                raise SuiteError(f'runs of {partition.name}/{algorithm.name} have different numbers of clients')
            per_client = [statistics.fmean(100 * r['clients'][i]['accuracy'] for r in mine) for i in range(num_clients)]
            reached = [r['rounds_to_target'] for r in mine if r['rounds_to_target'] is not None]
            communication = [r['communication'] for r in mine]
            rows.append(
                collections.OrderedDict(
                    partition=partition.name,
                    algorithm=algorithm.name,
                    model=model,
                    seeds=' '.join(str(r['seed']) for r in mine),
                    runs=f'{len(mine)}/{len(suite.seeds)}',
                    accuracy_mean=statistics.fmean(means),
                    accuracy_std_over_seeds=_stdev(means),
                    client_std=statistics.fmean(stds),
                    client_std_over_seeds=_stdev(stds),
                    worst_10=statistics.fmean(worst),
                    rounds=mine[0]['rounds'],
                    rounds_to_target=_mean(reached),
                    rounds_to_target_reached=f'{len(reached)}/{len(mine)}',
                    bytes_down_per_client_per_round=_mean(
                        c.get('bytes_down_per_client_per_round') for c in communication
                    ),
                    bytes_up_per_client_per_round=_mean(c.get('bytes_up_per_client_per_round') for c in communication),
                    bytes_down_per_client=_mean(c.get('bytes_down_per_client') for c in communication),
                    bytes_up_per_client=_mean(c.get('bytes_up_per_client') for c in communication),
                    minutes_per_run=statistics.fmean(r['seconds'] for r in mine) / 60,
                    per_client=per_client,
                )
            )
    return rows


def write_report(suite: Suite, output_dir: str, *, log: Callable[[str], None] = print) -> list[dict]:
    """Writes results.csv, summary.csv, report.md and the plots from the complete runs.

    Args:
      suite: the suite.
      output_dir: the benchmark's directory (holding `suite.toml`).
      log: receives where the report is.

    Returns:
      `aggregate`'s rows.
    """
    output_dir = os.path.abspath(output_dir)
    with _locked(os.path.join(output_dir, '.lock')):
        records = load_results(suite, output_dir)
        rows = aggregate(suite, records)
        reports.write_csv(
            os.path.join(output_dir, 'results.csv'),
            [
                collections.OrderedDict(
                    partition=r['partition'],
                    algorithm=r['algorithm'],
                    seed=r['seed'],
                    client=i,
                    client_id=c['client_id'],
                    model=r['model'],
                    accuracy=c['accuracy'],
                )
                for r in records
                for i, c in enumerate(r['clients'])
            ],
        )
        reports.write_csv(
            os.path.join(output_dir, 'summary.csv'),
            [{k: v for k, v in row.items() if k != 'per_client'} for row in rows],
        )
        plots = _write_plots(suite, output_dir, records, rows)
        commands = (_file_text(os.path.join(output_dir, COMMANDS_FILE)) or '').splitlines()
        text = render_report(suite, output_dir, records, rows, plots, commands)
        reports.write_text_atomic(os.path.join(output_dir, 'report.md'), text)
    log(f'report: {os.path.join(output_dir, "report.md")} ({len(records)} of {len(suite.runs())} runs complete)')
    return rows


def _write_plots(suite, output_dir, records, rows) -> list[tuple[str, str]]:
    plots = []
    for partition in suite.partitions:
        mine = [row for row in rows if row['partition'] == partition.name]
        if not mine:
            continue
        labels = [row['algorithm'] for row in mine]
        curves = collections.defaultdict(dict)
        for row in mine:
            points = collections.defaultdict(list)
            for record in records:
                if record['run'].partition is partition and record['algorithm'] == row['algorithm']:
                    for point in record['curve']:
                        points[point['round']].append(100 * point['accuracy'])
            for round_num, values in points.items():
                curves[round_num][row['algorithm']] = statistics.fmean(values)
        curve_rows = [{'round': r, **curves[r]} for r in sorted(curves)]
        name = f'curves_{partition.slug}.png'
        reports.plot_curves(
            curve_rows,
            'round',
            labels,
            os.path.join(output_dir, name),
            f"{suite.name}, {partition.name}: test accuracy of each algorithm's model (mean over seeds)",
            'test accuracy (%)',
        )
        plots.append((f'Test accuracy per round, {partition.name}', name))
        num_clients = max(len(row['per_client']) for row in mine)
        series = {row['algorithm']: row['per_client'] for row in mine if len(row['per_client']) == num_clients}
        name = f'clients_{partition.slug}.png'
        reports.plot_client_bars(
            [str(i) for i in range(num_clients)],
            series,
            os.path.join(output_dir, name),
            f'{suite.name}, {partition.name}: test accuracy per client (mean over seeds)',
            'test accuracy (%)',
        )
        plots.append((f'Per-client accuracy, {partition.name}', name))
        name = f'std_{partition.slug}.png'
        reports.plot_bars(
            labels,
            [row['client_std'] for row in mine],
            os.path.join(output_dir, name),
            f'{suite.name}, {partition.name}: std of accuracy across clients (error bar: std over seeds)',
            'std across clients (%)',
            errors=[row['client_std_over_seeds'] for row in mine],
        )
        plots.append((f'Std across clients, {partition.name}', name))
    return plots


def _display_path(path: str) -> str:
    """`path` relative to the working directory when it is inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith('..') else relative


def _kilobytes(value: float | None) -> str:
    return '' if value is None else f'{value / 1e3:.1f}'


def _pct(value: float | None, decimals: int = 2) -> str:
    return '' if value is None else f'{value:.{decimals}f}'


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return ''
    return _pct(mean) if std is None else f'{_pct(mean)} ± {_pct(std)}'


def paper_table(suite: Suite, rows: Sequence[Mapping]) -> tuple[list, list]:
    """The PersFL paper's Table 3 shape: User i rows, Avg. Acc., Std Dev.

    Columns are `<algorithm> <partition>`, grouped by algorithm. A cell is
    client i's test accuracy (%) averaged over seeds; Avg. Acc. is the mean
    over seeds of the across-client mean and Std Dev the mean over seeds of
    the across-client (population) standard deviation.

    Args:
      suite: the suite.
      rows: `aggregate`'s rows.

    Returns:
      `(table rows, columns)` for `reports.markdown_table`.
    """
    by_key = {(row['algorithm'], row['partition']): row for row in rows}
    columns = ['']
    for algorithm in suite.algorithms:
        for partition in suite.partitions:
            if (algorithm.name, partition.name) in by_key:
                columns.append(f'{algorithm.name} {partition.name}')
    num_clients = max([len(row['per_client']) for row in rows] or [0])
    table = [{'': f'User {i}'} for i in range(num_clients)]
    table += [{'': 'Avg. Acc.'}, {'': 'Std Dev'}]
    for (algorithm, partition), row in by_key.items():
        column = f'{algorithm} {partition}'
        for i, value in enumerate(row['per_client']):
            table[i][column] = _pct(value)
        table[num_clients][column] = _pct(row['accuracy_mean'])
        table[num_clients + 1][column] = _pct(row['client_std'])
    return table, columns


def render_report(
    suite: Suite,
    output_dir: str,
    records: Sequence[Mapping],
    rows: Sequence[Mapping],
    plots: Sequence[tuple[str, str]],
    commands: Sequence[str],
) -> str:
    """The markdown report of a suite's complete runs.

    Args:
      suite: the suite.
      output_dir: the benchmark's directory.
      records: `load_results(...)`.
      rows: `aggregate(...)`.
      plots: `(title, file)` of the plots.
      commands: the recorded invocations.

    Returns:
      The report's text.
    """
    total = len(suite.runs())
    defaults = ', '.join(f'{k}={v}' for k, v in suite.defaults.items())
    lines = [f'# {suite.name}', '']
    if suite.description:
        lines += [suite.description.strip(), '']
    lines += [
        f'Suite `{suite.path}`; seeds {", ".join(str(s) for s in suite.seeds)}; {len(records)} of {total} runs '
        'complete.',
        f'Defaults: {defaults}.',
        '',
        '## Test accuracy per client (%)',
        '',
        "Each cell is client i's test accuracy of the algorithm's model, averaged over seeds. Avg. Acc. is the",
        'mean over seeds of the across-client mean; Std Dev the mean over seeds of the across-client (population)',
        'standard deviation of each run (so it is not the std of the column above, which is seed-averaged).',
        '',
    ]
    table, columns = paper_table(suite, rows)
    lines += [reports.markdown_table(table, columns) if rows else '(no complete runs)', '']
    lines += [
        '## Ours vs the paper (%)',
        '',
        'ours: mean over seeds ± std over seeds of the across-client mean; std: mean over seeds of the',
        'across-client std; worst 10%: mean over seeds of the mean of the worst 10% of clients; diff: ours - paper.',
        '',
    ]
    comparison = []
    for row in rows:
        paper_mean, paper_std = suite.paper.get(row['algorithm'], {}).get(row['partition'], (None, None))
        comparison.append(
            {
                'algorithm': row['algorithm'],
                'partition': row['partition'],
                'model': row['model'],
                'runs': row['runs'],
                'ours': _mean_std(row['accuracy_mean'], row['accuracy_std_over_seeds']),
                'ours std': _pct(row['client_std']),
                'worst 10%': _pct(row['worst_10']),
                'paper': _pct(paper_mean, 1),
                'paper std': _pct(paper_std, 1),
                'diff': '' if paper_mean is None else f'{row["accuracy_mean"] - paper_mean:+.2f}',
                'diff std': '' if paper_std is None else f'{row["client_std"] - paper_std:+.2f}',
            }
        )
    columns = [
        'algorithm',
        'partition',
        'model',
        'runs',
        'ours',
        'ours std',
        'worst 10%',
        'paper',
        'paper std',
        'diff',
        'diff std',
    ]
    lines += [reports.markdown_table(comparison, columns), '']
    target = (
        'no target_accuracy set'
        if suite.target_accuracy is None
        else (
            f'first evaluated round whose mean test accuracy across clients is >= {100 * suite.target_accuracy:g}%, '
            'averaged over the seeds that reach it (reached: seeds that do)'
        )
    )
    lines += [
        '## Communication and rounds to target',
        '',
        f'Rounds to target: {target}. A model made by a final `personalize` stage exists only at the last round.',
        "Communication: bytes of one round per participating client, read from the round's type signature",
        '(`audit.communication_bytes`: every `federated_broadcast` down, every CLIENTS -> SERVER aggregation up),',
        "times the clients of each round, summed over the rounds, plus a final `personalize` stage's bytes for",
        'every client; divided by the number of clients. Evaluation is not counted. kB = 10^3 bytes, MB = 10^6.',
        "Per round: one participating client's bytes in one training round.",
        '',
    ]
    cost = []
    for row in rows:
        cost.append(
            {
                'algorithm': row['algorithm'],
                'partition': row['partition'],
                'rounds': row['rounds'],
                'rounds to target': f'{row["rounds_to_target"]:.1f}'
                if row['rounds_to_target'] is not None
                else ('not reached' if suite.target_accuracy is not None else ''),
                'reached': row['rounds_to_target_reached'],
                'kB down / client / round': _kilobytes(row['bytes_down_per_client_per_round']),
                'kB up / client / round': _kilobytes(row['bytes_up_per_client_per_round']),
                'MB down / client': ''
                if row['bytes_down_per_client'] is None
                else f'{row["bytes_down_per_client"] / 1e6:.3f}',
                'MB up / client': ''
                if row['bytes_up_per_client'] is None
                else f'{row["bytes_up_per_client"] / 1e6:.3f}',
                'minutes / run': f'{row["minutes_per_run"]:.2f}',
            }
        )
    columns = [
        'algorithm',
        'partition',
        'rounds',
        'rounds to target',
        'reached',
        'kB down / client / round',
        'kB up / client / round',
        'MB down / client',
        'MB up / client',
        'minutes / run',
    ]
    lines += [reports.markdown_table(cost, columns), '']
    lines += [
        '## Commands',
        '',
        'Reproduce (skips complete runs; add `--seeds=`, `--algorithms=`, `--partitions=` to split the work):',
        '',
        f'    tff-pfl-bench --suite={suite.path} --output_dir={_display_path(output_dir)}',
        '',
    ]
    if commands:
        lines += ['Invocations that wrote this directory:', '']
        lines += [f'    {command}' for command in commands]
        lines += ['']
    lines += [f'![{title}]({path})' for title, path in plots]
    return '\n'.join(lines) + '\n'
