"""Every registered algorithm through tff-pfl-train: its defaults, MNIST DS-1, a model the data cannot feed.

For each algorithm, three invocations of the training binary (its own
interpreter, as a user runs it):

- defaults: `--algorithm=X` and nothing else but `--rounds` (the default 100
  rounds of twenty algorithms exceed a benchmark's time; `--rounds=100`
  gives the literal defaults) and `--output_dir`;
- MNIST DS-1: the same on `../shared/data/mnist.npz`, `--partition=ds1`
  (with `--mnist_extra` flags: KT-pFL, FedDF and pFedDF with one local epoch
  instead of the paper's 20, for time);
- mismatch: a convolutional model (`--model=persfl_cnn`, or
  `--architectures=lenet` where clients have their own architectures) on the
  default vector data.

Recorded per invocation: exit code, lines on stderr, what is left in the
output directory, seconds. Expected: exit 0 with a report.md, or exit 2 with
one line and nothing written.

    uv run --locked python benchmarks/settings_sweep.py --rounds=2
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from tff_pfl.program import algorithms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, 'benchmarks', 'results')

_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Rounds of the defaults and MNIST runs.')
_MNIST = flags.DEFINE_string('mnist', os.path.join(REPO, '..', 'shared', 'data', 'mnist.npz'), 'MNIST .npz.')
_TIMEOUT = flags.DEFINE_integer('timeout', 1800, 'Seconds before one invocation is stopped.')
_ONLY = flags.DEFINE_list('algorithms', [], 'Only these algorithms (default: all).')
_MNIST_EXTRA = flags.DEFINE_list(
    'mnist_extra',
    ['ktpfl:--local_epochs=1', 'feddf:--local_epochs=1', 'pfeddf:--local_epochs=1'],
    "algorithm:--flag pairs added to the MNIST run only (the papers' 20 local epochs of four CNNs on 30 MNIST "
    'clients take about half an hour a round on 2 cores).',
)


def _cases(algorithm, rounds, mnist):
    extra = [pair.split(':', 1)[1] for pair in _MNIST_EXTRA.value if pair.split(':', 1)[0] == algorithm]
    mismatch = '--architectures=lenet' if algorithms.get(algorithm).own_architectures else '--model=persfl_cnn'
    return {
        'defaults': [f'--rounds={rounds}'],
        'mnist_ds1': [f'--rounds={rounds}', f'--dataset=npz:{mnist}', '--partition=ds1', *extra],
        'mismatch': [mismatch],
    }


def _run(algorithm, args, out):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    command = [sys.executable, '-m', 'tff_pfl.cli.train', f'--algorithm={algorithm}', *args, f'--output_dir={out}']
    start = time.time()
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=_TIMEOUT.value, cwd=REPO)
        code, stderr = result.returncode, result.stderr
    except subprocess.TimeoutExpired as e:
        code, stderr = 'timeout', (e.stderr or b'').decode() if isinstance(e.stderr, bytes) else (e.stderr or '')
    seconds = time.time() - start
    left = sorted(os.listdir(out)) if os.path.isdir(out) else []
    return {
        'exit': code,
        'stderr_lines': len(stderr.strip().splitlines()),
        'stderr_last': stderr.strip().splitlines()[-1] if stderr.strip() else '',
        'files_left': len(left),
        'report': 'report.md' in left,
        'seconds': round(seconds, 1),
    }


def main(argv):
    del argv
    names = _ONLY.value or algorithms.names()
    path = os.path.join(RESULTS, 'settings_sweep.json')
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)['results']
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in names:
            for case, args in _cases(algorithm, _ROUNDS.value, _MNIST.value).items():
                row = _run(algorithm, args, os.path.join(tmp, f'{algorithm}-{case}'))
                results.setdefault(algorithm, {})[case] = row
                print(algorithm, case, row, flush=True)
                with open(path, 'w') as f:
                    json.dump({'rounds': _ROUNDS.value, 'results': results}, f, indent=1)
    _write_markdown(results)


def _cell(row):
    if row is None:
        return 'not run'
    report = ', report.md' if row['report'] else ''
    return (
        f'exit {row["exit"]}, {row["stderr_lines"]} line(s), {row["files_left"]} file(s) left{report}, '
        f'{row["seconds"]:.0f} s'
    )


def _write_markdown(results):
    lines = [
        '# Every algorithm through tff-pfl-train: defaults, MNIST DS-1, a mismatched model',
        '',
        f'`uv run --locked python benchmarks/settings_sweep.py --rounds={_ROUNDS.value}` (its docstring says what each '
        f'column runs; MNIST runs also took {" ".join(_MNIST_EXTRA.value) or "no extra flag"}). '
        'Expected: exit 0 with report.md, or exit 2 with one line on stderr and nothing written. '
        'Seconds include the interpreter start and, for runs, partitioning, tracing and the final evaluation; '
        'the machine (2 cores) was shared with other work.',
        '',
        '| algorithm | defaults | MNIST DS-1 | mismatched model |',
        '|---|---|---|---|',
    ]
    for algorithm in sorted(results):
        cases = results[algorithm]
        lines.append(
            f'| {algorithm} | {_cell(cases.get("defaults"))} | {_cell(cases.get("mnist_ds1"))} | '
            f'{_cell(cases.get("mismatch"))} |'
        )
    errors = {a: c['mismatch']['stderr_last'] for a, c in sorted(results.items()) if 'mismatch' in c}
    lines += ['', '## The one line of each refusal', '']
    lines += [f'- {a}: `{line}`' for a, line in errors.items()]
    with open(os.path.join(RESULTS, 'settings_sweep.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
    app.run(main)
