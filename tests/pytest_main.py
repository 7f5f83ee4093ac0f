"""Runs one test file with pytest: the `main` of every Bazel `py_test` here.

`bazel test //tests:test_fedavg` runs `pytest tests/test_fedavg.py` in the
test's runfiles, with the repository's pytest configuration (pyproject.toml)
and a JUnit report where Bazel asks for one (`XML_OUTPUT_FILE`).
"""

import os
import sys

import pytest


def main(argv) -> int:
    """Runs pytest on the test files in `argv`.

    Args:
      argv: the command line; `argv[1:]` are test files and pytest options.

    Returns:
      pytest's exit code.
    """
    args = ['-p', 'no:cacheprovider', *argv[1:]]
    if os.environ.get('XML_OUTPUT_FILE'):
        args.append(f'--junitxml={os.environ["XML_OUTPUT_FILE"]}')
    return int(pytest.main(args))


if __name__ == '__main__':
    sys.exit(main(sys.argv))
