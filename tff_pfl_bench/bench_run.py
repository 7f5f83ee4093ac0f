"""Running a benchmark suite: every run not complete yet, resumable, split over processes.

Every (partition, algorithm, seed) of a suite (`bench_suite`) is one
`experiment.run_experiment` run in its own directory (one of TFF's own
processes named as a peer, `bench_peers.run_peer`); the harness skips runs
that are already complete and continues an interrupted run from its newest
checkpoint, so a suite can be resumed after an interruption, run in several
sittings, or split over processes by seed, algorithm or partition. At the
end `run_suite` aggregates whatever is complete into the report
(`bench_report`).

Output directory (`run_suite`):

    <output_dir>/suite.toml            the suite the results belong to
    <output_dir>/commands.txt          every invocation, one per line
    <output_dir>/runs/<partition>/<algorithm>/seed<k>/
                                       a `run_experiment` directory, plus
                                       bench_result.json (`bench_record`),
                                       written last: a run is complete when
                                       it exists
    <output_dir>/results.csv, summary.csv, report.md and plots: `bench_report`

Results directory (`results_dir`, e.g. the committed
`benchmarks/results/<name>_suite/`): what outlives the output directory. It
holds the report, its CSVs and plots, `suite.toml`, `commands.txt` and one
record per complete run,

    <results_dir>/records/<partition>/<algorithm>/seed<k>.json

(the run's `bench_result.json`). `restore_results` takes those records as
complete runs of a new output directory, so a suite run over several
machines or sittings adds its missing runs to what is committed;
`publish_results` writes the report and every complete run's record back.

A suite with `[tuning]` (`tuning`) also has trials: on each partition, a
tuned algorithm's trials run first, on the tuning seed, each a run in
`<output_dir>/runs/<partition>/<algorithm>/trials/<trial slug>/`, recorded
at `<results_dir>/records/<partition>/<algorithm>/trials/<trial slug>.json`
(`restore_trials`, `publish_results`) and resumed like runs. Once all of an
algorithm's trials on a partition are complete, its runs use the setting
chosen on validation (`tuning.choice`); its run on the tuning seed is the
chosen trial, whose record is copied, not rerun. Until then its runs wait
(one line says so): `--seeds` without the tuning seed runs them only once
the trials are complete.
"""

import fcntl
import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import tensorflow_federated as tff

from tff_pfl import reports, runtime
from tff_pfl.computations import audit
from tff_pfl.program import experiment
from tff_pfl.program import run_config as run_config_lib
from tff_pfl_bench import bench_layout, bench_peers, bench_record, bench_report, bench_suite, tuning

# Rounds between a run's checkpoints: an interrupted sitting loses at most this many rounds of its run.
CHECKPOINT_EVERY = 5


# ----------------------------------------------------------------------------
# The output directory.


def _stored_suite(output_dir: str) -> str | None:
    path = os.path.join(output_dir, bench_layout.SUITE_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding='utf-8') as f:
        return f.read()


def _check_output_dir(suite: bench_suite.Suite, output_dir: str, overwrite: bool) -> None:
    """Refuses an output directory that cannot hold this suite's results; writes nothing."""
    if os.path.exists(output_dir):
        if not os.path.isdir(output_dir):
            raise bench_suite.SuiteError(f'output_dir {output_dir} exists and is not a directory')
        stored = _stored_suite(output_dir)
        if not overwrite:
            if stored is None and os.listdir(output_dir):
                raise bench_suite.SuiteError(
                    f'output_dir {output_dir} is not empty and holds no benchmark; pass --overwrite to replace it'
                )
            if stored is not None and not bench_suite.same_runs(stored, suite):
                raise bench_suite.SuiteError(
                    f'output_dir {output_dir} holds results of a different suite '
                    f'(see {os.path.join(output_dir, bench_layout.SUITE_FILE)}); pass --overwrite to replace them'
                )
        probe_dir = output_dir
    else:
        probe_dir = os.path.dirname(output_dir) or '.'
        while not os.path.exists(probe_dir):
            probe_dir = os.path.dirname(probe_dir) or '.'
    try:
        tempfile.NamedTemporaryFile(dir=probe_dir, prefix='.probe.').close()
    except OSError as e:
        raise bench_suite.SuiteError(f'output_dir {output_dir} is not writable: {e.strerror}') from None


def _prepare_output_dir(suite: bench_suite.Suite, output_dir: str, overwrite: bool, command: str | None) -> None:
    _check_output_dir(suite, output_dir, overwrite)
    os.makedirs(output_dir, exist_ok=True)
    with bench_layout.locked(os.path.join(output_dir, '.lock')):
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
        elif stored is not None and not bench_suite.same_runs(stored, suite):  # another process got here first
            raise bench_suite.SuiteError(f'output_dir {output_dir} holds results of a different suite')
        if _stored_suite(output_dir) != suite.text:  # new, or the same runs with other paper numbers or text
            reports.write_text_atomic(os.path.join(output_dir, bench_layout.SUITE_FILE), suite.text)
        if command:
            with open(os.path.join(output_dir, bench_layout.COMMANDS_FILE), 'a', encoding='utf-8') as f:
                f.write(command.replace('\n', ' ') + '\n')


def check_report_dir(suite: bench_suite.Suite, output_dir: str) -> None:
    """Raises `bench_suite.SuiteError` unless `output_dir` holds results of `suite`.

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.
    """
    if not os.path.isdir(output_dir):
        raise bench_suite.SuiteError(f'output_dir {output_dir} does not exist')
    stored = _stored_suite(output_dir)
    if stored is None:
        raise bench_suite.SuiteError(
            f'output_dir {output_dir} holds no benchmark ({bench_layout.SUITE_FILE} is missing)'
        )
    if not bench_suite.same_runs(stored, suite):
        stored_path = os.path.join(output_dir, bench_layout.SUITE_FILE)
        raise bench_suite.SuiteError(f'output_dir {output_dir} holds results of a different suite (see {stored_path})')


def check_results_dir(suite: bench_suite.Suite, output_dir: str, results_dir: str) -> None:
    """Refuses a results directory that cannot hold this suite's results; writes nothing.

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.
      results_dir: the results directory (need not exist).

    Raises:
      bench_suite.SuiteError: it is the output directory, is not a directory,
        holds another suite's results, or holds files but no suite.
    """
    if os.path.abspath(results_dir) == os.path.abspath(output_dir):
        raise bench_suite.SuiteError(f'results_dir {results_dir} is the output directory; give another one')
    if not os.path.exists(results_dir):
        return
    if not os.path.isdir(results_dir):
        raise bench_suite.SuiteError(f'results_dir {results_dir} exists and is not a directory')
    stored = _stored_suite(results_dir)
    if stored is None and os.listdir(results_dir):
        raise bench_suite.SuiteError(
            f'results_dir {results_dir} is not empty and holds no benchmark ({bench_layout.SUITE_FILE})'
        )
    if stored is not None and not bench_suite.same_runs(stored, suite):
        raise bench_suite.SuiteError(
            f'results_dir {results_dir} holds results of a different suite '
            f'(see {os.path.join(results_dir, bench_layout.SUITE_FILE)})'
        )


def restore_results(suite: bench_suite.Suite, output_dir: str, results_dir: str) -> int:
    """Takes the records kept in `results_dir` as complete runs of `output_dir`.

    A run whose directory does not exist in `output_dir` gets one holding
    only its record as `bench_result.json`; a run present there (complete,
    or being trained by another process) is left alone. The commands of
    `results_dir` that `output_dir` lacks go first in its `commands.txt`.

    Args:
      suite: the suite (`check_results_dir` accepted `results_dir`).
      output_dir: the benchmark's output directory, prepared.
      results_dir: the results directory (need not exist).

    Returns:
      How many runs were restored.
    """
    restored = 0
    with bench_layout.locked(os.path.join(output_dir, '.lock')):
        for run in suite.runs():
            source, directory = bench_layout.record_path(results_dir, run), run.directory(output_dir)
            if os.path.exists(source) and not os.path.exists(directory):
                os.makedirs(directory)
                reports.write_text_atomic(
                    os.path.join(directory, bench_layout.RESULT_FILE), bench_layout.file_text(source)
                )
                restored += 1
        kept = (bench_layout.file_text(os.path.join(results_dir, bench_layout.COMMANDS_FILE)) or '').splitlines()
        mine = (bench_layout.file_text(os.path.join(output_dir, bench_layout.COMMANDS_FILE)) or '').splitlines()
        if any(line not in mine for line in kept):
            merged = [line for line in kept if line not in mine] + mine
            reports.write_text_atomic(os.path.join(output_dir, bench_layout.COMMANDS_FILE), '\n'.join(merged) + '\n')
    return restored


def restore_trials(suite: bench_suite.Suite, output_dir: str, results_dir: str) -> int:
    """Takes the trial records kept in `results_dir` as complete trials of `output_dir` (`restore_results`'s rule).

    Args:
      suite: the suite (`check_results_dir` accepted `results_dir`).
      output_dir: the benchmark's output directory, prepared.
      results_dir: the results directory (need not exist).

    Returns:
      How many trials were restored (0 without `[tuning]`).
    """
    restored = 0
    with bench_layout.locked(os.path.join(output_dir, '.lock')):
        for trial in tuning.trials(suite):
            source, directory = bench_layout.trial_record_path(results_dir, trial), trial.directory(output_dir)
            if os.path.exists(source) and not os.path.exists(directory):
                os.makedirs(directory)
                reports.write_text_atomic(
                    os.path.join(directory, bench_layout.RESULT_FILE), bench_layout.file_text(source)
                )
                restored += 1
    return restored


def publish_results(
    suite: bench_suite.Suite, output_dir: str, results_dir: str, *, log: Callable[[str], None] = print
) -> int:
    """Writes the report, its CSVs and plots, and every complete run's record to `results_dir`.

    Files of `results_dir` that the report does not write (a notebook's
    figures, say) are kept; records of runs no longer complete in
    `output_dir` are kept too.

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory, its report written.
      results_dir: the results directory; created if needed.
      log: receives where the results went.

    Returns:
      How many records `results_dir` holds for the suite's runs.
    """
    os.makedirs(results_dir, exist_ok=True)
    with bench_layout.locked(os.path.join(output_dir, '.lock')):
        names = [*bench_layout.PUBLISHED_FILES, *bench_layout.TUNING_FILES]
        names += sorted(n for n in os.listdir(output_dir) if n.endswith('.png'))
        for name in names:
            path = os.path.join(output_dir, name)
            if os.path.exists(path):
                shutil.copyfile(path, os.path.join(results_dir, name))
        count = trial_count = 0
        for run in suite.runs():
            count += _copy_record(run.directory(output_dir), bench_layout.record_path(results_dir, run))
        for trial in tuning.trials(suite):
            trial_count += _copy_record(trial.directory(output_dir), bench_layout.trial_record_path(results_dir, trial))
    trials = f', {trial_count} of {len(tuning.trials(suite))} trial records' if suite.tuning is not None else ''
    log(f'results: {results_dir} ({count} of {len(suite.runs())} run records{trials})')
    return count


def _copy_record(directory: str, target: str) -> bool:
    """Copies a complete run's (or trial's) record to `target`; whether `target` exists then."""
    source = os.path.join(directory, bench_layout.RESULT_FILE)
    if os.path.exists(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        reports.write_text_atomic(target, bench_layout.file_text(source))
    return os.path.exists(target)


def _check_data(suite: bench_suite.Suite, runs: Sequence[bench_suite.Run]) -> None:
    """Data files named by the selected runs exist (cheap; before anything is written)."""
    from tff_pfl.data import natural

    for run in runs:
        config = suite.config(run.partition, run.algorithm, run.seed)
        dataset = config.data.dataset
        kind, _, arg = dataset.partition(':')
        path = arg if kind in ('npz', 'folder', 'clients') else (dataset if dataset.endswith('.npz') else None)
        if kind == 'sqlite':
            path = natural.parse_sqlite_spec(arg)[0]
        elif kind == 'tff' and arg in natural.TFF_DATASETS and not config.data.download:
            path = natural.tff_cache_file(arg, config.data.data_dir)
        if path is not None and not os.path.exists(path):
            raise bench_suite.SuiteError(
                f'{suite.path}: dataset {dataset!r} of partitions "{run.partition.name}": '
                f'{path} not found (paths are relative to the working directory)'
            )


# ----------------------------------------------------------------------------
# Running.


def _format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    return f'{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


def _one_line(error: BaseException) -> str:
    return ' '.join(str(error).split())


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


def _reference_partition(
    suite: bench_suite.Suite, output_dir: str, run: bench_suite.Run
) -> tuple[str | None, str | None]:
    """`partition.csv` of the first complete run (or trial) of the same (partition, seed)."""
    for other in [*suite.runs(), *tuning.trials(suite)]:
        if other.partition is run.partition and other.seed == run.seed and other != run:
            text = bench_layout.file_text(os.path.join(other.directory(output_dir), bench_layout.RESULT_FILE))
            # The record keeps the run's partition.csv (restored runs have only it); a converted record
            # (benchmarks/convert_results.py) has none to compare.
            if text is not None and json.loads(text).get('partition_csv') is not None:
                return other.label, json.loads(text)['partition_csv']
    return None, None


def _check_partition(run: bench_suite.Run, partition_text: str | None, reference) -> None:
    """Before training: the run's partition.csv is that of the other runs of its (partition, seed)."""
    reference_label, reference_text = reference
    if reference_text is not None and partition_text != reference_text:
        raise bench_suite.SuiteError(
            f'run {run.label} trains on another partition than {reference_label} '
            '(partition.csv differs); every algorithm of a partition must share it'
        )


def _check_process(run: bench_suite.Run, process, partition_text: str | None, reference) -> dict:
    """Before training: the chosen model exists, the partition is shared; communication."""
    models = [name for name, _ in tff.structure.iter_elements(process.evaluate.type_signature.result.member)]
    if run.algorithm.model not in models:
        raise bench_suite.SuiteError(
            f'algorithms "{run.algorithm.name}" ({run.algorithm.algorithm}) evaluates '
            f'{", ".join(models)}, not model {run.algorithm.model!r}'
        )
    _check_partition(run, partition_text, reference)
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


def run_suite(
    suite: bench_suite.Suite,
    output_dir: str,
    *,
    seeds: Sequence[int] | None = None,
    algorithms: Sequence[str] | None = None,
    partitions: Sequence[str] | None = None,
    overwrite: bool = False,
    command: str | None = None,
    results_dir: str | None = None,
    report_only: bool = False,
    checkpoint_every: int = CHECKPOINT_EVERY,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Runs the selected runs of a suite that are not complete, then writes the report.

    Each run is `experiment.run_experiment(config)` into
    `<output_dir>/runs/<partition>/<algorithm>/seed<k>/` (its per-round lines
    go to `progress.log` there), then `bench_result.json` is written last. A
    run whose directory lacks `bench_result.json` continues from its newest
    checkpoint, or is removed and redone if it has none; a run another
    process is doing (its lock is held) is left alone.

    Args:
      suite: the suite (`bench_parse.load_suite`).
      output_dir: the benchmark's directory; created if needed.
      seeds: run only these seeds (None: all).
      algorithms: run only these algorithm labels (None: all).
      partitions: run only these partition labels (None: all).
      overwrite: discard everything in `output_dir` first (required when it
        holds results of a different suite).
      command: recorded in `commands.txt` and shown in the report.
      results_dir: a results directory (`restore_results`, `publish_results`):
        its records count as complete runs, each run's record is written to
        it as soon as the run completes, and the report and every complete
        run's record at the end. None: none.
      report_only: train nothing; only restore, aggregate and publish.
      checkpoint_every: each run writes a checkpoint every this many rounds
        (0: never), in place of the suite's setting. An interrupted run whose
        directory holds a checkpoint continues from it, with the numbers an
        uninterrupted run gives; one without is redone. A complete run's
        checkpoints are removed once its record is written.
      log: receives one line per run.

    Returns:
      `bench_report.write_report`'s summary rows.

    Raises:
      bench_suite.SuiteError: bad selection, an output or results directory
        that does not fit, a missing data file (all raised before anything is
        written), or a run that does not share its partition with the others
        of its seed.
    """
    output_dir = os.path.abspath(output_dir)
    runs = suite.select(seeds=seeds, algorithms=algorithms, partitions=partitions)
    _check_output_dir(suite, output_dir, overwrite)
    if results_dir is not None:
        check_results_dir(suite, output_dir, results_dir)
    _check_data(suite, runs)
    _prepare_output_dir(suite, output_dir, overwrite, command)
    if results_dir is not None:
        restored = restore_results(suite, output_dir, results_dir)
        if restored:
            log(f'{suite.name}: {restored} complete runs restored from {results_dir}')
        restored = restore_trials(suite, output_dir, results_dir)
        if restored:
            log(f'{suite.name}: {restored} complete tuning trials restored from {results_dir}')
        os.makedirs(results_dir, exist_ok=True)  # the records written below need their suite.toml beside them
        if _stored_suite(results_dir) != suite.text:
            reports.write_text_atomic(os.path.join(results_dir, bench_layout.SUITE_FILE), suite.text)
    trials = tuning.select_trials(suite, seeds=seeds, algorithms=algorithms, partitions=partitions)
    todo = [run for run in runs if not _complete(run, output_dir)]
    todo_trials = [trial for trial in trials if not _complete(trial, output_dir)]
    if report_only:
        log(f'{suite.name}: {len(runs)} runs selected, {len(runs) - len(todo)} complete, none run (--report_only)')
        todo, todo_trials = [], []
    else:
        log(f'{suite.name}: {len(runs)} runs selected, {len(runs) - len(todo)} already complete, {len(todo)} to run')
        if suite.tuning is not None:
            log(
                f'{suite.name}: {len(trials)} tuning trials selected, {len(trials) - len(todo_trials)} already '
                f'complete, {len(todo_trials)} to run'
            )
    progress = _Progress(len(todo) + len(todo_trials))
    train = functools.partial(
        _train, suite, output_dir, results_dir=results_dir, checkpoint_every=checkpoint_every, log=log
    )
    for partition in suite.partitions:  # a partition's trials first: its tuned algorithms' runs need their choice
        for i, trial in enumerate(todo_trials, start=1):
            if trial.partition is partition:
                train(trial, f'trial {i}/{len(todo_trials)}', progress)
        mine = [(i, run) for i, run in enumerate(todo, start=1) if run.partition is partition]
        chosen = _choices(suite, output_dir, partition, [run for _, run in mine], log)
        for i, run in mine:
            where = f'run {i}/{len(todo)}'
            if not run.algorithm.tune:
                train(run, where, progress)
            elif chosen[run.algorithm.name] is None:  # its trials are not complete: said once, above
                progress.skip()
            elif run.seed == suite.tuning.seed:
                _reuse_trial(output_dir, run, chosen[run.algorithm.name], results_dir, where, log)
                progress.skip()
            else:
                train(run, where, progress, chosen=chosen[run.algorithm.name])
    rows = bench_report.write_report(suite, output_dir, published=results_dir is not None, log=log)
    if results_dir is not None:
        publish_results(suite, output_dir, results_dir, log=log)
    return rows


def _complete(run, output_dir: str) -> bool:
    """Whether a run (or trial) of `output_dir` has its record."""
    return os.path.exists(os.path.join(run.directory(output_dir), bench_layout.RESULT_FILE))


class _Progress:
    """The time spent training and the runs left, for the ETA of each progress line."""

    def __init__(self, total: int):
        self._left, self._spent, self._done = total, 0.0, 0

    def skip(self) -> None:
        """A run or trial that trained nothing (skipped, waiting or reused)."""
        self._left -= 1

    def trained(self, seconds: float) -> str:
        """Counts a trained run or trial; returns the ETA of the rest as `h:mm:ss`."""
        self._left, self._spent, self._done = self._left - 1, self._spent + seconds, self._done + 1
        return _format_seconds(self._spent / self._done * self._left)


def _choices(
    suite: bench_suite.Suite,
    output_dir: str,
    partition: bench_suite.PartitionEntry,
    runs: Sequence[bench_suite.Run],
    log: Callable[[str], None],
) -> dict:
    """Each tuned algorithm of `runs` -> its `tuning.Choice` on `partition`, or None (one line says it waits)."""
    chosen = {}
    for algorithm in suite.algorithms:
        waiting = [run.seed for run in runs if run.algorithm is algorithm]
        if not algorithm.tune or not waiting:
            continue
        chosen[algorithm.name] = tuning.choice(suite, output_dir, partition, algorithm)
        if chosen[algorithm.name] is None:
            mine = [t for t in tuning.trials(suite) if t.partition is partition and t.algorithm is algorithm]
            complete = sum(_complete(t, output_dir) for t in mine)
            log(
                f'{partition.name}/{algorithm.name}: seeds {", ".join(str(s) for s in waiting)} not run: its tuning '
                f'trials on seed {suite.tuning.seed} must run first ({complete} of {len(mine)} complete)'
            )
    return chosen


def _train(
    suite: bench_suite.Suite,
    output_dir: str,
    run,
    where: str,
    progress: _Progress,
    *,
    results_dir: str | None,
    checkpoint_every: int,
    log: Callable[[str], None],
    chosen: tuning.Choice | None = None,
) -> None:
    """Trains one run or trial that is not complete (`run_suite`), under its lock; writes its record."""
    directory = run.directory(output_dir)
    is_trial = isinstance(run, tuning.Trial)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    with open(os.path.join(os.path.dirname(directory), f'.{os.path.basename(directory)}.lock'), 'a') as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f'{where} {run.label}: another process is running it, skipped')
            progress.skip()
            return
        if _complete(run, output_dir):  # finished elsewhere meanwhile
            progress.skip()
            return
        config = run_config(suite, output_dir, run, checkpoint_every, chosen=chosen)
        resume_from = experiment.resumable_round(config) if os.path.exists(directory) else None
        if resume_from is not None:
            log(f'{where} {run.label}: incomplete, continuing from its round-{resume_from} checkpoint')
        elif os.path.exists(directory):
            log(f'{where} {run.label}: incomplete, redoing it')
            shutil.rmtree(directory)
        if is_trial:
            extra = {'tuning_trial': {'trial': run.slug, 'index': run.index, 'settings': run.settings}}
        elif chosen is not None:
            extra = {'tuning_choice': _choice_entry(chosen, reused=False)}
        else:
            extra = {}
        started = time.monotonic()
        try:
            record = _run_one(suite, output_dir, run, config, resume_from=resume_from, extra=extra)
        except runtime.WorkerLostError as e:
            raise runtime.WorkerLostError(
                f'{run.label}: {e}; its checkpoints in {directory} are kept: the same command continues '
                'from the last one'
            ) from None
        seconds = time.monotonic() - started
        if results_dir is not None:  # kept at once: a sitting cut short keeps what it finished
            target = (bench_layout.trial_record_path if is_trial else bench_layout.record_path)(results_dir, run)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            reports.write_text_atomic(target, bench_layout.file_text(os.path.join(directory, bench_layout.RESULT_FILE)))
        eta = progress.trained(seconds)
        model = run.algorithm.model
        if is_trial:  # a trial shows its validation score: no test number of a trial is shown before the choice
            score = tuning.validation_score(tuning.validation_view(record), suite.tuning.select)
            shown = f'val_acc[{model}] ' + ('none' if score is None else f'{score:.4f}')
        else:
            shown = f'test_acc[{model}] {record["summary"][model]["mean"]:.4f}'
        log(f'{where} {run.label}: {seconds:.1f}s  {shown}  ETA {eta}')


def _choice_entry(chosen: tuning.Choice, *, reused: bool) -> dict:
    """A tuned algorithm's run record's `tuning_choice`: the chosen trial, its settings, whether it is its record."""
    return {'trial': chosen.trial.slug, 'settings': chosen.trial.settings, 'reused_trial_record': reused}


def _reuse_trial(
    output_dir: str,
    run: bench_suite.Run,
    chosen: tuning.Choice,
    results_dir: str | None,
    where: str,
    log: Callable[[str], None],
) -> None:
    """The tuning seed's run of a tuned algorithm: the chosen trial's record, copied (the same configuration)."""
    source = os.path.join(chosen.trial.directory(output_dir), bench_layout.RESULT_FILE)
    record = json.loads(bench_layout.file_text(source))
    record['tuning_choice'] = _choice_entry(chosen, reused=True)
    text = json.dumps(record, indent=1) + '\n'
    os.makedirs(run.directory(output_dir), exist_ok=True)
    reports.write_text_atomic(os.path.join(run.directory(output_dir), bench_layout.RESULT_FILE), text)
    if results_dir is not None:
        reports.write_text_atomic(bench_layout.record_path(results_dir, run), text)
    log(f'{where} {run.label}: the chosen trial {chosen.trial.slug}, its record reused (not rerun)')


def run_config(
    suite: bench_suite.Suite,
    output_dir: str,
    run: bench_suite.Run,
    checkpoint_every: int,
    chosen: tuning.Choice | None = None,
) -> run_config_lib.ExperimentConfig:
    """The run's configuration in `output_dir`, writing a checkpoint every `checkpoint_every` rounds.

    `checkpoint_every` changes where a run can continue from, never what it
    computes (`experiment.resumable_round` ignores it).

    Args:
      suite: the suite.
      output_dir: the benchmark's output directory.
      run: one of the suite's runs, or a `tuning.Trial` (its settings apply).
      checkpoint_every: rounds between the run's checkpoints (0: none).
      chosen: a tuned algorithm's choice (`tuning.choice`): its settings apply.

    Returns:
      The `run_config_lib.ExperimentConfig` of the run in its own directory.
    """
    if isinstance(run, tuning.Trial):
        tuned = run.settings
    else:
        tuned = None if chosen is None else chosen.trial.settings
    config = suite.config(run.partition, run.algorithm, run.seed, run.directory(output_dir), tuned=tuned)
    return config.replace(checkpoint_every=checkpoint_every)


def _run_one(
    suite: bench_suite.Suite,
    output_dir: str,
    run: bench_suite.Run,
    config: run_config_lib.ExperimentConfig,
    *,
    resume_from: int | None = None,
    extra: Mapping | None = None,
) -> dict:
    directory = run.directory(output_dir)
    reference = _reference_partition(suite, output_dir, run)
    if bench_peers.is_peer(run.algorithm.algorithm):
        return _run_peer(suite, run, config, directory, reference, resume_from)
    found = {}

    def on_process(process):
        found['partition'] = bench_layout.file_text(os.path.join(directory, 'partition.csv'))
        found['communication'] = _check_process(run, process, found['partition'], reference)

    started = time.monotonic()
    result = experiment.run_experiment(
        config, overwrite=resume_from is None, log=_RunLog(directory), on_process=on_process
    )
    sitting = time.monotonic() - started
    # A continued run adds its earlier sittings' time: that of the rounds kept by the checkpoint it
    # continued from (their evaluations, and rounds after that checkpoint, are not known or counted).
    earlier = sum(float(row['round_seconds']) for row in result.rounds if int(row['round']) <= (resume_from or 0))
    record = bench_record.run_record(
        suite, run, config, result, sitting + earlier, found['communication'], found['partition']
    )
    record['continued'] = resume_from is not None
    record['continued_from_round'] = resume_from
    record['seconds_this_sitting'] = sitting
    record.update(extra or {})  # a trial's `tuning_trial`, a tuned algorithm's run's `tuning_choice`
    reports.write_text_atomic(os.path.join(directory, bench_layout.RESULT_FILE), json.dumps(record, indent=1) + '\n')
    # The record holds what the run found; its checkpoints only served an interruption.
    shutil.rmtree(os.path.join(directory, 'checkpoints'), ignore_errors=True)
    return record


def _run_peer(
    suite: bench_suite.Suite,
    run: bench_suite.Run,
    config: run_config_lib.ExperimentConfig,
    directory: str,
    reference,
    resume_from: int | None,
) -> dict:
    """A run of one of TFF's own processes (`bench_peers`), recorded as `_run_one` records ours."""
    found = {}

    def on_data(partition_text):
        found['partition'] = partition_text
        _check_partition(run, partition_text, reference)

    started = time.monotonic()
    result, communication = bench_peers.run_peer(
        run.algorithm.algorithm, config, log=_RunLog(directory), on_data=on_data, resume=resume_from is not None
    )
    sitting = time.monotonic() - started
    # As `_run_one`: the earlier sittings' time is that of the rounds the checkpoint kept.
    earlier = sum(float(row['round_seconds']) for row in result.rounds if int(row['round']) <= (resume_from or 0))
    record = bench_record.run_record(suite, run, config, result, sitting + earlier, communication, found['partition'])
    record['config']['algorithm'] = run.algorithm.algorithm  # the peer; `settings` are those of its settings' algorithm
    record['config']['settings_of'] = bench_peers.PEERS[run.algorithm.algorithm].settings_of
    record['continued'] = resume_from is not None
    record['continued_from_round'] = resume_from
    record['seconds_this_sitting'] = sitting
    reports.write_text_atomic(os.path.join(directory, bench_layout.RESULT_FILE), json.dumps(record, indent=1) + '\n')
    shutil.rmtree(os.path.join(directory, 'checkpoints'), ignore_errors=True)  # as `_run_one`
    return record
