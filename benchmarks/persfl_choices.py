"""PersFL's chosen distillation parameters per client (the paper's Table 5 analogue) and grid heatmaps.

Reads the PersFL runs of a bench output directory (`tff-pfl-bench` with a PersFL suite) and writes,
next to the suite's committed results:

- `<out>.md`: for every partition, each user's temperature T and imitation lambda chosen on its
  validation split, averaged over the seeds (Table 5 reports the average over runs), with the
  share of seeds in which lambda = 0 (plain fine-tuning of the teacher won);
- `<out>_<partition>.png`: the (T, lambda) grid, the validation accuracy of every candidate
  averaged over clients and seeds, each client's accuracies taken relative to its best candidate
  (0 is the best, so clients of different difficulty weigh the same);
- `<out>.json`: the numbers.

    uv run --locked python benchmarks/persfl_choices.py --bench_dir=runs/bench/persfl_fmnist \
        --out=benchmarks/results/persfl_fmnist_suite/choices
"""

import csv
import glob
import json
import os
import re

import numpy as np
from absl import app, flags

from tff_pfl import reports

_BENCH_DIR = flags.DEFINE_string('bench_dir', None, 'A tff-pfl-bench output directory.', required=True)
_ALGORITHM = flags.DEFINE_string('algorithm', 'persfl', "The PersFL entry's directory name in the suite.")
_OUT = flags.DEFINE_string('out', None, 'Output path prefix (.md, .json, _<partition>.png).', required=True)

_CANDIDATE = re.compile(r'T=([0-9.]+), λ=([0-9.]+)')


def _read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _partition_choices(run_dirs):
    """Per-client chosen (T, lambda) and the relative grid, over the seeds' runs."""
    temperatures, imitations, relative = {}, {}, []
    columns = None
    for run in run_dirs:
        for row in _read_csv(os.path.join(run, 'clients.csv')):
            temperatures.setdefault(row['client_id'], []).append(float(row['temperature']))
            imitations.setdefault(row['client_id'], []).append(float(row['imitation']))
        grid = _read_csv(os.path.join(run, 'distillation_grid.csv'))
        columns = [c for c in grid[0] if c != 'client_id']
        values = np.array([[float(row[c]) for c in columns] for row in grid])
        relative.append(values - values.max(axis=1, keepdims=True))
    return temperatures, imitations, columns, np.concatenate(relative)


def _grid_matrix(columns, mean_relative):
    """Lays the candidates out as a lambda x T matrix (NaN where the grid has no candidate)."""
    pairs = [tuple(float(v) for v in _CANDIDATE.fullmatch(c).groups()) for c in columns]
    ts = sorted({t for t, _ in pairs})
    lambdas = sorted({lam for _, lam in pairs})
    matrix = np.full((len(lambdas), len(ts)), np.nan)
    for (t, lam), value in zip(pairs, mean_relative):
        matrix[lambdas.index(lam), ts.index(t)] = value
    return matrix, ts, lambdas


def main(argv):
    del argv
    root = os.path.join(_BENCH_DIR.value, 'runs')
    partitions = sorted(p for p in os.listdir(root) if os.path.isdir(os.path.join(root, p, _ALGORITHM.value)))
    if not partitions:
        raise app.UsageError(f'no {_ALGORITHM.value} runs under {root}')
    lines = [
        f'# PersFL: chosen distillation parameters ({os.path.basename(os.path.normpath(_BENCH_DIR.value))})',
        '',
        'Each cell: the temperature T and imitation lambda a user chose on its validation split,',
        "averaged over the seeds (the paper's Table 5 reports the average over its runs); `λ=0`: the",
        'share of seeds in which lambda = 0 (fine-tuning the teacher) won.',
        f'Command: `uv run --locked python benchmarks/persfl_choices.py --bench_dir={_BENCH_DIR.value} '
        f'--out={_OUT.value}`',
        '',
    ]
    output = {}
    for partition in partitions:
        runs = sorted(
            d
            for d in glob.glob(os.path.join(root, partition, _ALGORITHM.value, 'seed*'))
            if os.path.exists(os.path.join(d, 'distillation_grid.csv'))
        )
        if not runs:
            continue
        temperatures, imitations, columns, relative = _partition_choices(runs)
        clients = sorted(temperatures)
        rows = [
            {
                'user': i,
                'T': float(np.mean(temperatures[c])),
                'λ': float(np.mean(imitations[c])),
                'λ=0': float(np.mean(np.array(imitations[c]) == 0)),
            }
            for i, c in enumerate(clients)
        ]
        everyone = np.concatenate([imitations[c] for c in clients])
        rows.append(
            {
                'user': 'all',
                'T': float(np.mean(np.concatenate([temperatures[c] for c in clients]))),
                'λ': float(everyone.mean()),
                'λ=0': float(np.mean(everyone == 0)),
            }
        )
        table = reports.markdown_table(rows, ['user', 'T', 'λ', 'λ=0'], float_format='{:.2f}')
        lines += [f'## {partition} ({len(runs)} seeds)', '', table]
        matrix, ts, lambdas = _grid_matrix(columns, relative.mean(axis=0))
        png = f'{_OUT.value}_{partition}.png'
        reports.plot_heatmap(
            100 * matrix,
            png,
            f"{partition}: validation accuracy relative to each client's best (points)",
            row_labels=[f'{v:g}' for v in lambdas],
            col_labels=[f'{v:g}' for v in ts],
            xlabel='temperature T',
            ylabel='imitation λ',
        )
        lines += ['', f'![{partition} grid]({os.path.basename(png)})', '']
        output[partition] = {
            'seeds': len(runs),
            'clients': rows,
            'grid': {'T': ts, 'lambda': lambdas, 'relative_validation_accuracy': matrix.tolist()},
        }
    reports.write_text_atomic(_OUT.value + '.md', '\n'.join(lines) + '\n')
    reports.write_text_atomic(_OUT.value + '.json', json.dumps(output, indent=2) + '\n')


if __name__ == '__main__':
    app.run(main)
