"""FedAvg rounds of two checkouts of the project, side by side, each in fresh processes.

A change to the round is measured against the code before it. Each measurement is a
fresh process that imports the project from one checkout (run with that checkout's
own uv environment), writes the MNIST clients, starts its own local worker, and
times blocks of 10 FedAvg rounds; for the MLP it times the plain-TF floor
(`fedavg_speed.build_floor`) in the same process between the blocks. The checkouts
alternate, `--pairs` times, so that the machine's drift falls on both.

On these machines a worker process's rounds are either all fast or all slow
(benchmarks/results/fedavg_overhead.md): the table lists every process, and the
summary gives each side's median and its fast and slow processes apart.

    git worktree add /tmp/before <commit>   # then `uv sync --locked` in it
    uv run python benchmarks/round_ab.py --before=/tmp/before --after=. --pairs=6

`--examples=60` (36 training examples a client, two SGD steps) isolates what a
round costs beyond SGD; `--model=fedavg_cnn` times the CNN (no floor).
`--after_rounds_per_call=5` runs the after side's rounds five to a TFF call
(`PersonalizedProcess.several_rounds`); with `--before=. --after=.` it measures
several rounds a call against one, on the same code.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_BEFORE = flags.DEFINE_string('before', None, 'Checkout of the code before the change.')
_AFTER = flags.DEFINE_string('after', '.', 'Checkout of the code after the change.')
_PAIRS = flags.DEFINE_integer('pairs', 6, 'Processes per side, alternating.')
_BLOCKS = flags.DEFINE_integer('blocks', 6, 'Blocks of 10 rounds per process.')
_CLIENTS = flags.DEFINE_integer('clients', 10, 'Clients a round (every client, every round).')
_EXAMPLES = flags.DEFINE_integer('examples', 6000, 'Examples a client holds (60 % of them for training).')
_MODEL = flags.DEFINE_string('model', 'mnist_dnn', 'mnist_dnn (with the floor) or fedavg_cnn.')
_MNIST = flags.DEFINE_string('mnist_npz', '../shared/data/mnist.npz', 'MNIST in Keras npz layout.')
_OUT = flags.DEFINE_string('results', None, 'Result path prefix (.json, .md); none: print only.')
_BEFORE_K = flags.DEFINE_integer('before_rounds_per_call', 1, 'Rounds a TFF call on the before side (divides 10).')
_AFTER_K = flags.DEFINE_integer('after_rounds_per_call', 1, 'Rounds a TFF call on the after side (divides 10).')
_K = flags.DEFINE_integer('rounds_per_call', 1, "Internal: the child's rounds a call.")
_CHILD = flags.DEFINE_string('child', None, 'Internal: measure with the project of this checkout.')
_RENDER = flags.DEFINE_string('render', None, 'Only rewrite the .md of this result .json.')

# A process whose rounds take more than this many times the floor ran in the slow mode.
SLOW_RATIO = 1.6


def _measure(tree):
    """One process's medians over its blocks: round wall s, driver CPU s, worker CPU s, floor wall s."""
    sys.path[:0] = [tree, os.path.join(tree, 'benchmarks')]
    import functools

    import fedavg_speed
    import psutil
    import tensorflow as tf

    from processes import fedavg
    from tff_pfl import models, runtime
    from tff_pfl.data import client_data, client_data_writer, partition, sources

    pool = sources.load_npz(_MNIST.value)
    members = partition.iid(pool.y, _CLIENTS.value, seed=0, examples_per_client=_EXAMPLES.value)
    splits = [partition.split_client(c, pool.y, (0.6, 0.2, 0.2), seed=i) for i, c in enumerate(members)]
    with tempfile.TemporaryDirectory(prefix='round_ab.') as workdir:
        spec = client_data_writer.write_client_data(os.path.join(workdir, 'data'), pool.x, pool.y, 10, splits)
        model_fn = functools.partial(getattr(models, _MODEL.value), spec.feature_shape, 10)
        settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=32, client_learning_rate=0.1)
        process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=0)
        floor = None
        if _MODEL.value == 'mnist_dnn':
            floor = fedavg_speed.build_floor([client_data.read_split_numpy(spec, c, 'train') for c in spec.client_ids])
            weights = [tf.constant(w) for w in fedavg_speed.floor_start_weights()]
        blocks = []
        with runtime.local_runtime(max_concurrent_computation_calls=2) as rt:
            worker = psutil.Process(rt.pid)
            state = process.initialize()
            client_states = [process.initial_client_state(c) for c in spec.client_ids]
            for r in range(3):
                out = process.next(state, client_states)
                state, client_states = out.state, out.client_states
                if floor is not None:
                    weights = floor(weights, tf.constant(r))
            count = _K.value
            several = process.several_rounds(count) if count > 1 else None
            if several is not None:  # its first call builds and warms it
                out = several(state, client_states)
                state, client_states = out.state, out.client_states
            for _ in range(_BLOCKS.value):
                floor_seconds = 0.0
                if floor is not None:
                    t0 = time.perf_counter()
                    for r in range(10):
                        weights = floor(weights, tf.constant(r))
                        weights[0].numpy()
                    floor_seconds = (time.perf_counter() - t0) / 10
                one_a_call = 0.0
                if several is not None:  # the same process's rounds one a call, as a reference
                    t0 = time.perf_counter()
                    for _ in range(10):
                        out = process.next(state, client_states)
                        state, client_states = out.state, out.client_states
                    one_a_call = (time.perf_counter() - t0) / 10
                cpu = worker.cpu_times()
                w0, d0, t0 = cpu.user + cpu.system, time.process_time(), time.perf_counter()
                for _ in range(10 // count):
                    out = (several or process.next)(state, client_states)
                    state, client_states = out.state, out.client_states
                cpu = worker.cpu_times()
                w1, d1, t1 = cpu.user + cpu.system, time.process_time(), time.perf_counter()
                blocks.append(((t1 - t0) / 10, (d1 - d0) / 10, (w1 - w0) / 10, floor_seconds, one_a_call))
    keys = ('round', 'driver_cpu', 'worker_cpu', 'floor', 'one_a_call')
    return {k: statistics.median(b[i] for b in blocks) for i, k in enumerate(keys)}


def _run_child(tree, rounds_per_call):
    command = [
        'uv', 'run', '--locked', 'python', os.path.abspath(__file__), f'--child={tree}',
        f'--rounds_per_call={rounds_per_call}',
        f'--blocks={_BLOCKS.value}', f'--clients={_CLIENTS.value}', f'--examples={_EXAMPLES.value}',
        f'--model={_MODEL.value}', f'--mnist_npz={os.path.abspath(_MNIST.value)}',
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith('MEASURED ')]
    if done.returncode or not lines:
        raise RuntimeError(f'the measurement in {tree} failed:\n{done.stderr[-2000:]}')
    return json.loads(lines[-1][len('MEASURED ') :])


def _commit(tree):
    command = ['git', 'rev-parse', '--short', 'HEAD']
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    return done.stdout.strip() or 'not a git checkout'


def _side_summary(rows):
    summary = {'processes': len(rows), 'round_median': statistics.median(r['round'] for r in rows)}
    if rows[0]['floor']:
        summary['ratio_median'] = statistics.median(r['ratio'] for r in rows)
        for mode, test in (('fast', lambda r: r['ratio'] <= SLOW_RATIO), ('slow', lambda r: r['ratio'] > SLOW_RATIO)):
            picked = [r for r in rows if test(r)]
            summary[f'{mode}_processes'] = len(picked)
            if picked:
                summary[f'{mode}_ratio_median'] = statistics.median(r['ratio'] for r in picked)
                summary[f'{mode}_round_median'] = statistics.median(r['round'] for r in picked)
    return summary


def _markdown(record):
    has_floor = record['rows'][0]['floor'] > 0
    # Rounds far above the floor by their workload (tiny clients) have no fast mode to tell apart.
    modes = has_floor and any(s.get('fast_processes') for s in record['summary'].values())
    lines = [
        '# FedAvg rounds, before and after a change, in fresh processes',
        '',
        f'`{record["command"]}`: {record["workload"]}; {record["machine"]}. Medians of blocks of 10 rounds; '
        'the sides alternate, one fresh process (and local worker) each.',
        '',
        '| # | side | round s | floor s | ratio | worker CPU s | driver CPU s |',
        '|---|---|---|---|---|---|---|',
    ]
    for i, r in enumerate(record['rows']):
        floor = f'{r["floor"]:.4f} | {r["ratio"]:.2f}' if has_floor else '- | -'
        lines.append(
            f'| {i + 1} | {r["side"]} | {r["round"]:.4f} | {floor} | {r["worker_cpu"]:.4f} | {r["driver_cpu"]:.4f} |'
        )
    header = '| side | processes | median round s |' + (' median ratio |' if has_floor else '')
    header += ' fast / slow processes |' if modes else ''
    lines += ['', header, '|---|---|---|' + ('---|' if has_floor else '') + ('---|' if modes else '')]
    calls = record.get('rounds_per_call', {'before': 1, 'after': 1})
    for side in ('before', 'after'):
        s = record['summary'][side]
        described = record['commits'][side] + (f', {calls[side]} rounds a call' if calls[side] > 1 else '')
        row = f'| {side} ({described}) | {s["processes"]} | {s["round_median"]:.4f} |'
        if has_floor:
            row += f' {s["ratio_median"]:.2f} |'
        if modes:
            row += f' {s["fast_processes"]} / {s["slow_processes"]} |'
        lines.append(row)
    if modes:
        lines += [
            '',
            f'A process is slow when its rounds take more than {SLOW_RATIO}x the floor; fast processes only:',
            '',
            '| side | median round s | median ratio |',
            '|---|---|---|',
        ]
        for side in ('before', 'after'):
            s = record['summary'][side]
            if s['fast_processes']:
                lines.append(f'| {side} | {s["fast_round_median"]:.4f} | {s["fast_ratio_median"]:.2f} |')
    paired = [(i, r) for i, r in enumerate(record['rows']) if r.get('one_a_call')]
    if paired:
        lines += [
            '',
            'Each process that ran several rounds a call also timed its rounds one a call, in the blocks between '
            '(the same worker process and memory):',
            '',
            '| # | side | one a call s | ratio | several a call s | ratio | change |',
            '|---|---|---|---|---|---|---|',
        ]
        for i, r in paired:
            ratios = [f'{t / r["floor"]:.2f}' if r['floor'] else '-' for t in (r['one_a_call'], r['round'])]
            lines.append(
                f'| {i + 1} | {r["side"]} | {r["one_a_call"]:.4f} | {ratios[0]} | {r["round"]:.4f} '
                f'| {ratios[1]} | {100 * (r["round"] / r["one_a_call"] - 1):+.1f} % |'
            )
        change = statistics.median(r['round'] / r['one_a_call'] - 1 for _, r in paired)
        lines += ['', f'Median change in the same process: {100 * change:+.1f} %.']
    return '\n'.join(lines) + '\n'


def main(argv):
    del argv
    if _CHILD.value:
        print('MEASURED ' + json.dumps(_measure(_CHILD.value)), flush=True)
        return
    if _RENDER.value:
        with open(_RENDER.value) as f:
            record = json.load(f)
        with open(_RENDER.value[: -len('.json')] + '.md', 'w') as f:
            f.write(_markdown(record))
        return
    if not _BEFORE.value:
        raise app.UsageError('--before: give the checkout of the code before the change')
    calls = {'before': _BEFORE_K.value, 'after': _AFTER_K.value}
    for side, count in calls.items():
        if count < 1 or 10 % count:
            raise app.UsageError(f'--{side}_rounds_per_call must divide 10 (a block), got {count}')
    trees = {'before': os.path.abspath(_BEFORE.value), 'after': os.path.abspath(_AFTER.value)}
    rows = []
    for i in range(_PAIRS.value):
        for side, tree in trees.items():
            row = dict(side=side, **_run_child(tree, calls[side]))
            row['ratio'] = row['round'] / row['floor'] if row['floor'] else None
            rows.append(row)
            print(f'{side} {i + 1}/{_PAIRS.value}: round {row["round"]:.4f} s, floor {row["floor"]:.4f} s', flush=True)
    commits = {side: _commit(tree) for side, tree in trees.items()}
    command = 'uv run python benchmarks/round_ab.py ' + ' '.join(sys.argv[1:])
    for side, given in (('before', _BEFORE.value), ('after', _AFTER.value)):
        command = command.replace(f'--{side}={given}', f'--{side}=<checkout of {commits[side]}>')
    record = {
        'command': command,
        'commits': commits,
        'rounds_per_call': calls,
        'workload': (
            f'FedAvg, {_MODEL.value}, {_CLIENTS.value} clients x {int(_EXAMPLES.value * 0.6)} MNIST training '
            'examples, batch 32, 1 epoch, 2 concurrent clients'
        ),
        'machine': f'{platform.machine()}, {os.cpu_count()} cores',
        'rows': rows,
        'summary': {side: _side_summary([r for r in rows if r['side'] == side]) for side in trees},
    }
    markdown = _markdown(record)
    print(markdown)
    if _OUT.value:
        with open(_OUT.value + '.json', 'w') as f:
            json.dump(record, f, indent=1)
        with open(_OUT.value + '.md', 'w') as f:
            f.write(markdown)


if __name__ == '__main__':
    app.run(main)
