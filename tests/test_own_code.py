"""docs/own_code.md's guide runs as written (fewer rounds), twice: the second run reuses the data."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FASHION = os.path.join(REPO, '..', 'shared', 'data', 'fashion_mnist.npz')


def test_the_guide_runs_twice_with_the_users_ids(tmp_path, monkeypatch):
    if not os.path.exists(FASHION):
        pytest.skip('Fashion-MNIST file not present')
    from tff_pfl import models

    guide = open(os.path.join(REPO, 'docs', 'own_code.md')).read()
    code = re.search(r'```python\n(.*?)```', guide, re.S).group(1)
    code = re.sub(r'rounds=\d+', 'rounds=2', code)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv('TFF_PFL_CACHE', str(tmp_path / 'cache'))
    roots = []
    try:
        for _ in range(2):
            namespace = {}
            exec(compile(code, 'docs/own_code.md', 'exec'), namespace)  # pylint: disable=exec-used
            stores = [f'store_{k}' for k in range(8)]
            for clients in (namespace['fedavg_clients'], namespace['persfl_clients'], namespace['ktpfl_clients']):
                assert sorted(clients) == stores and list(clients) == list(namespace['spec'].source_ids)
            assert all(0.0 <= r['personalized_model_accuracy'] <= 1.0 for r in namespace['persfl_clients'].values())
            assert len(namespace['global_weights'].trainable) == 4
            roots.append(namespace['spec'].root)
    finally:
        if 'mlp' in models.names():
            models.unregister('mlp')
    assert roots[0] == roots[1]


def test_the_five_client_example_runs_with_the_users_ids(tmp_path, monkeypatch, capsys):
    """docs/examples/five_clients.py (tf.data clients, FedAvg and PersFL; fewer rounds)."""
    if not os.path.exists(os.path.join(REPO, '..', 'shared', 'data', 'mnist.npz')):
        pytest.skip('MNIST file not present')
    code = open(os.path.join(REPO, 'docs', 'examples', 'five_clients.py')).read()
    code = re.sub(r'rounds=\d+', 'rounds=2', code)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv('TFF_PFL_CACHE', str(tmp_path / 'cache'))
    namespace = {}
    exec(compile(code, 'docs/examples/five_clients.py', 'exec'), namespace)  # pylint: disable=exec-used
    hospitals = [f'hospital_{k}' for k in range(5)]
    assert [row['source_id'] for row in namespace['result'].clients] == hospitals
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(('FedAvgSettings', 'PersFL'))]
    assert len(printed) == 2 and all(h in printed[1] for h in hospitals)
