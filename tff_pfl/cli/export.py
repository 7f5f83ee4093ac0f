"""tff-pfl-export: an algorithm's computations in TFF's production forms, with a manifest.

Takes the flags of tff-pfl-train (algorithm, hyperparameters, dataset,
partition) and writes to --output_dir what `tff_pfl.program.export`
describes: serialized computations, the round as MapReduceForm and
DistributeAggregateForm where it fits, and manifest.json. deploy/loader.py
runs the result.

Bad flag values print one line `tff-pfl-export: error: ...` and exit with 2;
nothing is left in --output_dir then.
"""

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags, logging

from tff_pfl.cli import (
    common,
    train,  # defines the shared flags
)
from tff_pfl.program import run_config

_PROG = 'tff-pfl-export'


def main(argv) -> None:
    """Exports the configured algorithm's round and prints what was written.

    Exits with 2 and one line on stderr on bad input, 130 on Ctrl-C.

    Args:
      argv: what absl leaves of the command line after the flags; must hold
        only the program name.
    """
    if len(argv) > 1:
        common.fail(_PROG, f'unexpected arguments: {" ".join(argv[1:])}')
    if not flags.FLAGS['output_dir'].value:
        common.fail(_PROG, '--output_dir is required')
    from tff_pfl import runtime
    from tff_pfl.data import partition, sources
    from tff_pfl.program import export

    logging.set_verbosity(logging.WARNING)
    runtime.refuse_implicit_runtime()  # exporting traces and serializes; nothing may start TFF's worker
    try:
        config = train.config_from_flags()
        manifest = export.export(config, overwrite=flags.FLAGS['overwrite'].value)
    except (run_config.ConfigError, sources.DataError, partition.PartitionError) as e:
        common.fail(_PROG, str(e))
    except KeyboardInterrupt:
        print(f'{_PROG}: interrupted', file=sys.stderr)
        sys.exit(130)
    out = os.path.abspath(config.output_dir)
    for form, entry in manifest['forms'].items():
        print(f'{form}: {"written" if entry["exported"] else "not exported: " + entry["reason"]}')
    print(f'manifest: {os.path.join(out, export.MANIFEST)}')


def run() -> None:
    """Console-script entry point."""
    common.use_invocation_directory()
    common.refuse_implicit_runtime()
    app.run(main, flags_parser=common.flags_parser(_PROG))


if __name__ == '__main__':
    run()
