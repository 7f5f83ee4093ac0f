"""Reading a benchmark suite file: the TOML suite format and its validation.

The file is read into a `bench_suite.Suite` (the suite, its runs and each
run's configuration).

Suite format (`tomllib`; see docs/benchmarks.md):

    name = "persfl_mnist"              # required
    description = "..."                # optional
    [defaults]                         # settings (docs/settings.md), except
    dataset = "npz:../shared/data/mnist.npz"   # output_dir, algorithm,
    num_clients = 10                   # partition and seed; paths are
    rounds = 100                       # relative to the working directory;
    batch_size = 32                    # each run takes those it has
    seeds = [0, 1, 2]                  # required: the suite's seeds
    target_accuracy = 0.95             # optional: for rounds-to-target
    headline_model = "global_model"    # optional: default `model` below
    [[partitions]]
    name = "ds1"                       # label used in tables and paths
    partition = "ds1"                  # the flat setting `partition`
    classes_per_client = 4             # any other common settings
    [[algorithms]]
    name = "FedAvg"                    # label used in tables
    algorithm = "fedavg"               # ExperimentConfig.algorithm, or a bench_peers name
    model = "global_model"             # global_model | personalized_model
    [algorithms.overrides]             # the algorithm's or common settings
    client_learning_rate = 0.05
    [algorithms.partition_overrides.ds2]   # fields for one partition label
    rounds = 50
    [paper]                            # optional reference numbers (%):
    "FedAvg" = { ds1 = [92.0, 1.7] }   # algorithm label -> partition -> [mean, std]
    "PersFL" = { ds1 = { mean = 98.6, top10 = 99.0 } }  # or metric -> value
    [paper_source]                     # optional, with [paper]: where the
    source = "PersFL, Table 3, MNIST"  # numbers come from (the scoreboard)
    measure = "last round"             # or "best round on test" (leaderboard)
    [paper_errors]                     # optional: [paper] cells that are the
    "FedPer" = { ds2 = "..." }         # paper's own errors -> the reason
    [tuning]                           # optional: one tuning budget for all
    seed = 0                           # trials run on this seed (one of seeds)
    trials = 4                         # every tuned algorithm's trial count
    select = "last"                    # "last" | "selected" (validation round)
    [algorithms.tune]                  # in [[algorithms]], with [tuning]: the
    client_learning_rate = [0.01, 0.05]   # product of these lists are the
    ditto_lambda = [0.1, 1.0]          # trials; or `untuned = "reason"`

A `[paper]` cell is `[mean, std]` (the across-client mean and the
across-client std), a number (the across-client mean), or a table naming the
metrics it targets (`bench_suite.PAPER_METRICS`): `mean` takes a number or
`[mean, std]`, `weighted`, `worst10` and `top10` a number. A
`[paper_errors]` cell names a `[paper]` cell the paper got wrong (a column
copied from another, say) and why; the scoreboard marks its numbers and
leaves them out of its counts.

A run's configuration is the settings' defaults (the common
`ExperimentConfig` and the algorithm's settings dataclass), updated in this
order (later wins): `[defaults]` (each run takes the common settings and its
algorithm's, so that one table can serve algorithms with different
settings; a key no algorithm of the suite has is an error), the partition
entry, the algorithm's `overrides` and its `partition_overrides` for that
partition (a key there that the algorithm does not have is an error). The
whole suite is validated when it is loaded (`load_suite`): unknown keys,
unknown settings, unknown algorithms, every resulting configuration's
`validate()`, and that every algorithm of a partition trains on the same
client data; errors are `bench_suite.SuiteError`s with a one-line message naming the file
and the key.

An algorithm entry may also name one of TFF's own processes (`bench_peers`;
see `bench_suite`).

The tuning protocol (`[tuning]`, docs/benchmarks.md "Tuning protocol"): every
algorithm of such a suite has either a `tune` table, whose lists' cartesian
product (keys in file order, the last varying fastest) has exactly
`[tuning] trials` combinations, or an `untuned = "reason"` string. A trial
(`tuning.Trial`) is one combination on one partition, run on the tuning seed;
its configuration is the run's updated by the trial's values (`bench_suite.Suite.config`'s
`tuned`), validated at load time like every run's. A `tune` key must be a
setting the algorithm has and must not change the client data; the suite
must set `eval_validation = true` (`bench_suite.VALIDATION_SETTING`), since the choice
reads validation accuracy only (`tuning`).
"""

import math
import tomllib
import typing
from collections.abc import Mapping, Sequence

from tff_pfl import settings as settings_lib
from tff_pfl.program import algorithms as algorithms_lib
from tff_pfl.program import config_parts, experiment, run_config
from tff_pfl_bench import bench_peers, bench_suite, leaderboard

_RESERVED = ('output_dir', 'algorithm', 'partition', 'seed')
_COMMON_HINTS = {name: hint for _, name, hint, _, _ in run_config.ExperimentConfig.common_settings()}
_SUITE_KEYS = (
    'name',
    'description',
    'defaults',
    'partitions',
    'algorithms',
    'paper',
    'paper_source',
    'paper_errors',
    'tuning',
)
_DEFAULTS_EXTRA = ('seeds', 'target_accuracy', 'headline_model')
_ALGORITHM_KEYS = ('name', 'algorithm', 'model', 'overrides', 'partition_overrides', 'tune', 'untuned')
# What decides a run's client data besides `data.partition.params()` and the seed.
_DATA_FIELDS = ('dataset', 'data_dir', 'num_clients', 'split_fractions')
# Settings a `tune` table may not name: they change the client data (`_data_key`).
_DATA_SETTINGS = (*_DATA_FIELDS, 'partition', 'public_examples', *config_parts.PARTITION_SETTINGS)
_TUNING_KEYS = ('seed', 'trials', 'select')


# ----------------------------------------------------------------------------
# Loading and validation.


def load_suite(path: str) -> bench_suite.Suite:
    """Reads and validates a suite file.

    Args:
      path: the TOML file.

    Returns:
      The `bench_suite.Suite`.

    Raises:
      bench_suite.SuiteError: the file is missing or unreadable, is not TOML, or does not
        describe a valid suite.
    """
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        raise bench_suite.SuiteError(f'suite file not found: {path}') from None
    except OSError as e:
        raise bench_suite.SuiteError(f'cannot read suite file {path}: {e.strerror}') from None
    try:
        text = data.decode('utf-8')
    except UnicodeDecodeError:
        raise bench_suite.SuiteError(f'{path}: not UTF-8 text') from None
    return parse_suite(text, path)


def parse_suite(text: str, path: str = '<suite>') -> bench_suite.Suite:
    """Parses and validates a suite from its TOML text.

    Args:
      text: the TOML text.
      path: the file name used in error messages and in the report.

    Returns:
      The `bench_suite.Suite`.

    Raises:
      bench_suite.SuiteError: the text is not TOML or does not describe a valid suite.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise bench_suite.SuiteError(f'{path}: bad TOML: {_one_line(e)}') from None

    def fail(where, message):
        raise bench_suite.SuiteError(f'{path}: {where}: {message}')

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
    if headline_model not in bench_suite.MODELS:
        fail('defaults.headline_model', f'must be one of {", ".join(bench_suite.MODELS)}, got {headline_model!r}')
    config_defaults = _config_fields(
        {k: v for k, v in defaults.items() if k not in _DEFAULTS_EXTRA}, 'defaults', fail, _RESERVED
    )
    tuning = _tuning_table(raw, seeds, fail)

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
            fail(f'{where}.partition', 'required, a string (the flat setting partition)')
        fields = _config_fields(
            {k: v for k, v in entry.items() if k != 'name'}, where, fail, ('output_dir', 'algorithm', 'seed')
        )
        partitions.append(bench_suite.PartitionEntry(label, bench_suite.slug(label), fields))
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
        if registry not in bench_suite.known_algorithms():
            fail(
                f'{where}.algorithm',
                f'unknown algorithm {registry!r}; known: {", ".join(bench_suite.known_algorithms())}',
            )
        model = entry.get('model', headline_model)
        if model not in bench_suite.MODELS:
            fail(f'{where}.model', f'must be one of {", ".join(bench_suite.MODELS)}, got {model!r}')
        if bench_peers.is_peer(registry) and model not in bench_peers.PEERS[registry].models:
            fail(f'{where}.model', f'{registry} reports {", ".join(bench_peers.PEERS[registry].models)}, not {model!r}')
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
        tune, untuned = _tune_entry(entry, registry, where, tuning, fail)
        entries.append(
            bench_suite.AlgorithmEntry(
                label, bench_suite.slug(label), registry, model, overrides, per_partition, tune, untuned
            )
        )
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
            paper[algorithm_name][partition_name] = _paper_cell(value, key, fail)
    paper_source, paper_measure = '', leaderboard.PAPER_MEASURES[0]
    if 'paper_source' in raw:
        source_table = _table(raw['paper_source'], 'paper_source', fail)
        _unknown_keys(source_table, ('source', 'measure'), 'paper_source', fail)
        paper_source = source_table.get('source')
        if not isinstance(paper_source, str) or not paper_source.strip():
            fail('paper_source.source', 'required, a non-empty string (e.g. "KT-pFL, Table 2, Fashion-MNIST")')
        paper_measure = source_table.get('measure', paper_measure)
        if paper_measure not in leaderboard.PAPER_MEASURES:
            known = ', '.join(f'"{m}"' for m in leaderboard.PAPER_MEASURES)
            fail('paper_source.measure', f'must be one of {known}, got {paper_measure!r}')
        if not paper:
            fail('paper_source', 'given without a [paper] table')
    paper_errors = {}
    for algorithm_name, cells in _table(raw.get('paper_errors', {}), 'paper_errors', fail).items():
        if algorithm_name not in algorithm_names:
            known = ', '.join(algorithm_names)
            fail(f'paper_errors.{algorithm_name}', f'unknown algorithm label; the suite has {known}')
        for partition_name, reason in _table(cells, f'paper_errors.{algorithm_name}', fail).items():
            key = f'paper_errors.{algorithm_name}.{partition_name}'
            if partition_name not in partition_names:
                fail(key, f'unknown partition label; the suite has {", ".join(partition_names)}')
            if partition_name not in paper.get(algorithm_name, {}):
                fail(key, f'no such [paper] cell (paper.{algorithm_name}.{partition_name}): a paper error marks one')
            if not isinstance(reason, str) or not reason.strip():
                fail(key, "must be a non-empty string: why the paper's number is wrong")
            paper_errors.setdefault(algorithm_name, {})[partition_name] = ' '.join(reason.split())

    suite = bench_suite.Suite(
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
        paper_source=paper_source.strip(),
        paper_measure=paper_measure,
        paper_errors=paper_errors,
        tuning=tuning,
    )
    used = set(run_config.ExperimentConfig.common_fields()).union(
        *(bench_suite.setting_names(a.algorithm) for a in entries)
    )
    for key in config_defaults:
        if key not in used:
            fail(f'defaults.{key}', "is a setting of none of the suite's algorithms")
    if tuning is not None and config_defaults.get(bench_suite.VALIDATION_SETTING) is not True:
        fail(
            f'defaults.{bench_suite.VALIDATION_SETTING}',
            "must be true in a suite with [tuning]: the choice reads each trial's validation accuracy",
        )
    _validate_configs(suite, fail)
    return suite


def _tuning_table(raw: Mapping, seeds: Sequence[int], fail) -> bench_suite.Tuning | None:
    """The `[tuning]` table, checked; None without one."""
    if 'tuning' not in raw:
        return None
    table = _table(raw['tuning'], 'tuning', fail)
    _unknown_keys(table, _TUNING_KEYS, 'tuning', fail)
    seed = table.get('seed')
    if seed not in seeds or isinstance(seed, bool):
        fail('tuning.seed', f'required, one of the seeds {list(seeds)} (the trials run on it), got {seed!r}')
    trials = table.get('trials')
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        fail('tuning.trials', f"required, a positive integer (every tuned algorithm's trial count), got {trials!r}")
    select = table.get('select')
    if select not in bench_suite.TUNING_SELECT:
        fail(
            'tuning.select', f'required, one of {", ".join(repr(s) for s in bench_suite.TUNING_SELECT)}, got {select!r}'
        )
    return bench_suite.Tuning(seed, trials, select)


def _tune_entry(
    entry: Mapping, registry: str, where: str, tuning: bench_suite.Tuning | None, fail
) -> tuple[tuple, str | None]:
    """An algorithm entry's `tune` table (`bench_suite.AlgorithmEntry.tune`) and `untuned` reason, checked."""
    if tuning is None:
        for key in ('tune', 'untuned'):
            if key in entry:
                fail(f'{where}.{key}', 'given without a [tuning] table')
        return (), None
    if 'tune' in entry and 'untuned' in entry:
        fail(where, 'has both tune and untuned; give one')
    if 'untuned' in entry:
        reason = entry['untuned']
        if not isinstance(reason, str) or not reason.strip():
            fail(f'{where}.untuned', 'must be a non-empty string: why the algorithm is not tuned (shown in the report)')
        return (), reason.strip()
    if 'tune' not in entry:
        fail(
            where,
            f'needs a tune table of [tuning] trials = {tuning.trials} combinations, or untuned = "reason": '
            'every algorithm gets the same tuning budget',
        )
    key_where = f'{where}.tune'
    table = _table(entry['tune'], key_where, fail)
    if not table:
        fail(key_where, 'names no setting')
    if bench_peers.is_peer(registry):
        fail(key_where, f"{registry} is TFF's own process, scored on test only: it cannot be tuned on validation")
    own = set(bench_suite.setting_names(registry)) | set(run_config.ExperimentConfig.common_fields())
    tune = []
    for key, values in table.items():
        if key in _RESERVED:
            fail(f'{key_where}.{key}', 'set by the harness, not allowed here')
        if key == bench_suite.VALIDATION_SETTING:
            fail(f'{key_where}.{key}', "is the tuning protocol's own setting (true), not a knob to tune")
        if key in _DATA_SETTINGS:
            fail(f'{key_where}.{key}', 'changes the client data; every trial of a partition trains on the same clients')
        if not isinstance(values, list) or not values:
            fail(f'{key_where}.{key}', f'must be a non-empty list of values, got {values!r}')
        coerced = [_config_fields({key: value}, key_where, fail, _RESERVED)[key] for value in values]
        if key not in own:
            fail(f'{key_where}.{key}', f'{key} does not apply to {registry}')
        if len(set(coerced)) != len(coerced):
            fail(f'{key_where}.{key}', f'repeated value in {values}')
        tune.append((key, tuple(coerced)))
    count = math.prod(len(values) for _, values in tune)
    if count != tuning.trials:
        sizes = ' x '.join(str(len(values)) for _, values in tune)
        fail(
            key_where,
            f'{count} trials ({sizes}), but [tuning] trials = {tuning.trials}: every algorithm gets the same budget',
        )
    slugs = [bench_suite.trial_slug(values) for values in bench_suite.combinations(tune)]
    if len(set(slugs)) != len(slugs):
        fail(key_where, 'two trials name the same directory; give values that differ in letters or digits')
    return tuple(tune), None


def _validate_configs(suite: bench_suite.Suite, fail) -> None:
    """Every run's and trial's configuration validates; a partition's client data are shared."""
    for partition in suite.partitions:
        reference = None
        for algorithm in suite.algorithms:
            where = f'algorithms "{algorithm.name}" on partitions "{partition.name}"'
            try:
                config = suite.config(partition, algorithm, suite.seeds[0], output_dir='x').validate()
            except run_config.ConfigError as e:
                fail(where, str(e))
            data = _data_key(config)
            if suite.tuning is not None:
                _validate_trials(suite, partition, algorithm, config, fail)
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


def _validation_on(config: run_config.ExperimentConfig) -> bool:
    """Whether the run scores its clients' validation splits (`bench_suite.VALIDATION_SETTING`)."""
    return config.flat_value(bench_suite.VALIDATION_SETTING) is True


def _validate_trials(
    suite: bench_suite.Suite, partition: bench_suite.PartitionEntry, algorithm: bench_suite.AlgorithmEntry, config, fail
) -> None:
    """In a suite with `[tuning]`: the run scores validation; each trial validates on the run's client data."""
    if not _validation_on(config):
        fail(f'algorithms "{algorithm.name}" on partitions "{partition.name}"', _VALIDATION_OFF)
    data = _data_key(config)
    for values in algorithm.combinations():
        trial = ', '.join(f'{key}={value}' for key, value in values)
        where = f'algorithms "{algorithm.name}" trial {trial} on partitions "{partition.name}"'
        try:
            trial_config = suite.config(partition, algorithm, suite.tuning.seed, 'x', tuned=dict(values)).validate()
        except run_config.ConfigError as e:
            fail(where, str(e))
        if not _validation_on(trial_config):
            fail(where, _VALIDATION_OFF)
        changed = [field for field, value in _data_key(trial_config).items() if value != data[field]]
        if changed:
            fail(where, f'changes the client data ({changed[0]}); every trial trains on the same clients')


_VALIDATION_OFF = (
    f'{bench_suite.VALIDATION_SETTING} must be true in a suite with [tuning] (the choice reads validation accuracy)'
)


def _paper_cell(value, key, fail) -> dict:
    """A `[paper]` cell -> metric -> (value, std or None); see the module docstring."""
    if not isinstance(value, dict):
        if not (_is_number(value) or isinstance(value, list)):
            fail(
                key,
                'must be [mean, std] in %, a number (the mean) or a table of metrics '
                f'({", ".join(bench_suite.PAPER_METRICS)}), got {value!r}',
            )
        value, bare = {'mean': value}, True
    else:
        bare = False
    if not value:
        fail(key, f'names no metric; known: {", ".join(bench_suite.PAPER_METRICS)}')
    for metric in value:
        if metric not in bench_suite.PAPER_METRICS:
            fail(f'{key}.{metric}', f'unknown metric; known: {", ".join(bench_suite.PAPER_METRICS)}')
    cell = {}
    for metric in bench_suite.PAPER_METRICS:  # in a fixed order, whatever the file's
        if metric not in value:
            continue
        number, where = value[metric], key if bare else f'{key}.{metric}'
        if metric == 'mean' and isinstance(number, list):
            if not (len(number) == 2 and all(_is_number(v) for v in number)):
                fail(where, f'must be [mean, std] in %, got {number!r}')
            number, std = number
            if not 0 <= std <= 100:
                fail(where, f'std must be in [0, 100] (%), got {std!r}')
            std = float(std)
        else:
            std = None
            if not _is_number(number):
                kind = 'a number or [mean, std] in %' if metric == 'mean' else 'a number in %'
                fail(where, f'must be {kind}, got {number!r}')
        if not 0 <= number <= 100:
            fail(where, f'must be in [0, 100] (%), got {number!r}')
        cell[metric] = (float(number), std)
    return cell


def _data_key(config: run_config.ExperimentConfig) -> dict:
    """What decides a run's client data, seed aside."""
    key = {field: config.flat_value(field) for field in _DATA_FIELDS}
    # Public examples drawn from another source leave the clients' data as it is.
    key['public_examples'] = 0 if experiment.public_dataset(config) else experiment.public_examples(config)
    key['partition'] = config.data.partition.name
    key.update((f'partition_params.{k}', v) for k, v in sorted(config.data.partition.params().items()))
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
    if not isinstance(label, str) or not bench_suite.slug(label):
        fail(f'{where}.name', 'required, a string with a letter or digit')
    return label


def _unique_labels(entries, where, fail) -> None:
    seen = {}
    for entry in entries:
        if entry.slug in seen:
            fail(where, f'labels "{seen[entry.slug]}" and "{entry.name}" name the same directory {entry.slug!r}')
        seen[entry.slug] = entry.name


def _config_fields(table: Mapping, where: str, fail, reserved: Sequence[str]) -> dict:
    """TOML values -> common or algorithm setting values, type-checked (docs/settings.md)."""
    values = {}
    for key, value in table.items():
        if key in reserved:
            fail(f'{where}.{key}', 'set by the harness, not allowed here')
        hint = _COMMON_HINTS.get(key) if key in run_config.ExperimentConfig.common_fields() else None
        if hint is None:
            users = algorithms_lib.users_of(key)
            if not users:
                fail(f'{where}.{key}', 'unknown key (not a setting: docs/settings.md)')
            hint = typing.get_type_hints(algorithms_lib.get(users[0]).settings)[key]
        try:
            values[key] = settings_lib.coerce(key, value, hint)
        except settings_lib.SettingsError as e:
            fail(f'{where}.{key}', str(e))
    return values
