"""A run's per-client figures: fields of its client states, one bar per client, client x client matrices.

The algorithms' report plots (`plots(output_dir, result, process)`) read
their client states' fields here (`client_fields`, without holding every
state) and draw them with `tff_pfl.reports`: one value per client as bars
(`plot_client_field`), a matrix over the clients as a heatmap and a CSV
(`plot_client_matrix`), labelled by the clients' short ids (`short_ids`).
"""

import os
from collections.abc import Sequence

import numpy as np

from tff_pfl import reports


def short_ids(client_ids: Sequence[str]) -> list[str]:
    """`client_00007` -> `00007`, for plot labels.

    Args:
      client_ids: the clients' ids.

    Returns:
      The ids without their `client_` prefix.
    """
    return [c.replace('client_', '') for c in client_ids]


def client_fields(client_states, fields: Sequence[str]) -> tuple[list[str], dict[str, np.ndarray]]:
    """`(client ids, {field: np.ndarray over clients})` of a run's client states, without holding every state.

    Reading every state whole into a list held one model per client in
    memory (about 5 GB for Self-FL at 1,000,000 clients).

    Args:
      client_states: the run's client states: a mapping client id -> state,
        or a store's view with a `fields(names)` method.
      fields: the state fields to read.

    Returns:
      The client ids, and each field stacked over them in that order.
    """
    if hasattr(client_states, 'fields'):  # a client_states.StateView
        return list(client_states), client_states.fields(fields)
    ids = list(client_states)
    values = {f: np.stack([np.asarray(client_states[c][f]) for c in ids]) for f in fields}
    return ids, values


def plot_client_field(
    output_dir: str, client_ids, values, file: str, label: str, title: str, ylabel: str, kind=float
) -> None:
    """One value per client (a field of its state, from `client_fields`) as `output_dir/file`, a bar each.

    Args:
      output_dir: the run's directory.
      client_ids: the clients.
      values: one value per client, in `client_ids` order.
      file: the PNG's file name.
      label: the series' legend label.
      title: the figure title.
      ylabel: the y-axis label.
      kind: `float` or `int`, how each value is shown.
    """
    reports.plot_client_bars(
        short_ids(client_ids), {label: [kind(v) for v in values]}, os.path.join(output_dir, file), title, ylabel
    )


def plot_client_matrix(
    output_dir: str,
    name: str,
    title: str,
    matrix: np.ndarray,
    client_ids: Sequence[str],
    row_labels: Sequence[str] | None = None,
) -> None:
    """A client x client matrix as `<name>.png` (heatmap) and `<name>.csv` in `output_dir`.

    Args:
      output_dir: the run's directory.
      name: the files' name without extension.
      title: the figure title.
      matrix: N x N numbers (row n: client n's).
      client_ids: the N clients, in the matrix's order.
      row_labels: optional row tick labels (default: the short ids).
    """
    short = short_ids(client_ids)
    reports.plot_heatmap(
        matrix, os.path.join(output_dir, f'{name}.png'), title, row_labels=row_labels or short, col_labels=short
    )
    reports.write_csv(
        os.path.join(output_dir, f'{name}.csv'),
        [dict(client_id=c, **{m: float(v) for m, v in zip(short, row)}) for c, row in zip(client_ids, matrix)],
    )
