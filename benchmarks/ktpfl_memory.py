"""Peak memory of the TFF worker in homogeneous KT-pFL rounds, against the number of clients.

Homogeneous KT-pFL (`ktpfl_homo`) brings every sampled client's parameters to
the server, which mixes them with the coefficient matrix. This measures the
worker's peak resident set (the highest RSS sampled every 0.2 s) over a few
rounds of the training binary's code (`experiment.run_experiment`) in the
setting of `benchmarks/suites/ktpfl_fmnist_table2.toml`: Fashion-MNIST,
non-IID case 1, the CNN of McMahan et al. (`fedavg_cnn`, D = 1,663,370
parameters), one local SGD step per round (memory does not depend on it).

Each measurement runs in a fresh process. `--baseline_tree` names another
checkout of the project (e.g. `git worktree add /tmp/base <commit>`); its code
is measured in the same invocation, case by case, alternating with this
tree's, so both sides see the same machine load. `--current_cases` are
measured on this tree only (cases the baseline cannot run in this machine's
memory).

    uv run --locked python benchmarks/ktpfl_memory.py --baseline_tree=/tmp/base \
        --cases=20:1.0,40:0.25 --current_cases=100:0.1
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading

import process_memory  # benchmarks/, the script's own directory
import psutil
from absl import app, flags

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DATA = flags.DEFINE_string(
    'fashion_mnist', os.path.join(_HERE, '..', 'shared', 'data', 'fashion_mnist.npz'), 'Keras-layout Fashion-MNIST.'
)
_CASES = flags.DEFINE_list('cases', ['20:1.0', '40:0.25'], 'N:client_fraction cases measured on both trees.')
_CURRENT = flags.DEFINE_list('current_cases', ['100:0.1'], 'N:client_fraction cases measured on this tree only.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Rounds per measurement.')
_BASELINE = flags.DEFINE_string('baseline_tree', None, 'Another checkout of the project to measure side by side.')
_BASELINE_LABEL = flags.DEFINE_string('baseline_label', 'baseline', 'What the baseline tree is (for the report).')
_CURRENT_LABEL = flags.DEFINE_string('current_label', 'current', 'What this tree is (for the report).')
_CHILD = flags.DEFINE_string('child', None, 'Internal: measure one N:client_fraction case and print JSON.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/ktpfl_memory', 'Result path prefix (.json, .md).')


def _measure(case: str) -> dict:
    """Runs `ktpfl_homo` for `--rounds` rounds in this process and returns the worker's peak RSS."""
    from processes import ktpfl
    from tff_pfl.program import experiment, run_config

    num_clients, fraction = case.split(':')
    peak, stop = [0.0], threading.Event()

    def sample():
        while not stop.wait(0.2):
            try:
                worker_mb = process_memory.driver_and_worker_mb()[2]
            except psutil.Error:  # a child ended while it was read
                continue
            if worker_mb == worker_mb:  # NaN before the worker starts
                peak[0] = max(peak[0], worker_mb)

    seconds = []

    def log(line):
        if line.startswith('round '):
            seconds.append(float(line.rsplit('s  ETA', 1)[0].rsplit(' ', 1)[-1]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        config = run_config.make_config(
            output_dir=os.path.join(tmp, 'run'),
            algorithm='ktpfl_homo',
            dataset=f'npz:{os.path.abspath(_DATA.value)}',
            partition='kt_case1',
            num_clients=int(num_clients),
            kt_case1_counts=(90, 30) if int(num_clients) > 20 else (450, 150),
            client_fraction=float(fraction),
            model='fedavg_cnn',
            split_fractions=(0.74, 0.01, 0.25),
            batch_size=32,
            local_steps=1,
            rounds=_ROUNDS.value,
            eval_every=_ROUNDS.value,
        )
        experiment.run_experiment(config, log=log)
    stop.set()
    sampler.join()
    return {
        'num_clients': int(num_clients),
        'client_fraction': float(fraction),
        'clients_per_round': max(1, round(int(num_clients) * float(fraction))),
        'worker_peak_mb': round(peak[0]),
        'seconds_per_round_median': sorted(seconds)[len(seconds) // 2] if seconds else None,
        'code': os.path.dirname(os.path.dirname(os.path.abspath(ktpfl.__file__))),
    }


def _in_fresh_process(tree: str, case: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f'--child={case}']
        + [f'--rounds={_ROUNDS.value}', f'--fashion_mnist={os.path.abspath(_DATA.value)}'],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ['(no output)'])[-1]
        return {'case': case, 'failed': f'exit {out.returncode}: {tail}'}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    if _CHILD.value:
        print(json.dumps(_measure(_CHILD.value)), flush=True)
        return
    sides = {_CURRENT_LABEL.value: _HERE}
    if _BASELINE.value:
        sides[_BASELINE_LABEL.value] = os.path.abspath(_BASELINE.value)
    rows = []
    for case in _CASES.value:
        for side, tree in sides.items():
            rows.append(dict(side=side, **_in_fresh_process(tree, case)))
            print(rows[-1], flush=True)
    for case in _CURRENT.value:
        rows.append(dict(side=_CURRENT_LABEL.value, **_in_fresh_process(_HERE, case)))
        print(rows[-1], flush=True)
    with open(_OUT.value + '.json', 'w') as f:
        json.dump({'rounds': _ROUNDS.value, 'rows': rows}, f, indent=2)
    command = 'uv run --locked python benchmarks/ktpfl_memory.py ' + shlex.join(sys.argv[1:])
    lines = [
        '# Homogeneous KT-pFL: peak worker memory against the number of clients',
        '',
        f'`{command}`: `ktpfl_homo` on Fashion-MNIST (non-IID case 1), `fedavg_cnn` (D = 1,663,370), '
        f'{_ROUNDS.value} rounds of one local step, each case in a fresh process; peak resident set of the TFF '
        'worker, sampled every 0.2 s. Sides are measured alternately, case by case.',
        '',
        '| side | N | clients per round | worker peak (MB) | s per round (median) |',
        '|---|---|---|---|---|',
    ]
    for r in rows:
        if 'failed' in r:
            lines.append(f'| {r["side"]} | {r["case"]} | | failed: {r["failed"]} | |')
        else:
            lines.append(
                f'| {r["side"]} | {r["num_clients"]} | {r["clients_per_round"]} | {r["worker_peak_mb"]} | '
                f'{r["seconds_per_round_median"]} |'
            )
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
