"""The notebooks run from top to bottom, and are committed without outputs.

Each notebook is executed on a fresh kernel of this environment, with its
working directory `notebooks/` and its runs written under a temporary
directory. Their cells assert what they show (e.g. personalized accuracy
above the global model's), so a notebook that runs but shows nonsense fails.

The tests run each notebook in a lighter form: every notebook sizes its runs in
one cell tagged `parameters` (papermill's convention), and the test adds a cell
right after it that sets those names again (`LIGHT`), with fewer rounds. The
notebook's own assertions then run on the lighter runs. With
`TFF_PFL_NOTEBOOKS=full` in the environment, the test runs them as committed.
"""

import ast
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / 'notebooks'
PATHS = sorted(NOTEBOOKS.glob('*.ipynb'))
# Notebook -> the names its `parameters` cell sets, and their lighter values. Each light value
# still carries the notebook's assertions (for 05, a global model past predicting spaces, which
# scores about 0.19: 0.2116 after 10 rounds, 0.2933 after 25).
LIGHT = {
    '00_tour': {'ROUNDS': 5},
    '01_persfl': {'ROUNDS': 8},
    '02_selffl': {'ROUNDS': 10},
    '03_ktpfl': {'ROUNDS': 4},
    '04_kdpdfl': {'INTERVALS': 20},
    '05_shakespeare': {'ROUNDS': 10, 'PAST_SPACES': 0.2},
    '06_bring_your_own': {'ROUNDS': 4},
}


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


def parameters_cell(notebook) -> int:
    """The index of the notebook's one code cell tagged `parameters`."""
    found = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == 'code' and 'parameters' in cell.metadata.get('tags', [])
    ]
    assert len(found) == 1, f'one cell tagged parameters, found {len(found)}'
    return found[0]


@pytest.mark.parametrize('path', PATHS, ids=[p.stem for p in PATHS])
def test_the_light_form_makes_the_notebooks_runs_smaller(path):
    notebook = nbformat.read(path, as_version=4)
    full = {}
    for node in ast.parse(notebook.cells[parameters_cell(notebook)].source).body:
        assert isinstance(node, ast.Assign), 'the parameters cell only assigns constants'
        full[node.targets[0].id] = ast.literal_eval(node.value)
    light = LIGHT[path.stem]
    assert set(light) <= set(full)
    for name, value in light.items():
        assert value <= full[name], name


def light_form(notebook, stem: str) -> None:
    """Inserts, after the `parameters` cell, a cell that sets `LIGHT[stem]`."""
    source = '\n'.join(f'{name} = {value!r}' for name, value in LIGHT[stem].items())
    cell = nbformat.v4.new_code_cell('# tests/test_notebooks.py: the light form\n' + source)
    cell.id = 'light-form'
    notebook.cells.insert(parameters_cell(notebook) + 1, cell)


@pytest.mark.parametrize('path', PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv('TFF_PFL_RUNS', str(tmp_path))
    monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '3')
    notebook = nbformat.read(path, as_version=4)
    if os.environ.get('TFF_PFL_NOTEBOOKS') != 'full':
        light_form(notebook, path.stem)
    client = NotebookClient(
        notebook, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
    errors = [o for c in notebook.cells if c.cell_type == 'code' for o in c.outputs if o.output_type == 'error']
    assert not errors
