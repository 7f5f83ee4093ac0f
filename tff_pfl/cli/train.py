"""tff-pfl-train: train one algorithm on one partition; one output directory.

With no flags it runs the main job: FedAvg on the Synthetic(1,1) federated
benchmark (30 clients, generated on the fly, no network), and prints a
per-client result table and where the report and plots were written.

Bad flag values print one line `tff-pfl-train: error: ...` and exit with 2.
"""

import os
import sys

# TensorFlow's C++ start-up chatter (oneDNN, CPU features, CUDA plug-ins on a
# CPU-only machine) is not for users of the binary; TF_CPP_MIN_LOG_LEVEL=0
# brings it back. Errors still surface as Python exceptions.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
# gRPC's C core logs at INFO to stderr (e.g. each failed TLS handshake with a --workers front),
# beside the one line the binary prints about it; GRPC_VERBOSITY=INFO brings it back.
os.environ.setdefault('GRPC_VERBOSITY', 'ERROR')

from absl import app, flags, logging

from tff_pfl.cli import common, config_flags
from tff_pfl.program import experiment, run_config, run_report

# The settings' flags: one per field of the run's settings (every part) and of every
# algorithm's settings dataclass, generated (tff_pfl/cli/config_flags.py).
config_flags.define_flags()

# What is not a setting of the run: where it goes and how it is started.
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Output directory; default runs/<algorithm>-<time>.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace a non-empty output directory.')
_ISOLATE_NETWORK = flags.DEFINE_bool(
    'isolate_network',
    True,
    'Run in a private network namespace, so that nothing else can reach the local TFF worker (docs/runtime.md); '
    'off with --workers or --download, which need the network.',
)

_PROG = 'tff-pfl-train'


def _fail(message, code: int = 2) -> None:
    common.fail(_PROG, message, code)


def config_from_flags() -> run_config.ExperimentConfig:
    """Builds and validates the configuration from the parsed flags.

    See `tff_pfl.cli.config_flags.config_from_flags`.

    Returns:
      The validated `run_config.ExperimentConfig`.

    Raises:
      run_config.ConfigError: a flag value the configuration refuses, or a
        flag that does not apply to the chosen algorithm.
    """
    return config_flags.config_from_flags()


# The per-client table on stdout stops after this many clients.
PRINTED_CLIENTS = 50


def main(argv) -> None:
    """Validates the flags, then runs the experiment and prints its tables.

    Exits with 2 and one line on stderr on bad input, 130 on Ctrl-C, and 0
    (without running) when the output directory holds this run, finished.

    Args:
      argv: what absl leaves of the command line after the flags; must hold
        only the program name.
    """
    if len(argv) > 1:
        _fail(f'unexpected arguments: {" ".join(argv[1:])}')
    from tff_pfl import reports, runtime
    from tff_pfl.data import partition, sources

    logging.set_verbosity(logging.WARNING)
    try:
        config = config_from_flags()
    except run_config.ConfigError as e:
        _fail(str(e))  # before re-executing in a namespace: bad flags cost one start-up, not two
    if _ISOLATE_NETWORK.value and not config.runtime.workers and not config.data.download:
        runtime.isolate_network(_PROG, ['-m', 'tff_pfl.cli.train', *sys.argv[1:]])
    runtime.install_sigterm_handler()
    runtime.refuse_implicit_runtime()
    try:
        result = experiment.run_experiment(config, overwrite=_OVERWRITE.value)
    except (run_config.ConfigError, sources.DataError, partition.PartitionError) as e:
        _fail(str(e))
    except runtime.WorkerLostError as e:
        _fail(
            f'{e}; the checkpoints in {os.path.abspath(config.output_dir)} are kept: the same command continues '
            'from the last one',
            code=1,
        )
    except experiment.RunComplete as e:
        print(f'{_PROG}: {e}; nothing to do')
        return
    except KeyboardInterrupt:
        print(f'{_PROG}: interrupted', file=sys.stderr)
        sys.exit(130)
    rows, columns = run_report.client_table(result)
    print()
    # A large population's every client is in clients.csv, not on the terminal.
    print(reports.format_table(rows, columns, max_rows=PRINTED_CLIENTS, more='clients in clients.csv'))
    print()
    rows, columns = run_report.summary_table(result)
    print(reports.format_table(rows, columns))
    out = os.path.abspath(config.output_dir)
    print(f'\nreport: {os.path.join(out, "report.md")}')
    print(
        f'plots:  {os.path.join(out, "accuracy.png")}, {os.path.join(out, "clients.png")}, '
        f'{os.path.join(out, "partition.png")}'
    )


def run() -> None:
    """Console-script entry point."""
    common.use_invocation_directory()
    common.refuse_implicit_runtime()
    app.run(main, flags_parser=common.flags_parser(_PROG))


if __name__ == '__main__':
    run()
