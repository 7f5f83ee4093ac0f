"""The README's Python example runs as written (on a smaller scale)."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = os.path.join(REPO, '..', 'shared', 'data', 'mnist.npz')


def test_readme_python_example(tmp_path, monkeypatch):
    if not os.path.exists(MNIST):
        pytest.skip('MNIST file not present')
    readme = open(os.path.join(REPO, 'README.md')).read()
    code = re.search(r'```python\n(.*?)```', readme, re.S).group(1)
    code = code.replace("'/tmp/clients'", repr(str(tmp_path / 'clients')))
    code = code.replace('range(10)', 'range(2)')
    monkeypatch.chdir(REPO)
    namespace = {}
    exec(compile(code, 'README.md', 'exec'), namespace)  # pylint: disable=exec-used
    per_client = namespace['per_client']
    assert len(per_client) == 10
    assert all(0.0 <= c['global_model']['accuracy'] <= 1.0 for c in per_client)
    assert namespace['metrics']['num_clients'] == 10
