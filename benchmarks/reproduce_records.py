"""Do the committed benchmark records still reproduce? One suite entry per algorithm family, rerun.

Each entry (suite, partition, algorithm label, seed) is run by `tff-pfl-bench`
into a scratch directory (never into benchmarks/results), and its per-client
test accuracies are compared with the committed record
`benchmarks/results/<suite>_suite/records/<partition>/<algorithm>/seed<k>.json`:
how many clients are bit-for-bit identical, the largest difference, and both
means. The machine, CPU and package versions are recorded beside them.

    uv run --locked python benchmarks/reproduce_records.py --scratch=/tmp/reproduce \
      --output=benchmarks/results/reproduce_records

The default entries take about 45 minutes on a 2-core machine; `--entries`
picks a subset by index (`--list` prints them).

Bit-for-bit equality holds on one machine, not across CPUs: TensorFlow's
oneDNN kernels are chosen by instruction set (AVX2, AVX-512), and their
summation order moves the weights in the last bits after the first rounds,
which moves a few test predictions per client by round 100 (seen: the record
of `persfl_fmnist` ds1 FedAvg, made on another CPU, differs here on 8 of 10
clients by 1-5 test examples, while the commit that wrote it and today's give
identical numbers on this machine, and `ONEDNN_MAX_CPU_ISA=AVX` a third set).
To show that a change keeps the numbers, run the entries at the commit
before it and after it on the same machine, and compare them with `--against`.
"""

import json
import os
import platform
import subprocess
import sys

from absl import app, flags

from tff_pfl_bench import bench_suite

_SCRATCH = flags.DEFINE_string('scratch', '/tmp/reproduce_records', 'Where the reruns go (created).')
_OUTPUT = flags.DEFINE_string('output', None, 'Write <output>.json and <output>.md (default: print only).')
_ENTRIES = flags.DEFINE_list('entries', None, 'Indices into the entry list (default: all).')
_LIST = flags.DEFINE_bool('list', False, 'Print the entries and exit.')
_AGAINST = flags.DEFINE_string(
    'against',
    None,
    'Also compare with the same entries run into this directory by another checkout (e.g. the commit before a '
    'change, on this machine): bit-for-bit equality there shows the change kept the numbers.',
)
_DESCRIBE = flags.DEFINE_string(
    'describe', '', 'A sentence for the report: what the reruns and the --against runs were run at (commits).'
)
_COMPARE_ONLY = flags.DEFINE_bool(
    'compare_only', False, 'Run nothing: compare the records already in --scratch (from an earlier run of this script).'
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (family, suite, partition label, algorithm labels): one or more entries per algorithm family.
ENTRIES = [
    ('FedAvg and its fine-tuning, local', 'persfl_fmnist', 'ds1', ['FedAvg', 'FedAvg+FT', 'Local']),
    ('PersFL', 'persfl_fmnist', 'ds1', ['PersFL']),
    ('FedPer, pFedMe, Per-FedAvg', 'persfl_fmnist', 'ds1', ['FedPer', 'pFedMe', 'Per-FedAvg']),
    ('Ditto, APFL, Per-FedAvg HF', 'baselines_mnist', 'ds1', ['Ditto', 'APFL', 'Per-FedAvg HF']),
    ('KD-PDFL (three modes)', 'kdpdfl_fmnist', 'M10', ['KD-PDFL', 'FedAvg plus', 'Local learning']),
    ('DP and secure sums', 'dp_fmnist', 'dirichlet', ['FedAvg eps=8 secure']),
    ('Self-FL', 'selffl_fedprox', 'mnist', ['Self-FL']),
    ('KT-pFL, FedDF', 'ktpfl_fmnist_table1', 'case2', ['KT-pFL', 'FedDF']),
]
SEED = 0


# A record converted from a results.csv (`converted_from`) holds accuracies to 6 decimals: equal
# within half a unit of the sixth is as identical as it can show.
CONVERTED_ROUNDING = 5e-7


def _clients(path: str) -> tuple[dict, float, bool]:
    with open(path) as f:
        record = json.load(f)
    accuracies = {c['client_id']: float(c['accuracy']) for c in record['clients']}
    return accuracies, record['summary'][record['model']]['mean'], bool(record.get('converted_from'))


def compare(committed_path: str, rerun_path: str) -> dict:
    """Per-client comparison of two bench records of the same run."""
    old, old_mean, converted = _clients(committed_path)
    new, new_mean, _ = _clients(rerun_path)
    if set(old) != set(new):
        raise ValueError(f'{rerun_path}: other clients than {committed_path}')
    diffs = [abs(old[c] - new[c]) for c in old]
    tolerance = CONVERTED_ROUNDING if converted else 0.0
    return dict(
        clients=len(diffs),
        identical=sum(d <= tolerance for d in diffs),
        converted=converted,
        max_abs_diff=max(diffs),
        committed_mean=old_mean,
        rerun_mean=new_mean,
    )


def _cpu() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv):
    del argv
    chosen = range(len(ENTRIES)) if _ENTRIES.value is None else [int(i) for i in _ENTRIES.value]
    if _LIST.value:
        for i, entry in enumerate(ENTRIES):
            print(i, entry)
        return
    rows = []
    for i in chosen:
        family, suite, partition, labels = ENTRIES[i]
        out = os.path.join(_SCRATCH.value, suite)
        command = [
            sys.executable,
            '-m',
            'tff_pfl_bench.cli',
            f'--suite=benchmarks/suites/{suite}.toml',
            f'--output_dir={out}',
            f'--seeds={SEED}',
            f'--partitions={partition}',
            f'--algorithms={",".join(labels)}',
        ]
        if not _COMPARE_ONLY.value:
            print(' '.join(command), flush=True)
            subprocess.run(command, cwd=REPO, check=True)
        for label in labels:
            part, algo = bench_suite.slug(partition), bench_suite.slug(label)
            committed = os.path.join(REPO, 'benchmarks', 'results', f'{suite}_suite', 'records', part, algo)
            rerun = os.path.join(out, 'runs', part, algo, f'seed{SEED}', 'bench_result.json')
            if not os.path.exists(rerun):
                print(f'{suite} {partition} {label}: no rerun record in {rerun}, left out', flush=True)
                continue
            row = dict(family=family, suite=suite, partition=partition, algorithm=label)
            row.update(compare(os.path.join(committed, f'seed{SEED}.json'), rerun))
            if _AGAINST.value:
                other = os.path.join(_AGAINST.value, suite, 'runs', part, algo, f'seed{SEED}', 'bench_result.json')
                if os.path.exists(other):  # an entry the other checkout did not run stays blank
                    against = compare(other, rerun)
                    row.update(against_identical=against['identical'], against_max_abs_diff=against['max_abs_diff'])
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = dict(machine=dict(cpu=_cpu(), python=platform.python_version(), tensorflow=_version('tensorflow')))
    result['rows'] = rows
    result['against'] = _AGAINST.value
    result['describe'] = _DESCRIBE.value
    if _OUTPUT.value:
        with open(_OUTPUT.value + '.json', 'w') as f:
            json.dump(result, f, indent=1)
        with open(_OUTPUT.value + '.md', 'w') as f:
            f.write(render(result))
    print(render(result))


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


def render(result: dict) -> str:
    lines = [
        '# Committed records rerun',
        '',
        f'Machine: {result["machine"]["cpu"]}, Python {result["machine"]["python"]}, '
        f'TensorFlow {result["machine"]["tensorflow"]}. Seed {SEED}; per-client test accuracy of the '
        "record's model against the committed record (`benchmarks/reproduce_records.py`).",
        '',
    ]
    if result.get('describe'):
        lines += [result['describe'], '']
    lines += [
        '| family | suite | partition | algorithm | clients identical | max abs diff | committed mean | rerun mean |'
        + (' identical to the other checkout | max abs diff there |' if result.get('against') else ''),
        '|---|---|---|---|---|---|---|---|' + ('---|---|' if result.get('against') else ''),
    ]
    for r in result['rows']:
        rounded = ' (record to 6 decimals)' if r['converted'] else ''
        line = (
            f'| {r["family"]} | {r["suite"]} | {r["partition"]} | {r["algorithm"]}{rounded} '
            f'| {r["identical"]}/{r["clients"]} '
            f'| {r["max_abs_diff"]:.2e} | {100 * r["committed_mean"]:.2f} | {100 * r["rerun_mean"]:.2f} |'
        )
        if result.get('against') and 'against_identical' in r:
            line += f' {r["against_identical"]}/{r["clients"]} | {r["against_max_abs_diff"]:.2e} |'
        elif result.get('against'):
            line += ' not run | |'
        lines.append(line)
    return '\n'.join(lines) + '\n'


if __name__ == '__main__':
    app.run(main)
