"""The scale benchmark's shared population: its hard-linked client files are what `pipeline.prepare` writes.

`benchmarks/scale_population.py --data=shared` and `benchmarks/scale_resume.py` skip the
conversion of 1,000,000 npz files by hard-linking the client files `shared_population.write`
made in the same pass; the runs' numbers are only the library's if those files are, byte for byte.
"""

import dataclasses
import filecmp
import json
import os
import sys

import numpy as np
import pytest

from tff_pfl.data import client_data, pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import shared_population  # noqa: E402  (benchmarks/)

NUM_CLIENTS = 12


@pytest.fixture(scope='module')
def population(tmp_path_factory):
    root = shared_population.root(str(tmp_path_factory.mktemp('populations')), 0.1, NUM_CLIENTS)
    info = shared_population.write(root, NUM_CLIENTS, 0.1)
    return root, info


def test_written_once_with_its_size_and_each_client_split_4_1_1(population):
    root, info = population
    assert info['num_clients'] == NUM_CLIENTS and info['heterogeneity'] == 0.1
    assert shared_population.write(root, NUM_CLIENTS, 0.1) == info  # exists: nothing written again
    assert not [n for n in os.listdir(os.path.dirname(root)) if n.startswith('.staging.')]
    with open(os.path.join(root, 'clients', 'manifest.json')) as f:
        manifest = json.load(f)
    assert len(manifest['clients']) == NUM_CLIENTS and manifest['num_classes'] == 10
    with np.load(os.path.join(root, 'clients', manifest['clients'][0] + '.npz')) as arrays:
        sizes = [len(arrays[f'y_{split}']) for split in client_data.SPLITS]
        assert sizes == list(shared_population.EXAMPLES) and arrays['x_train'].shape == (4, 60)


def test_linked_client_files_equal_those_prepare_writes(population, tmp_path):
    root, _ = population
    kwargs = dict(dataset=shared_population.dataset(root), partition_name='natural', num_clients=NUM_CLIENTS, seed=0)
    written = pipeline.prepare(str(tmp_path / 'prepared'), **kwargs)
    linked = shared_population.prepare_linked(pipeline.prepare)(str(tmp_path / 'linked'), **kwargs)
    names = sorted(os.listdir(tmp_path / 'prepared'))
    assert names == sorted(os.listdir(tmp_path / 'linked'))
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / 'prepared', tmp_path / 'linked', names, shallow=False)
    assert not mismatch and not errors and len(match) == len(names)
    np.testing.assert_array_equal(written.class_histogram, linked.class_histogram)
    assert dataclasses.replace(written.spec, root=linked.spec.root) == linked.spec


def test_linking_refuses_another_size(population, tmp_path):
    root, _ = population
    link = shared_population.prepare_linked(pipeline.prepare)
    with pytest.raises(ValueError, match=f'holds {NUM_CLIENTS} clients, not 5'):
        link(
            str(tmp_path / 'x'),
            dataset=shared_population.dataset(root),
            partition_name='natural',
            num_clients=5,
            seed=0,
        )
