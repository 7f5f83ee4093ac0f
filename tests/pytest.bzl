"""pytest_test: one Bazel py_test per pytest file."""

def pytest_test(name, deps = [], data = [], size = "medium", tags = [], **kwargs):
    """A py_test that runs `<name>.py` with pytest (tests/pytest_main.py).

    Args:
      name: the test file's name without `.py`.
      deps: the project libraries the file imports.
      data: files the test reads.
      size: Bazel's test size (sets the timeout).
      tags: e.g. "slow", left out of `bazel test //tests/...` by .bazelrc.
      **kwargs: passed to py_test.
    """
    native.py_test(
        name = name,
        srcs = [name + ".py", "pytest_main.py"],
        main = "pytest_main.py",
        args = ["tests/%s.py" % name],
        deps = deps + [":support"],
        data = data + ["//:pyproject.toml"],
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        tags = tags,
        **kwargs
    )
