"""The documentation stays true to the tree: links resolve, commands use real flags.

Reads README.md, docs/, deploy/README.md, benchmarks/results/ and the
notebooks' markdown; a renamed file, a removed flag or an algorithm without a
page fails here.
"""

import contextlib
import json
import pathlib
import re
import shlex
import subprocess

import pytest

from tff_pfl.program import algorithms, run_config

REPO = pathlib.Path(__file__).resolve().parents[1]
MARKDOWN = sorted(
    [REPO / 'README.md', REPO / 'deploy' / 'README.md']
    + list((REPO / 'docs').rglob('*.md'))
    + list((REPO / 'benchmarks' / 'results').rglob('*.md'))
)
NOTEBOOKS = sorted((REPO / 'notebooks').glob('*.ipynb'))
_LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def _text(path):
    if path.suffix == '.ipynb':
        cells = json.loads(path.read_text())['cells']
        return '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')
    return path.read_text()


def _headings(path):
    anchors = set()
    for line in _text(path).splitlines():
        match = re.match(r'^#+\s+(.*)$', line)
        if match:
            title = match.group(1).strip().lower()
            anchors.add(re.sub(r'\s', '-', re.sub(r'[^\w\s-]', '', title)))
    return anchors


@pytest.mark.parametrize('path', MARKDOWN + NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = []
    for target in _LINK.findall(_text(path)):
        if re.match(r'^[a-z]+:', target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition('#')
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists() or anchor and resolved.suffix == '.md' and anchor not in _headings(resolved):
            broken.append(target)
    assert not broken, f'{path.relative_to(REPO)}: broken links {broken}'


def _defined_flags(*modules):
    names = set()
    for module in modules:
        source = (REPO / module).read_text()
        for kind, name in re.findall(r"DEFINE_(\w+)\(\s*'(\w+)'", source):
            names.add(name)
            if kind == 'bool':
                names.add('no' + name)
    return names | {'help', 'helpfull', 'helpshort'}


def _settings_flags():
    """The flags tff-pfl-train generates from the settings dataclasses (tff_pfl/cli/config_flags.py)."""
    from tff_pfl.cli import config_flags

    names = {'config'}
    for entries in config_flags.setting_groups().values():
        for name, hint, _ in entries:
            names.add(name)
            if hint is bool:
                names.add('no' + name)
    return names


def test_commands_in_the_documentation_use_flags_that_exist():
    binaries = {
        'tff-pfl-train': _defined_flags('tff_pfl/cli/train.py') | _settings_flags(),
        'tff-pfl-export': _defined_flags('tff_pfl/cli/train.py', 'tff_pfl/cli/export.py') | _settings_flags(),
        'tff-pfl-bench': _defined_flags('tff_pfl_bench/cli.py'),
    }
    unknown, checked = [], 0
    for path in MARKDOWN + NOTEBOOKS:
        text = _text(path).replace('\\\n', ' ')
        for line in text.splitlines():
            for binary, known in binaries.items():
                match = re.search(re.escape(binary) + r'\s(.*)', line)
                if not match:
                    continue
                command = re.split(r'[`|]|&&', match.group(1))[0]
                for flag in re.findall(r'(?<!\S)--(\w+)', command):
                    checked += 1
                    if flag not in known:
                        unknown.append(f'{path.relative_to(REPO)}: {binary} --{flag}')
    assert not unknown, '\n'.join(unknown)
    assert checked > 100  # the commands were found


def _train_commands():
    for path in MARKDOWN + NOTEBOOKS:
        text = _text(path).replace('\\\n', ' ')
        for line in text.splitlines():
            match = re.search(r'tff-pfl-train\s(.*)', line)
            if match:
                command = re.split(r'[`|]|&&', match.group(1))[0]
                args = [
                    a for a in shlex.split(command) if re.fullmatch(r'--\w+(=\S*)?', a) and not a.startswith('--help')
                ]
                if args:
                    yield path, args


def test_documented_training_commands_are_valid_configurations(tmp_path):
    from absl import flags

    from tff_pfl import models
    from tff_pfl.cli import train

    refused = []
    commands = list(_train_commands())
    built_in = set(models.names())
    # Commands with the driver's TLS files run where deploy/tls/make-certs.sh wrote them (certs/),
    # as deploy/README.md makes them.
    subprocess.run(
        [str(REPO / 'deploy' / 'tls' / 'make-certs.sh'), str(tmp_path / 'certs'), 'localhost'],
        check=True,
        capture_output=True,
    )
    try:
        for path, args in commands:
            flags.FLAGS.unparse_flags()
            flags.FLAGS(['tff-pfl-train', *args])
            tls = any(a.startswith('--worker_tls_') for a in args)
            try:
                with contextlib.chdir(tmp_path) if tls else contextlib.nullcontext():
                    train.config_from_flags()
            except run_config.ConfigError as e:
                refused.append(f'{path.relative_to(REPO)}: {" ".join(args)}: {e}')
    finally:
        flags.FLAGS.unparse_flags()
        for name in set(models.names()) - built_in:  # registered by a documented --model_modules
            models.unregister(name)
    assert not refused, '\n'.join(refused)
    assert commands


def test_every_algorithm_has_a_page():
    pages = '\n'.join(p.read_text() for p in (REPO / 'docs' / 'algorithms').glob('*.md'))
    missing = [name for name in algorithms.names() if not re.search(rf'[`=]{name}\b', pages)]
    assert not missing, f'algorithms without a docs/algorithms page: {missing}'


def test_the_checks_catch_a_broken_link_and_an_unknown_flag(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('# Title\n[a](missing.md) [b](#title) [c](#nope)\n')
    assert _LINK.findall(page.read_text()) == ['missing.md', '#title', '#nope']
    assert _headings(page) == {'title'}
    assert 'noisolate_network' in _defined_flags('tff_pfl/cli/train.py')
    assert {'rounds', 'nodownload', 'distill_epochs', 'kd_mu1'} <= _settings_flags()
    assert 'distil_epochs' not in _settings_flags()


def test_the_api_reference_is_generated_from_the_current_docstrings():
    import importlib.util

    spec = importlib.util.spec_from_file_location('gen_api', REPO / 'docs' / 'gen_api.py')
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    expected = gen_api.render()
    current = (REPO / 'docs' / 'api.md').read_text()
    assert current == expected, 'docs/api.md is stale: uv run --locked python docs/gen_api.py > docs/api.md'
    for module_name, names in gen_api.PUBLIC:  # every public name is documented
        assert all(f'`{name}' in expected for name in names), module_name
