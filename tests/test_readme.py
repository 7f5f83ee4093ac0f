"""The README's Python example runs as written (on a smaller scale)."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = os.path.join(REPO, '..', 'shared', 'data', 'mnist.npz')


def test_readme_python_example(tmp_path, monkeypatch):
    """Runs it twice, as a user would: the second run reuses the client data written by the first."""
    if not os.path.exists(MNIST):
        pytest.skip('MNIST file not present')
    readme = open(os.path.join(REPO, 'README.md')).read()
    code = re.search(r'```python\n(.*?)```', readme, re.S).group(1)
    code = code.replace('for _ in range(10)', 'for _ in range(2)')
    monkeypatch.chdir(REPO)
    monkeypatch.setenv('TFF_PFL_CACHE', str(tmp_path / 'cache'))
    roots = []
    for _ in range(2):
        namespace = {}
        exec(compile(code, 'README.md', 'exec'), namespace)  # pylint: disable=exec-used
        per_client = namespace['per_client']
        assert list(per_client) == [f'user_{k}' for k in range(10)]
        assert all(0.0 <= c['global_model']['accuracy'] <= 1.0 for c in per_client.values())
        assert namespace['metrics']['num_clients'] == 10
        assert len(namespace['weights'].trainable) == 2
        roots.append(namespace['spec'].root)
    assert roots[0] == roots[1] and os.listdir(tmp_path / 'cache') == [os.path.basename(roots[0])]
