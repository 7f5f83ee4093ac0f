"""What the project's absl binaries share: one-line errors with exit code 2."""

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import flags


def fail(prog: str, message, code: int = 2) -> NoReturn:
    """Prints `prog: error: message` (on one line) to stderr and exits with `code`.

    Args:
      prog: the binary's name.
      message: the error; its whitespace, newlines included, is collapsed.
      code: the exit status: 2 (the default) for bad input, 1 for a run that
        failed on its way (a lost TFF worker).
    """
    print(f'{prog}: error: {" ".join(str(message).split())}', file=sys.stderr)
    sys.exit(code)


def use_invocation_directory() -> None:
    """Under `bazel run`, makes relative paths relative to where it was run.

    `bazel run` starts a binary in its runfiles tree and names the user's
    directory in `BUILD_WORKING_DIRECTORY`; `--output_dir=runs/x` then means
    what it means without Bazel. Elsewhere this does nothing.
    """
    directory = os.environ.get('BUILD_WORKING_DIRECTORY')
    if directory:
        os.chdir(directory)


def flags_parser(prog: str) -> Callable[[list], list]:
    """An `app.run` flags parser whose flag errors are `fail`'s one line.

    Args:
      prog: the binary's name.

    Returns:
      `argv -> remaining argv`.
    """

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(prog, str(e).splitlines()[0])

    return parse


def refuse_implicit_runtime() -> None:
    """A binary's first step: TFF's default context out, `runtime.NoRuntimeContext` in.

    Before the flags are parsed, so that a run refused in one line exits with
    that line alone: TFF's default context, left in place until the
    interpreter exits, prints a traceback from its `__del__` then.
    """
    from tff_pfl import runtime

    runtime.refuse_implicit_runtime()
