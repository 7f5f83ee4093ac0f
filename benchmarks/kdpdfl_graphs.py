"""KD-PDFL's collaboration graphs W from a bench directory: the paper's Fig. 5 analogue.

Reads the `collaboration_graph.csv` (row i: client i's weights w_ij) that every `kdpdfl` run of
a `tff-pfl-bench` output directory writes, and writes next to the suite's committed results:

- `<out>.png`: one heatmap per run (algorithm label, partition, seed), in suite order, titled
  with the run's mean test accuracy;
- `<out>.md`: per run, the accuracy, the share of off-diagonal weights at zero, the mean row
  sum of W and the mean number of non-zero weights per row (a star with a single non-zero
  neighbour weight mixes that neighbour alone into its model);
- `<out>.json`: the same numbers and the matrices.

    uv run --locked python benchmarks/kdpdfl_graphs.py --bench_dir=runs/bench/kdpdfl_fmnist_mu \
        --out=benchmarks/results/kdpdfl_fmnist_mu_suite/W
"""

import csv
import glob
import json
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

_BENCH_DIR = flags.DEFINE_string('bench_dir', None, 'A tff-pfl-bench output directory.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Output path prefix (.md, .json, .png).', required=True)
_COLUMNS = flags.DEFINE_integer('columns', 3, 'Heatmaps per row of the figure.')


def read_graph(path):
    """W from a run's collaboration_graph.csv.

    Args:
      path: the csv (a header of client ids, then one row per client).

    Returns:
      A float64 array `[M, M]`.
    """
    with open(path, newline='') as f:
        rows = list(csv.reader(f))[1:]
    return np.asarray([[float(v) for v in row[1:]] for row in rows], dtype=np.float64)


def graph_stats(graph):
    """Sparsity and mass of W off its diagonal.

    Args:
      graph: `[M, M]` weights.

    Returns:
      A dict: `zero_share` (off-diagonal weights equal to 0), `mean_row_sum`,
      `mean_nonzero_per_row`.
    """
    m = graph.shape[0]
    off = graph[~np.eye(m, dtype=bool)].reshape(m, m - 1)
    return {
        'zero_share': float(np.mean(off == 0.0)),
        'mean_row_sum': float(np.mean(off.sum(axis=1))),
        'mean_nonzero_per_row': float(np.mean((off > 0).sum(axis=1))),
    }


def collect(bench_dir):
    """Every run with a collaboration graph, in the order of the bench's results.csv.

    Args:
      bench_dir: the bench output directory.

    Returns:
      A list of dicts: `algorithm`, `partition`, `seed`, `accuracy` (mean over
      clients, %), `graph` and the `graph_stats` keys.
    """
    with open(os.path.join(bench_dir, 'results.csv'), newline='') as f:
        results = list(csv.DictReader(f))
    runs = {}
    for row in results:
        key = (row['algorithm'], row['partition'], row['seed'])
        runs.setdefault(key, []).append(float(row['accuracy']))
    found = []
    for (algorithm, partition, seed), accuracies in runs.items():
        matches = [
            p
            for p in glob.glob(os.path.join(bench_dir, 'runs', '*', '*', f'seed{seed}', 'collaboration_graph.csv'))
            if _label_of(p) == (algorithm, partition)
        ]
        if not matches:
            continue
        graph = read_graph(matches[0])
        found.append(
            dict(
                algorithm=algorithm,
                partition=partition,
                seed=int(seed),
                accuracy=100 * float(np.mean(accuracies)),
                graph=graph,
                **graph_stats(graph),
            )
        )
    return found


def _label_of(path):
    """(algorithm label, partition label) of a run directory, read from its bench_result.json."""
    with open(os.path.join(os.path.dirname(path), 'bench_result.json')) as f:
        record = json.load(f)
    return record['algorithm'], record['partition']


def main(argv):
    del argv
    runs = collect(_BENCH_DIR.value)
    if not runs:
        raise SystemExit(f'kdpdfl_graphs: no collaboration_graph.csv under {_BENCH_DIR.value}/runs')
    columns = min(_COLUMNS.value, len(runs))
    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 3.1 * rows), squeeze=False)
    for ax in axes.flat[len(runs) :]:
        ax.axis('off')
    for ax, run in zip(axes.flat, runs):
        image = ax.imshow(run['graph'], cmap='viridis', vmin=0)
        ax.set_title(f'{run["algorithm"]}\n{run["partition"]}, seed {run["seed"]}: {run["accuracy"]:.1f}%', fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle("KD-PDFL collaboration graph W (row i: client i's weights) at the end of the run")
    fig.tight_layout()
    fig.savefig(_OUT.value + '.png', dpi=100)
    plt.close(fig)
    lines = [
        '# KD-PDFL collaboration graphs',
        '',
        f'Command: `uv run --locked python benchmarks/kdpdfl_graphs.py --bench_dir={_BENCH_DIR.value} '
        f'--out={_OUT.value}`',
        '',
        'accuracy: mean per-client test accuracy of the run (%); zero: share of the off-diagonal weights at 0; '
        'row sum: mean over clients of the sum of their weights; non-zero per row: mean number of neighbours a '
        'client still weighs.',
        '',
        '| algorithm | partition | seed | accuracy | zero | row sum | non-zero per row |',
        '|---|---|---:|---:|---:|---:|---:|',
    ]
    for run in runs:
        lines.append(
            f'| {run["algorithm"]} | {run["partition"]} | {run["seed"]} | {run["accuracy"]:.2f} | '
            f'{100 * run["zero_share"]:.0f}% | {run["mean_row_sum"]:.3f} | {run["mean_nonzero_per_row"]:.2f} |'
        )
    lines += ['', f'![W]({os.path.basename(_OUT.value)}.png)']
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    with open(_OUT.value + '.json', 'w') as f:
        json.dump([{**r, 'graph': r['graph'].tolist()} for r in runs], f, indent=1)
    print(f'wrote {_OUT.value}.md, .png, .json ({len(runs)} runs)')


if __name__ == '__main__':
    app.run(main)
