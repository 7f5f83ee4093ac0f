"""What a user looks at after a run: CSV files, plots, tables, TensorBoard.

Files are written atomically where a reader may see them mid-run (a temporary
`path + '.tmp'` is written and then moved over `path` with `os.replace`), so
a crashed or concurrent run never leaves a half-written CSV or text file.

Plots are drawn on `matplotlib.figure.Figure` objects, never through
`pyplot`: nothing global changes (a notebook keeps its own backend and its
inline plots), and no figure stays registered, so memory stays flat over
many rounds.

TensorFlow Federated is imported only when a `RoundRelease` is created, so
that importing this module stays fast.
"""

import collections
import csv
import keyword
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

_DPI = 120
_ROTATE_TICKS_ABOVE = 12
# Above this many clients, per-client figures keep a fixed size: one bar or
# tick per client would make an image too large to draw or to read.
_MANY_CLIENTS = 100


def _is_float(value: Any) -> bool:
    """Whether `value` is a Python or numpy floating point scalar."""
    return isinstance(value, (float, np.floating))


def _is_number(value: Any) -> bool:
    """Whether `value` is a real number (bools excluded)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _make_parent_dir(path: str) -> None:
    """Creates the directory that will hold `path`, if it has one."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)


def _csv_cell(value: Any) -> Any:
    """Formats one CSV cell: floats with `.6g`, `None` as empty."""
    if value is None:
        return ''
    if _is_float(value):
        return format(float(value), '.6g')
    return value


def _union_of_keys(rows: Sequence[Mapping[str, object]]) -> list[str]:
    """The keys of all rows, in first-seen order."""
    seen = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def write_text_atomic(path: str, text: str) -> None:
    """Writes `text` to `path` (UTF-8) through a temporary file.

    Args:
      path: The file to write; its parent directory is created if needed.
      text: The full contents of the file.
    """
    _make_parent_dir(path)
    tmp_path = path + '.tmp'
    try:
        with open(tmp_path, 'w', encoding='utf-8') as f:
            f.write(text)
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def write_csv(path: str, rows: Sequence[Mapping[str, object]]) -> None:
    """Writes `rows` as a CSV file, atomically.

    The header is the union of the rows' keys in first-seen order; a row
    without some key gets an empty cell there. Floats (Python or numpy) are
    written with `format(value, '.6g')` and `None` as an empty cell.

    Args:
      path: The file to write; its parent directory is created if needed.
      rows: One mapping from column name to value per row.
    """
    fieldnames = _union_of_keys(rows)
    _make_parent_dir(path)
    tmp_path = path + '.tmp'
    try:
        with open(tmp_path, 'w', newline='', encoding='utf-8') as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames, restval='')
            writer.writeheader()
            for row in rows:
                writer.writerow({k: _csv_cell(v) for k, v in row.items()})
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def _save(fig: Figure, path: str) -> None:
    """Saves `fig` as a PNG at `path`."""
    _make_parent_dir(path)
    fig.savefig(path, dpi=_DPI, format='png', bbox_inches='tight')


def plot_curves(
    rows: Sequence[Mapping[str, object]],
    x_key: str,
    y_keys: Sequence[str],
    path: str,
    title: str,
    ylabel: str,
) -> None:
    """Plots several columns of `rows` against `x_key` as lines.

    Each series uses only the rows where both `x_key` and its own key are
    present and not `None`; a series with no such rows is left out.

    Args:
      rows: One mapping per point, e.g. one per round.
      x_key: The column on the x axis, e.g. `'round'`.
      y_keys: The columns to plot, one line each, labelled by key.
      path: Where to write the PNG.
      title: The figure title.
      ylabel: The y axis label.
    """
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    plotted = False
    for key in y_keys:
        points = [(row[x_key], row[key]) for row in rows if row.get(x_key) is not None and row.get(key) is not None]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker='.' if len(xs) < 50 else None, label=key)
        plotted = True
    if plotted:
        ax.legend()
    ax.set_title(title)
    ax.set_xlabel(x_key)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    _save(fig, path)


def plot_accuracy_vs_epsilon(rows: Sequence[Mapping], path: str, title: str) -> None:
    """Mean and worst-10 % accuracy against epsilon, one line per algorithm; runs without DP as dashed levels.

    Args:
      rows: summary rows with `registry_name`, `epsilon` (None: no DP),
        `accuracy_mean` and `worst_10` (in %).
      path: where to write the PNG.
      title: the figure title.
    """
    fig = Figure(figsize=(11, 5))
    axes = fig.subplots(1, 2, sharey=True)
    names = list(dict.fromkeys(row['registry_name'] for row in rows))
    colors = {name: f'C{i % 10}' for i, name in enumerate(names)}
    for ax, key, label in zip(axes, ('accuracy_mean', 'worst_10'), ('mean over clients', 'worst 10 % of clients')):
        for name in names:
            private = sorted(
                (row['epsilon'], row[key])
                for row in rows
                if row['registry_name'] == name and row['epsilon'] is not None
            )
            if private:
                xs, ys = zip(*private)
                ax.plot(xs, ys, marker='o', color=colors[name], label=name)
            for row in rows:
                if row['registry_name'] == name and row['epsilon'] is None:
                    ax.axhline(row[key], color=colors[name], linestyle='--', linewidth=1, label=f'{name}, no DP')
        ax.set_xscale('log')
        ax.set_xlabel('epsilon (log scale)')
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel('test accuracy (%)')
    axes[1].legend(fontsize='small')
    fig.suptitle(title)
    _save(fig, path)


def plot_client_bars(
    client_ids: Sequence[str],
    series: Mapping[str, Sequence[float]],
    path: str,
    title: str,
    ylabel: str,
    xlabel: str = 'client',
) -> None:
    """Grouped bar chart of per-client values, one bar colour per series.

    A dashed horizontal line in the series' colour marks each series' mean
    (e.g. the mean accuracy of the global and of the personalized models).

    Args:
      client_ids: The x tick labels, one group of bars per client. Labels are
        rotated when there are more than 12 clients. With more than 100
        clients, each series is drawn instead as a line of its values sorted
        in increasing order (the x axis ranks the clients), at a fixed size.
      series: Series name -> one value per client, in `client_ids` order.
      path: Where to write the PNG.
      title: The figure title.
      ylabel: The y axis label.
      xlabel: The x axis label (the groups need not be clients).

    Raises:
      ValueError: If a series does not have one value per client.
    """
    num_clients = len(client_ids)
    for name, values in series.items():
        if len(values) != num_clients:
            raise ValueError(f'series {name!r} has {len(values)} values for {num_clients} clients')
    if num_clients > _MANY_CLIENTS:
        _plot_sorted_client_values(series, path, title, ylabel)
        return
    num_series = max(1, len(series))
    width = 0.8 / num_series
    positions = np.arange(num_clients)
    labels = [str(c) for c in client_ids]
    rotate = num_clients > _ROTATE_TICKS_ABOVE
    # Inches per client group: room for the bars and, when the tick labels
    # are horizontal, for the longest label.
    per_client = 0.25 * num_series
    if not rotate:
        longest = max([len(label) for label in labels] + [0])
        per_client = max(per_client, 0.1 * longest)
    fig_width = max(6.0, per_client * num_clients + 2.0)
    fig = Figure(figsize=(fig_width, 5))
    ax = fig.subplots()
    for i, (name, values) in enumerate(series.items()):
        color = f'C{i % 10}'
        values = np.asarray(values, dtype=np.float64)
        offsets = positions - 0.4 + width * (i + 0.5)
        ax.bar(offsets, values, width=width, color=color, label=name)
        if values.size:
            mean = float(np.nanmean(values))
            ax.axhline(
                mean,
                color=color,
                linestyle='--',
                linewidth=1,
                label=f'{name} mean ({mean:.4g})',
            )
    ax.set_xticks(positions)
    if rotate:
        ax.set_xticklabels(labels, rotation=90, fontsize='small')
    else:
        ax.set_xticklabels(labels)
    if series:
        ax.legend(loc='upper left', bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis='y', alpha=0.3)
    _save(fig, path)


def _plot_sorted_client_values(series, path, title, ylabel) -> None:
    """`plot_client_bars` for many clients: each series sorted, as a line."""
    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    for i, (name, values) in enumerate(series.items()):
        color = f'C{i % 10}'
        values = np.sort(np.asarray(values, dtype=np.float64))
        ax.plot(np.arange(1, values.size + 1), values, color=color, label=name)
        if values.size:
            mean = float(np.nanmean(values))
            ax.axhline(mean, color=color, linestyle='--', linewidth=1, label=f'{name} mean ({mean:.4g})')
    if series:
        ax.legend(loc='upper left', bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title)
    ax.set_xlabel('client, ranked by its value (each series sorted on its own)')
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    _save(fig, path)


def plot_bars(
    labels: Sequence[str],
    values: Sequence[float],
    path: str,
    title: str,
    ylabel: str,
    errors: Sequence[float | None] | None = None,
) -> None:
    """One bar per label, with an optional error bar on each.

    Args:
      labels: The x tick labels, one per bar.
      values: The bar heights, in `labels` order.
      path: Where to write the PNG.
      title: The figure title.
      ylabel: The y axis label.
      errors: Optional half-lengths of the error bars, one per bar; `None`
        entries draw no error bar.

    Raises:
      ValueError: If `values` or `errors` do not have one entry per label.
    """
    if len(values) != len(labels):
        raise ValueError(f'{len(values)} values for {len(labels)} labels')
    if errors is not None and len(errors) != len(labels):
        raise ValueError(f'{len(errors)} errors for {len(labels)} labels')
    positions = np.arange(len(labels))
    fig = Figure(figsize=(max(6.0, 0.9 * len(labels) + 2.0), 5))
    ax = fig.subplots()
    yerr = None
    if errors is not None:
        yerr = np.asarray([np.nan if e is None else e for e in errors], dtype=np.float64)
    ax.bar(
        positions,
        np.asarray(values, dtype=np.float64),
        yerr=yerr,
        capsize=4,
        color=[f'C{i % 10}' for i in range(len(labels))],
    )
    ax.set_xticks(positions)
    ax.set_xticklabels(
        [str(label) for label in labels],
        rotation=90 if len(labels) > _ROTATE_TICKS_ABOVE else 0,
    )
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis='y', alpha=0.3)
    _save(fig, path)


def plot_class_histogram(histogram: np.ndarray, path: str, title: str) -> None:
    """Stacked horizontal bars of each client's examples per class.

    Args:
      histogram: Counts of shape `[num_clients, num_classes]`; row `i` is
        client `i` (drawn top to bottom), column `c` is class `c`.
      path: Where to write the PNG.
      title: The figure title.

    Raises:
      ValueError: If `histogram` is not 2-D.
    """
    histogram = np.asarray(histogram)
    if histogram.ndim != 2:
        raise ValueError(f'histogram must be [clients, classes], got shape {histogram.shape}')
    num_clients, num_classes = histogram.shape
    cmap = matplotlib.colormaps['tab10' if num_classes <= 10 else 'tab20']
    if num_clients > _MANY_CLIENTS:
        plot_heatmap(
            histogram,
            path,
            f'{title} (colour: examples)',
            col_labels=[str(c) for c in range(num_classes)],
            xlabel='class',
            ylabel='client',
        )
        return
    positions = np.arange(num_clients)
    fig = Figure(figsize=(8, max(3.0, 0.25 * num_clients + 1.5)))
    ax = fig.subplots()
    left = np.zeros(num_clients, dtype=np.float64)
    for c in range(num_classes):
        counts = histogram[:, c].astype(np.float64)
        ax.barh(
            positions,
            counts,
            left=left,
            color=cmap(c % cmap.N),
            label=str(c),
            height=0.8,
        )
        left += counts
    ax.set_yticks(positions)
    ax.set_yticklabels(
        [str(i) for i in range(num_clients)],
        fontsize='small' if num_clients > _ROTATE_TICKS_ABOVE else None,
    )
    ax.invert_yaxis()
    if num_classes:
        ax.legend(
            title='class',
            loc='center left',
            bbox_to_anchor=(1.0, 0.5),
            ncol=1 if num_classes <= 20 else 2,
        )
    ax.set_title(title)
    ax.set_xlabel('examples')
    ax.set_ylabel('client')
    _save(fig, path)


def plot_heatmap(
    matrix: np.ndarray,
    path: str,
    title: str,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
) -> None:
    """Draws a matrix as an image with a colour bar.

    Args:
      matrix: A 2-D array of numbers.
      path: Where to write the PNG.
      title: The figure title.
      row_labels: Optional y tick labels, one per row (not drawn beyond
        100 rows).
      col_labels: Optional x tick labels, one per column (not drawn beyond
        100 columns).
      xlabel: Optional x-axis label.
      ylabel: Optional y-axis label.

    Raises:
      ValueError: If `matrix` is not 2-D or the labels do not match its
        shape.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f'matrix must be 2-D, got shape {matrix.shape}')
    num_rows, num_cols = matrix.shape
    if row_labels is not None and len(row_labels) != num_rows:
        raise ValueError(f'{len(row_labels)} row labels for {num_rows} rows')
    if col_labels is not None and len(col_labels) != num_cols:
        raise ValueError(f'{len(col_labels)} column labels for {num_cols} columns')
    fig = Figure(figsize=(7, 6))
    ax = fig.subplots()
    image = ax.imshow(matrix, aspect='auto', interpolation='nearest')
    fig.colorbar(image, ax=ax)
    if row_labels is not None and num_rows <= _MANY_CLIENTS:
        ax.set_yticks(np.arange(num_rows))
        ax.set_yticklabels([str(label) for label in row_labels])
    if col_labels is not None and num_cols <= _MANY_CLIENTS:
        ax.set_xticks(np.arange(num_cols))
        ax.set_xticklabels(
            [str(label) for label in col_labels],
            rotation=90 if num_cols > _ROTATE_TICKS_ABOVE else 0,
        )
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    _save(fig, path)


def _markdown_cell(value: Any, float_format: str) -> str:
    """Formats one markdown cell; `|` is escaped so it cannot split cells."""
    if value is None:
        return ''
    if _is_float(value):
        text = float_format.format(float(value))
    else:
        text = str(value)
    return text.replace('|', '\\|').replace('\n', ' ')


def markdown_table(
    rows: Sequence[Mapping[str, object]],
    columns: Sequence[str],
    float_format: str = '{:.4f}',
    max_rows: int | None = None,
    more: str = 'rows',
) -> str:
    """Formats rows as a GitHub markdown table.

    Args:
      rows: One mapping per table row.
      columns: The columns to show, in order; a row missing a column gets an
        empty cell.
      float_format: A `str.format` pattern applied to floats.
      max_rows: show at most this many rows, then a paragraph
        `... and <k> more <more>`; None: every row.
      more: what the rows are, for that line.

    Returns:
      The table: a header line, a `---` separator line and one line per row,
      joined by newlines, without a trailing newline. `None` is shown as an
      empty cell.
    """
    hidden = 0 if max_rows is None else max(0, len(rows) - max_rows)
    rows = rows[: len(rows) - hidden]
    lines = [
        '| ' + ' | '.join(_markdown_cell(c, float_format) for c in columns) + ' |',
        '| ' + ' | '.join('---' for _ in columns) + ' |',
    ]
    for row in rows:
        cells = [_markdown_cell(row.get(c), float_format) for c in columns]
        lines.append('| ' + ' | '.join(cells) + ' |')
    if hidden:
        lines += ['', f'... and {hidden} more {more}']
    return '\n'.join(lines)


def _plain_cell(value: Any) -> str:
    """Formats one plain-text cell: floats with 4 decimals, `None` empty."""
    if value is None:
        return ''
    if _is_float(value):
        return f'{float(value):.4f}'
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, object]], columns: Sequence[str], max_rows: int | None = None, more: str = 'rows'
) -> str:
    """Formats rows as a fixed-width plain-text table for a terminal.

    A column whose present values are all numbers is right-aligned (its
    header too); other columns are left-aligned. Columns are separated by two
    spaces, floats have 4 decimals and `None` or a missing value is blank.

    Args:
      rows: One mapping per table row.
      columns: The columns to show, in order.
      max_rows: show at most this many rows, then a line
        `... and <k> more <more>`; None: every row.
      more: what the rows are, for that line.

    Returns:
      The header line, a line of dashes and one line per row, joined by
      newlines, without trailing spaces or a trailing newline.
    """
    hidden = 0 if max_rows is None else max(0, len(rows) - max_rows)
    rows = rows[: len(rows) - hidden]
    cells = [[_plain_cell(row.get(c)) for c in columns] for row in rows]
    numeric = []
    for c in columns:
        present = [row.get(c) for row in rows if row.get(c) is not None]
        numeric.append(bool(present) and all(_is_number(v) for v in present))
    widths = [max([len(str(c))] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def _line(texts: Sequence[str]) -> str:
        parts = [
            text.rjust(width) if is_numeric else text.ljust(width)
            for text, width, is_numeric in zip(texts, widths, numeric)
        ]
        return '  '.join(parts).rstrip()

    lines = [_line([str(c) for c in columns])]
    lines.append('  '.join('-' * width for width in widths))
    lines.extend(_line(line) for line in cells)
    if hidden:
        lines.append(f'... and {hidden} more {more}')
    return '\n'.join(lines)


def _in_order(values: Mapping[str, Any]):
    """`values` as a structure TFF flattens in its own order (the CSV's column order).

    TFF's release managers flatten mappings in sorted key order; a namedtuple
    keeps its fields' order. Names that cannot be fields keep the sorted order.
    """
    if all(k.isidentifier() and not keyword.iskeyword(k) and not k.startswith('_') for k in values):
        return collections.namedtuple('Row', list(values))(*values.values())
    return dict(values)


class RoundRelease:
    """Releases each round's metrics row through TFF's release managers.

    * `tff.program.CSVFileReleaseManager` keeps the CSV file, keyed by the
      `round` column. Releasing a round drops the rows of that round and
      later ones first, so a resumed run that releases its rounds again from
      round 1 leaves no stale row. Cells are formatted as in `write_csv`.
    * `tff.program.TensorBoardReleaseManager` writes every numeric value as a
      scalar (lists as histograms) at step `round`.

    The managers are coroutines; they run on an event loop of their own, in
    a thread, so that releasing works where a loop is already running (a
    notebook). Typical use:

    ```python
    release = reports.RoundRelease('run/metrics.csv', 'run/tensorboard')
    release({'round': 1, 'train_loss': 0.3})
    release.close()
    ```
    """

    def __init__(self, csv_path: str, tensorboard_dir: str):
        """Creates the managers (and the CSV file with its `round` header).

        Args:
          csv_path: the metrics CSV file; rows already in it are kept.
          tensorboard_dir: the directory of the TensorBoard event files.
        """
        import asyncio  # pylint: disable=g-import-not-at-top
        import threading  # pylint: disable=g-import-not-at-top

        import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

        self._asyncio = asyncio
        self._csv = tff.program.CSVFileReleaseManager(csv_path, key_fieldname='round')
        self._board = tff.program.TensorBoardReleaseManager(tensorboard_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name='metrics-release', daemon=True)
        self._thread.start()

    def __call__(self, row: Mapping[str, Any]) -> None:
        """Releases one row (`round` and its metrics) to the CSV file and to TensorBoard.

        Raises:
          RuntimeError: if the release is closed.
        """
        if self._loop.is_closed():
            raise RuntimeError('RoundRelease is closed')
        key = int(row['round'])
        cells = _in_order({k: _csv_cell(v) for k, v in row.items() if k != 'round'})
        numbers_only = {
            k: v for k, v in row.items() if k != 'round' and v is not None and not isinstance(v, (str, bytes))
        }

        async def release():
            await self._asyncio.gather(self._csv.release(cells, key=key), self._board.release(numbers_only, key=key))

        self._asyncio.run_coroutine_threadsafe(release(), self._loop).result()

    def close(self) -> None:
        """Stops the release thread and flushes TensorBoard; later calls do nothing."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._board = None  # its summary writer flushes as it is released
        import gc  # pylint: disable=g-import-not-at-top

        gc.collect()
