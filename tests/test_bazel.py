"""The BUILD files match the code: every file in a target, every import in the deps.

BUILD files here are plain Starlark calls, so they are read by executing them
with recording stand-ins for the rules. `bazel build //...` in CI checks that
Bazel accepts them; this test checks what Bazel cannot: that a module's
project imports are reachable through its target's `deps`.
"""

import ast
import fnmatch
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ('tff_pfl', 'processes', 'deploy', 'tff_pfl_bench', 'tests')


def _glob(package_dir, patterns, exclude=()):
    found = []
    for pattern in patterns:
        for path in sorted(package_dir.glob(pattern)):
            relative = str(path.relative_to(package_dir))
            if path.is_file() and not any(fnmatch.fnmatch(relative, e) for e in exclude):
                found.append(relative)
    return found


def read_build(package):
    """Runs `<package>/BUILD` with recording rules.

    Args:
      package: the package path, e.g. 'tff_pfl/data' ('' for the root).

    Returns:
      Target name -> `{'kind', 'srcs', 'deps', 'tags', 'tests'}`, with srcs as
      paths relative to the repository and deps as absolute labels.
    """
    package_dir = REPO / package
    targets = {}

    def label(dep):
        if dep.startswith(':'):
            return f'//{package}:{dep[1:]}'
        if ':' not in dep:
            return f'{dep}:{dep.rsplit("/", 1)[-1]}'
        return dep

    def rule(kind):
        def record(name, srcs=(), deps=(), tags=(), tests=(), **kwargs):
            del kwargs
            targets[name] = dict(
                kind=kind,
                srcs=[f'{package}/{s}'.lstrip('/') for s in srcs],
                deps=[label(d) for d in deps],
                tags=list(tags),
                tests=[label(t) for t in tests],
            )

        return record

    def pytest_test(name, deps=(), tags=(), **kwargs):
        rule('py_test')(name, srcs=[f'{name}.py', 'pytest_main.py'], deps=[*deps, ':support'], tags=tags, **kwargs)

    scope = dict(
        glob=lambda include, exclude=(): _glob(package_dir, include, exclude),
        py_library=rule('py_library'),
        py_binary=rule('py_binary'),
        py_test=rule('py_test'),
        filegroup=rule('filegroup'),
        sh_binary=rule('sh_binary'),
        test_suite=rule('test_suite'),
        exports_files=lambda *a, **k: None,
        package=lambda **k: None,
        load=lambda *a: None,
        pytest_test=pytest_test,
    )
    exec(compile((package_dir / 'BUILD').read_text(), str(package_dir / 'BUILD'), 'exec'), scope)
    return targets


def _all_targets():
    targets = {}
    for build in sorted(REPO.glob('**/BUILD')):
        package = str(build.parent.relative_to(REPO)).replace('.', '')
        if package.startswith(('third_party', 'bazel-', '.venv')):
            continue
        for name, target in read_build(package).items():
            targets[f'//{package}:{name}'] = target
    return targets


TARGETS = _all_targets()


def _package_of_import(module):
    parts = module.split('.')
    for k in range(len(parts), 0, -1):
        candidate = REPO.joinpath(*parts[:k])
        if candidate.is_dir():
            return '/'.join(parts[:k])
        if candidate.with_suffix('.py').exists():
            return '/'.join(parts[: k - 1])
    return None


def _project_imports(path):
    """Packages of the project that `path` imports (e.g. 'tff_pfl/data')."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
        else:
            continue
        for module in modules:
            if module.split('.')[0] in PACKAGES[:4]:
                package = _package_of_import(module)
                if package:
                    found.add(package)
    return found


def _closure(name):
    seen, stack = set(), [name]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(TARGETS[current]['deps'])
    return seen


def test_every_python_file_is_in_a_target():
    owned = {src for target in TARGETS.values() for src in target['srcs']}
    files = [str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob('*.py')]
    assert sorted(set(files) - owned) == []


def test_every_test_file_has_a_py_test():
    tests = {name for name, t in TARGETS.items() if t['kind'] == 'py_test'}
    files = {f'//tests:{p.stem}' for p in (REPO / 'tests').glob('test_*.py')}
    assert sorted(files - tests) == []


def test_deps_exist():
    missing = [(name, dep) for name, t in TARGETS.items() for dep in t['deps'] if dep not in TARGETS]
    assert missing == []


@pytest.mark.parametrize('name', sorted(n for n, t in TARGETS.items() if t['kind'].startswith('py_')))
def test_deps_cover_the_imports(name):
    reachable = {label.split(':')[0].lstrip('/') for label in _closure(name)}
    missing = {}
    for src in TARGETS[name]['srcs']:
        needed = _project_imports(REPO / src) - reachable
        if needed:
            missing[src] = sorted(needed)
    assert not missing, f'{name}: add deps for {missing}'


def test_the_fast_suite_holds_only_fast_tests():
    fast = TARGETS['//tests:fast']['tests']
    assert fast and all(TARGETS[t]['kind'] == 'py_test' and 'slow' not in TARGETS[t]['tags'] for t in fast)


def test_the_checks_see_a_missing_dep():
    # //tff_pfl/computations imports tff_pfl.data; without that dep it would fail.
    imports = set()
    for src in TARGETS['//tff_pfl/computations:computations']['srcs']:
        imports |= _project_imports(REPO / src)
    assert 'tff_pfl/data' in imports and 'tff_pfl/models' in imports


def test_local_repositories_of_bazelrc_exist():
    for line in (REPO / '.bazelrc').read_text().splitlines():
        if '--override_repository=' in line:
            path = line.split('=', 2)[2].replace('%workspace%', str(REPO))
            if path.startswith(str(REPO)):
                assert (pathlib.Path(path) / 'WORKSPACE').exists(), path


def test_under_bazel_run_relative_paths_are_the_users(tmp_path, monkeypatch):
    from tff_pfl.cli import common

    monkeypatch.chdir(REPO)
    monkeypatch.delenv('BUILD_WORKING_DIRECTORY', raising=False)
    common.use_invocation_directory()
    assert pathlib.Path.cwd() == REPO
    monkeypatch.setenv('BUILD_WORKING_DIRECTORY', str(tmp_path))
    common.use_invocation_directory()
    assert pathlib.Path.cwd() == tmp_path
