"""Per client, how far each algorithm's model is above or below a baseline's (e.g. FedAvg's global model).

Reads a suite's `results.csv` (one row per partition, algorithm, seed and client; written by
`tff-pfl-bench` into its output and results directories) and writes, for every partition and
algorithm, the clients' accuracy differences to the baseline on the same client and seed:
their mean, median, the share of clients above, equal to and below it, and the mean difference
on the baseline's worst 10 % of clients (where personalization is meant to help most).

- `<out>.md`: the table;
- `<out>.png`: each algorithm's per-client differences, sorted (one line per algorithm);
- `<out>.json`: the numbers.

    uv run --locked python benchmarks/client_lift.py \
        --results=benchmarks/results/shakespeare_suite/results.csv --baseline=FedAvg \
        --out=benchmarks/results/shakespeare_suite/lift
"""

import argparse
import collections
import csv
import json
import math
import statistics

import numpy as np

from tff_pfl import reports


def lift(rows: list[dict], baseline: str) -> list[dict]:
    """Per partition and algorithm, the per-client differences to `baseline` (percentage points).

    Args:
      rows: `results.csv` rows (`partition`, `algorithm`, `seed`, `client_id`, `accuracy`).
      baseline: the algorithm every other one is compared with.

    Returns:
      One dict per (partition, algorithm other than the baseline): `differences` (every client of
      every seed the baseline also has) and their summary.

    Raises:
      ValueError: the baseline has no rows in a partition.
    """
    accuracy = {(r['partition'], r['algorithm'], r['seed'], r['client_id']): 100 * float(r['accuracy']) for r in rows}
    out = []
    for partition in dict.fromkeys(r['partition'] for r in rows):
        base = {k[2:]: v for k, v in accuracy.items() if k[0] == partition and k[1] == baseline}
        if not base:
            raise ValueError(f'{baseline!r} has no results in partition {partition!r}')
        worst = sorted(base, key=base.get)[: math.ceil(0.1 * len(base))]
        for algorithm in dict.fromkeys(r['algorithm'] for r in rows if r['partition'] == partition):
            if algorithm == baseline:
                continue
            mine = {k[2:]: v for k, v in accuracy.items() if k[0] == partition and k[1] == algorithm}
            common = [key for key in base if key in mine]
            if not common:
                continue
            differences = np.asarray([mine[key] - base[key] for key in common])
            out.append(
                collections.OrderedDict(
                    partition=partition,
                    algorithm=algorithm,
                    clients=len(common),
                    mean=float(differences.mean()),
                    median=float(np.median(differences)),
                    above=float(np.mean(differences > 0)),
                    equal=float(np.mean(differences == 0)),
                    below=float(np.mean(differences < 0)),
                    worst_10_of_baseline=statistics.fmean(mine[key] - base[key] for key in worst if key in mine),
                    differences=differences.tolist(),
                )
            )
    return out


def main(argv=None) -> None:
    """The command line (argparse: importing this module defines no absl flags)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--results', required=True, help="a suite's results.csv")
    parser.add_argument('--baseline', default='FedAvg', help='the algorithm (suite name) to compare with')
    parser.add_argument('--out', required=True, help='output path prefix (.md, .json, .png)')
    args = parser.parse_args(argv)
    with open(args.results, newline='') as f:
        rows = list(csv.DictReader(f))
    table = lift(rows, args.baseline)
    columns = ['partition', 'algorithm', 'clients', 'mean', 'median', 'above', 'equal', 'below', 'worst 10 %']
    shown = [
        {
            'partition': row['partition'],
            'algorithm': row['algorithm'],
            'clients': row['clients'],
            'mean': f'{row["mean"]:+.2f}',
            'median': f'{row["median"]:+.2f}',
            'above': f'{100 * row["above"]:.1f} %',
            'equal': f'{100 * row["equal"]:.1f} %',
            'below': f'{100 * row["below"]:.1f} %',
            'worst 10 %': f'{row["worst_10_of_baseline"]:+.2f}',
        }
        for row in table
    ]
    text = '\n'.join(
        [
            f'# Per-client accuracy against {args.baseline}',
            '',
            f'From `{args.results}`; command: `uv run --locked python benchmarks/client_lift.py '
            f'--results={args.results} --baseline={args.baseline} --out={args.out}`.',
            '',
            f"Each client's test accuracy minus {args.baseline}'s on the same client and seed, in percentage",
            f'points: mean and median over clients (and seeds); the share of clients above, equal to and below '
            f'{args.baseline}; worst 10 %: the mean difference on the 10 % of clients where {args.baseline} '
            'scores lowest.',
            '',
            reports.markdown_table(shown, columns),
            '',
            f'![differences]({args.out.rsplit("/", 1)[-1]}.png)',
            '',
        ]
    )
    reports.write_text_atomic(args.out + '.md', text)
    reports.write_text_atomic(args.out + '.json', json.dumps(table, indent=1) + '\n')
    series = collections.OrderedDict((f'{row["algorithm"]} ({row["partition"]})', row['differences']) for row in table)
    longest = max(len(v) for v in series.values())
    series = {k: v for k, v in series.items() if len(v) == longest}
    reports.plot_client_bars(
        [str(i) for i in range(longest)],
        series,
        args.out + '.png',
        f'test accuracy minus {args.baseline} on the same client (percentage points)',
        'difference (points)',
    )


if __name__ == '__main__':
    main()
