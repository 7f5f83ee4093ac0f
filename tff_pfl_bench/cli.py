"""tff-pfl-bench: run a benchmark suite (algorithms x partitions x seeds), write its report.

    tff-pfl-bench --suite=benchmarks/suites/persfl_mnist.toml --output_dir=runs/bench/persfl_mnist

Runs every run of the suite that is not complete yet (so rerunning the same
command resumes), then aggregates every complete run into `report.md`,
`results.csv`, `summary.csv` and plots in `--output_dir`. `--seeds`,
`--algorithms` and `--partitions` select a subset, to split a suite over
sittings or over processes; `--report_only` only re-aggregates;
`--results_dir` keeps every run's record beside the committed report, so a
later sitting on a fresh checkout adds to it. See
`tff_pfl_bench.bench_parse`, `bench_suite`, `bench_run`, `bench_report` and docs/benchmarks.md.

Bad input prints one line `tff-pfl-bench: error: ...` and exits with 2.
"""

import os
import shlex
import sys
import tomllib

# As in tff-pfl-train: TensorFlow's C++ start-up chatter is not for users.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags, logging

from tff_pfl.cli import common

_SUITE = flags.DEFINE_string('suite', None, 'Suite TOML file, e.g. benchmarks/suites/persfl_mnist.toml.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Output directory; default runs/bench/<suite name>.')
_SEEDS = flags.DEFINE_list('seeds', None, "Run only these seeds (default: all of the suite's).")
_ALGORITHMS = flags.DEFINE_list('algorithms', None, 'Run only these algorithm labels (default: all).')
_PARTITIONS = flags.DEFINE_list('partitions', None, 'Run only these partition labels (default: all).')
_ISOLATE_NETWORK = flags.DEFINE_bool(
    'isolate_network',
    True,
    'Run in a private network namespace, so that nothing else can reach the local TFF worker (docs/runtime.md); '
    'turn off for suites that download datasets.',
)
_RESULTS_DIR = flags.DEFINE_string(
    'results_dir',
    None,
    'A results directory kept beyond the output directory, e.g. benchmarks/results/<name>_suite: the run records '
    "it holds count as complete runs, and the report and every complete run's record are written back to it.",
)
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    'checkpoint_every',
    5,
    "Each run writes a checkpoint every this many rounds (0: never), in place of the suite's setting; an "
    'interrupted run continues from its newest checkpoint when the command is run again.',
    lower_bound=0,
)
_REPORT_ONLY = flags.DEFINE_bool('report_only', False, 'Only aggregate the complete runs into the report.')
_OVERWRITE = flags.DEFINE_bool(
    'overwrite', False, "Discard the output directory's contents first (needed for a different suite)."
)

_PROG = 'tff-pfl-bench'


def _fail(message, code: int = 2) -> None:
    common.fail(_PROG, message, code)


def _seeds():
    if _SEEDS.value is None:
        return None
    try:
        return [int(s) for s in _SEEDS.value]
    except ValueError:
        _fail(f'--seeds must be integers, got {",".join(_SEEDS.value)}')


def _read_suite(path: str) -> str:
    """The suite file's text, checked to be TOML before TensorFlow is imported.

    `bench_parse.parse_suite` validates the rest; reading and parsing here first
    keeps the commonest mistakes (a wrong path, a typo in the TOML) fast.
    """
    try:
        with open(path, 'rb') as f:
            text = f.read().decode('utf-8')
    except FileNotFoundError:
        _fail(f'suite file not found: {path}')
    except IsADirectoryError:
        _fail(f'suite file {path} is a directory')
    except OSError as e:
        _fail(f'cannot read suite file {path}: {e.strerror}')
    except UnicodeDecodeError:
        _fail(f'{path}: not UTF-8 text')
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        _fail(f'{path}: bad TOML: {e}')
    return text


def _log(line: str) -> None:
    print(line, flush=True)


def main(argv) -> None:
    """Runs the suite's missing runs (or only its report) and writes the report.

    Exits with 2 and one line on stderr on bad input, 130 on Ctrl-C.

    Args:
      argv: what absl leaves of the command line after the flags; must hold
        only the program name.
    """
    if len(argv) > 1:
        _fail(f'unexpected arguments: {" ".join(argv[1:])}')
    if not _SUITE.value:
        _fail('--suite is required')
    if _REPORT_ONLY.value and _OVERWRITE.value:
        _fail('--report_only and --overwrite do not go together')
    seeds = _seeds()
    text = _read_suite(_SUITE.value)
    from tff_pfl import runtime

    # TFF is imported from here on: take its default context out before any refusal below, or
    # the context's __del__ would print a traceback after the one-line error at exit.
    runtime.refuse_implicit_runtime()
    from tff_pfl.data import partition, sources
    from tff_pfl.program import run_config
    from tff_pfl_bench import bench_parse, bench_report, bench_run, bench_suite

    logging.set_verbosity(logging.WARNING)
    errors = (bench_suite.SuiteError, run_config.ConfigError, sources.DataError, partition.PartitionError)
    # The suite and the selection are checked before re-executing in a network
    # namespace: a bad suite costs one start-up, not two.
    try:
        suite = bench_parse.parse_suite(text, _SUITE.value)
        suite.select(seeds=seeds, algorithms=_ALGORITHMS.value, partitions=_PARTITIONS.value)
        output_dir = _OUTPUT_DIR.value or bench_report.default_output_dir(suite)
        if _REPORT_ONLY.value and not _RESULTS_DIR.value:
            bench_run.check_report_dir(suite, output_dir)
        if _RESULTS_DIR.value:
            bench_run.check_results_dir(suite, output_dir, _RESULTS_DIR.value)
    except errors as e:
        _fail(str(e))
    if _ISOLATE_NETWORK.value:
        runtime.isolate_network(_PROG, ['-m', 'tff_pfl_bench.cli', *sys.argv[1:]])
    runtime.install_sigterm_handler()
    try:
        if _REPORT_ONLY.value and not _RESULTS_DIR.value:
            bench_report.write_report(suite, output_dir, log=_log)
        else:
            command = None if _REPORT_ONLY.value else ' '.join(shlex.quote(a) for a in [_PROG] + sys.argv[1:])
            bench_run.run_suite(
                suite,
                output_dir,
                seeds=seeds,
                algorithms=_ALGORITHMS.value,
                partitions=_PARTITIONS.value,
                overwrite=_OVERWRITE.value,
                command=command,
                results_dir=_RESULTS_DIR.value,
                report_only=_REPORT_ONLY.value,
                checkpoint_every=_CHECKPOINT_EVERY.value,
                log=_log,
            )
    except errors as e:
        _fail(str(e))
    except runtime.WorkerLostError as e:
        _fail(str(e), code=1)
    except KeyboardInterrupt:
        print(f'{_PROG}: interrupted', file=sys.stderr)
        sys.exit(130)


def run() -> None:
    """Console-script entry point.

    TFF is not imported before the flags and the suite file are checked (`main`), so that
    those refusals take a fraction of a second rather than TensorFlow's start-up.
    """
    common.use_invocation_directory()
    app.run(main, flags_parser=common.flags_parser(_PROG))


if __name__ == '__main__':
    run()
