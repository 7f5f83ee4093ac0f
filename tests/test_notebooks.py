"""The notebooks run from top to bottom, and are committed without outputs.

Each notebook is executed on a fresh kernel of this environment, with its
working directory `notebooks/` and its runs written under a temporary
directory. Their cells assert what they show (e.g. personalized accuracy
above the global model's), so a notebook that runs but shows nonsense fails.
"""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / 'notebooks'
PATHS = sorted(NOTEBOOKS.glob('*.ipynb'))


def test_there_is_a_tour_one_notebook_per_algorithm_and_shakespeare():
    names = [p.stem for p in PATHS]
    algorithms = ['01_persfl', '02_selffl', '03_ktpfl', '04_kdpdfl']
    assert names == ['00_tour', *algorithms, '05_shakespeare', '06_bring_your_own']


@pytest.mark.parametrize('path', PATHS, ids=[p.stem for p in PATHS])
def test_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == 'code':
            assert cell.outputs == [] and cell.execution_count is None, f'{path.name}: clear the outputs'


@pytest.mark.parametrize('path', PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv('TFF_PFL_RUNS', str(tmp_path))
    monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '3')
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
    errors = [o for c in notebook.cells if c.cell_type == 'code' for o in c.outputs if o.output_type == 'error']
    assert not errors
