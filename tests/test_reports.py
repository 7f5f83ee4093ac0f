"""Tests for tff_pfl.reports and tff_pfl.client_plots."""

import csv
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import pyplot as plt

from tff_pfl import client_plots, reports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def read_csv(path):
    with open(path, newline='', encoding='utf-8') as f:
        return list(csv.reader(f))


def assert_png(path):
    """Asserts a PNG exists with a sane size, and no figure was left open."""
    assert os.path.getsize(path) > 0
    with open(path, 'rb') as f:
        head = f.read(24)
    assert head.startswith(PNG_MAGIC)
    # The IHDR chunk comes first: width and height are big-endian uint32.
    width, height = struct.unpack('>II', head[16:24])
    assert width > 50 and height > 50
    assert 0.1 < width / height < 10
    assert plt.get_fignums() == []


def test_write_csv_round_trip(tmp_path):
    path = str(tmp_path / 'out' / 'rounds.csv')
    rows = [
        {'round': 1, 'loss': 0.123456789, 'acc': None},
        {'round': 2, 'loss': np.float32(0.5), 'note': 'x,y'},
        {'acc': 1e-8, 'round': 3},
    ]
    reports.write_csv(path, rows)
    assert read_csv(path) == [
        ['round', 'loss', 'acc', 'note'],
        ['1', '0.123457', '', ''],
        ['2', '0.5', '', 'x,y'],
        ['3', '', '1e-08', ''],
    ]
    assert os.listdir(tmp_path / 'out') == ['rounds.csv']


def test_write_csv_replaces_existing_file(tmp_path):
    path = str(tmp_path / 'a.csv')
    reports.write_csv(path, [{'a': 1, 'b': 2}, {'a': 3, 'b': 4}])
    reports.write_csv(path, [{'c': 2.0}])
    assert read_csv(path) == [['c'], ['2']]
    assert not os.path.exists(path + '.tmp')


def test_write_text_atomic(tmp_path):
    path = str(tmp_path / 'sub' / 'summary.md')
    reports.write_text_atomic(path, 'first\n')
    reports.write_text_atomic(path, 'héllo\n')
    with open(path, encoding='utf-8') as f:
        assert f.read() == 'héllo\n'
    assert os.listdir(tmp_path / 'sub') == ['summary.md']


def test_plot_curves(tmp_path):
    rows = [
        {'round': 1, 'train_loss': 1.0, 'val_loss': None},
        {'round': 2, 'train_loss': 0.7, 'val_loss': 0.9},
        {'round': 3, 'val_loss': 0.8},
        {'round': 4, 'train_loss': 0.4, 'val_loss': 0.6},
    ]
    path = str(tmp_path / 'plots' / 'loss.png')
    reports.plot_curves(rows, 'round', ['train_loss', 'val_loss', 'absent'], path, 'Loss', 'loss')
    assert_png(path)


def test_plot_curves_with_no_points(tmp_path):
    path = str(tmp_path / 'empty.png')
    reports.plot_curves([], 'round', ['loss'], path, 'Nothing', 'loss')
    assert_png(path)


@pytest.mark.parametrize('num_clients', [3, 15])
def test_plot_client_bars(tmp_path, num_clients):
    rng = np.random.default_rng(0)
    client_ids = [f'client_{i:05d}' for i in range(num_clients)]
    series = {
        'global model': rng.uniform(size=num_clients),
        'personalized model': list(rng.uniform(size=num_clients)),
    }
    path = str(tmp_path / 'bars.png')
    reports.plot_client_bars(client_ids, series, path, 'Accuracy', 'accuracy')
    assert_png(path)


def test_plot_client_bars_rejects_wrong_length(tmp_path):
    with pytest.raises(ValueError, match='2 values for 3 clients'):
        reports.plot_client_bars(
            ['a', 'b', 'c'], {'global model': [0.1, 0.2]}, str(tmp_path / 'bars.png'), 'Accuracy', 'accuracy'
        )
    assert plt.get_fignums() == []


def test_plot_bars_with_error_bars(tmp_path):
    path = str(tmp_path / 'std.png')
    reports.plot_bars(['FedAvg', 'PersFL'], [3.0, 1.0], path, 'Std across clients', 'std (%)', errors=[0.5, None])
    assert_png(path)
    with pytest.raises(ValueError, match='1 values for 2 labels'):
        reports.plot_bars(['a', 'b'], [1.0], path, 't', 'y')
    assert plt.get_fignums() == []


def test_plot_class_histogram(tmp_path):
    histogram = np.array([[5, 0, 3], [0, 7, 1], [2, 2, 2], [10, 0, 0]])
    path = str(tmp_path / 'partition.png')
    reports.plot_class_histogram(histogram, path, 'Partition')
    assert_png(path)


def test_plot_class_histogram_many_clients_and_classes(tmp_path):
    histogram = np.random.default_rng(1).integers(0, 20, size=(30, 15))
    path = str(tmp_path / 'partition.png')
    reports.plot_class_histogram(histogram, path, 'Partition')
    assert_png(path)


def test_per_client_figures_of_4000_clients_keep_a_drawable_size(tmp_path):
    from PIL import Image  # pylint: disable=g-import-not-at-top

    rng = np.random.default_rng(2)
    ids = [f'client_{i:05d}' for i in range(4000)]
    figures = {
        'partition.png': lambda p: reports.plot_class_histogram(rng.integers(0, 20, size=(4000, 10)), p, 'Partition'),
        'clients.png': lambda p: reports.plot_client_bars(ids, {'global': rng.uniform(size=4000)}, p, 'Acc', 'acc'),
        'graph.png': lambda p: reports.plot_heatmap(rng.uniform(size=(4000, 4000)), p, 'W', ids, ids),
    }
    for name, draw in figures.items():
        path = str(tmp_path / name)
        draw(path)
        assert_png(path)
        width, height = Image.open(path).size
        assert width <= 1500 and height <= 1500, (name, width, height)
    assert plt.get_fignums() == []


def test_plot_class_histogram_rejects_vector(tmp_path):
    with pytest.raises(ValueError, match='clients, classes'):
        reports.plot_class_histogram(np.arange(4), str(tmp_path / 'h.png'), 'Partition')


def test_plot_heatmap(tmp_path):
    matrix = np.arange(12, dtype=float).reshape(3, 4)
    path = str(tmp_path / 'heat.png')
    reports.plot_heatmap(matrix, path, 'Similarity', row_labels=['a', 'b', 'c'], col_labels=['w', 'x', 'y', 'z'])
    assert_png(path)
    path2 = str(tmp_path / 'heat2.png')
    reports.plot_heatmap(matrix, path2, 'No labels')
    assert_png(path2)


def test_plot_heatmap_rejects_bad_labels(tmp_path):
    with pytest.raises(ValueError, match='2 row labels for 3 rows'):
        reports.plot_heatmap(np.zeros((3, 4)), str(tmp_path / 'h.png'), 't', row_labels=['a', 'b'])
    with pytest.raises(ValueError, match='column labels'):
        reports.plot_heatmap(np.zeros((3, 4)), str(tmp_path / 'h.png'), 't', col_labels=['a'])


def test_plots_do_not_accumulate_figures(tmp_path):
    for i in range(5):
        reports.plot_curves([{'r': 1, 'v': 1.0}], 'r', ['v'], str(tmp_path / f'{i}.png'), 't', 'v')
    assert plt.get_fignums() == []


def test_markdown_table():
    rows = [
        {'name': 'a|b', 'acc': 0.5, 'n': 3},
        {'name': 'c', 'acc': None},
        {'name': 'd', 'acc': np.float32(0.25), 'n': 12},
    ]
    assert reports.markdown_table(rows, ['name', 'acc', 'n']) == (
        '| name | acc | n |\n| --- | --- | --- |\n| a\\|b | 0.5000 | 3 |\n| c |  |  |\n| d | 0.2500 | 12 |'
    )
    assert reports.markdown_table(rows[:1], ['acc'], float_format='{:.1%}') == '| acc |\n| --- |\n| 50.0% |'


def test_markdown_table_stops_after_max_rows_and_says_how_many_are_left():
    rows = [{'client': f'c{i}', 'acc': i / 10} for i in range(5)]
    assert reports.markdown_table(rows, ['client', 'acc'], '{:.1f}', max_rows=2, more='clients in clients.csv') == (
        '| client | acc |\n| --- | --- |\n| c0 | 0.0 |\n| c1 | 0.1 |\n\n... and 3 more clients in clients.csv'
    )
    assert reports.markdown_table(rows, ['client'], max_rows=5) == reports.markdown_table(rows, ['client'])


def test_format_table():
    rows = [
        {'client': 'client_00000', 'acc': 0.91234, 'n': 37},
        {'client': 'c1', 'acc': None, 'n': 5},
        {'client': 'c2', 'acc': 1.0, 'n': 100},
    ]
    assert reports.format_table(rows, ['client', 'acc', 'n']) == (
        'client           acc    n\n'
        '------------  ------  ---\n'
        'client_00000  0.9123   37\n'
        'c1                      5\n'
        'c2            1.0000  100'
    )


def test_format_table_stops_after_max_rows_and_says_how_many_are_left():
    rows = [{'client': f'c{i}', 'acc': 0.5} for i in range(5)]
    assert reports.format_table(rows, ['client', 'acc'], max_rows=2, more='clients in clients.csv') == (
        'client     acc\n------  ------\nc0      0.5000\nc1      0.5000\n... and 3 more clients in clients.csv'
    )
    assert reports.format_table(rows, ['client', 'acc'], max_rows=5) == reports.format_table(rows, ['client', 'acc'])


def test_format_table_header_wider_than_values():
    rows = [{'accuracy': 0.5, 'name': 'x'}]
    assert reports.format_table(rows, ['name', 'accuracy']) == ('name  accuracy\n----  --------\nx       0.5000')


def test_round_release_writes_csv_and_tensorboard_and_drops_later_rounds_when_released_again(tmp_path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    path, logdir = str(tmp_path / 'metrics.csv'), str(tmp_path / 'tb')
    release = reports.RoundRelease(path, logdir)
    release({'round': 1, 'name': 'x', 'loss': 2.0 / 3.0})  # columns keep the row's order, not sorted
    assert read_csv(path) == [['round', 'name', 'loss'], ['1', 'x', '0.666667']]  # readable after each round
    release({'round': 2, 'loss': np.float32(0.5), 'name': 'y'})
    release({'round': 3, 'loss': 0.25, 'name': 'z', 'acc': 0.75})  # a new column
    release.close()
    release.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match='closed'):
        release({'round': 4, 'loss': 0.1})
    assert read_csv(path) == [
        ['round', 'name', 'loss', 'acc'],
        ['1', 'x', '0.666667', ''],
        ['2', 'y', '0.5', ''],
        ['3', 'z', '0.25', '0.75'],
    ]
    resumed = reports.RoundRelease(path, logdir)
    resumed({'round': 2, 'loss': 0.125, 'name': 'again'})  # a resumed run releases round 2 again
    resumed.close()
    assert read_csv(path) == [['round', 'name', 'loss', 'acc'], ['1', 'x', '0.666667', ''], ['2', 'again', '0.125', '']]
    found = []
    for name in sorted(os.listdir(logdir)):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, name)):
            for value in event.summary.value:
                found.append((event.step, value.tag, round(float(tf.make_ndarray(value.tensor)), 6)))
    assert sorted(found) == [
        (1, 'loss', 0.666667),
        (2, 'loss', 0.125),
        (2, 'loss', 0.5),
        (3, 'acc', 0.75),
        (3, 'loss', 0.25),
    ]


def test_importing_and_plotting_leave_pyplot_and_its_backend_alone(tmp_path):
    # A notebook's inline backend must survive `import reports` and a plot.
    code = (
        'import sys; from tff_pfl import reports; '
        f'reports.plot_curves([{{"round": 1, "a": 0.5}}], "round", ["a"], {str(tmp_path / "c.png")!r}, "t", "y"); '
        'assert "matplotlib.pyplot" not in sys.modules, "pyplot imported"; print("ok")'
    )
    result = subprocess.run(
        [sys.executable, '-c', code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
        cwd=REPO,
    )
    assert result.stdout.strip() == 'ok', result.stderr[-2000:]
    assert (tmp_path / 'c.png').stat().st_size > 0


def test_client_fields_and_plots_of_client_states(tmp_path):
    states = {
        'client_00002': {'alpha': np.float32(0.25), 'steps': np.int32(3)},
        'client_00010': {'alpha': np.float32(0.75), 'steps': np.int32(5)},
    }
    ids, fields = client_plots.client_fields(states, ('alpha', 'steps'))
    assert ids == ['client_00002', 'client_00010'] and client_plots.short_ids(ids) == ['00002', '00010']
    np.testing.assert_array_equal(fields['alpha'], [0.25, 0.75])
    np.testing.assert_array_equal(fields['steps'], [3, 5])

    class View(dict):  # a store's view reads the fields itself
        def fields(self, names):
            return {n: np.array([7.0]) for n in names}

    assert client_plots.client_fields(View(client_00001=None), ('alpha',))[1]['alpha'].tolist() == [7.0]
    client_plots.plot_client_field(
        str(tmp_path), ids, fields['steps'], 'steps.png', 'steps', 'Steps', 'steps', kind=int
    )
    assert (tmp_path / 'steps.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    client_plots.plot_client_matrix(str(tmp_path), 'w', 'W', np.array([[1.0, 0.0], [0.5, 0.5]]), ids)
    with open(tmp_path / 'w.csv') as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {'client_id': 'client_00002', '00002': '1', '00010': '0'},
        {'client_id': 'client_00010', '00002': '0.5', '00010': '0.5'},
    ]
    assert (tmp_path / 'w.png').exists()
