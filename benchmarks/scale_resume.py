"""kill -9 and resume at cross-device scale: `tff-pfl-train` with 100,000 clients, killed and run again.

Three runs of the training binary (`python -m tff_pfl.cli.train`), with the
same flags: the learnable shared population of the scale benchmark
(`--data=shared`, `benchmarks/shared_population.py`: Synthetic(0,0) with
heterogeneity 0.1, 6 examples per client, read as `--dataset=clients:DIR`;
written once into `--population_dir`, reused if there), logistic regression,
100 clients per round, Self-FL by default (its per-client state makes the
incremental checkpoints' chain of segments matter; smoothing weight 1, so
that its global model learns at this activity rate and in 60 rounds), a checkpoint every
`--checkpoint_every` rounds and a sampled evaluation of `--eval_clients`
clients every `--eval_every` rounds. `--data=synthetic`: Synthetic(1,1)
instead, as the first version of this check.

1. uninterrupted, in its own output directory;
2. killed: its whole process group (the driver and its TFF worker) gets
   SIGKILL as soon as it prints round `--kill_after`, between two checkpoints,
   so that the rounds after the newest checkpoint are lost;
3. resumed: the same command again, on the killed run's output directory.

Reported: whether the resumed run's `metrics.csv` and `clients.csv` equal the
uninterrupted run's (timing columns aside), the final numbers of both (the
last round's mean test accuracy over every client, global and personalized
model), the round it resumed after, how long the resume took to reach its
first new round, and the checkpoint files left on disk.

    uv run --locked python benchmarks/scale_resume.py --workdir=/tmp/scale_work \
        --population_dir=/tmp/scale_work/populations
"""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import shared_population  # benchmarks/, the script's own directory
from absl import app, flags

_CLIENTS = flags.DEFINE_integer('num_clients', 100000, 'Population.')
_ACTIVE = flags.DEFINE_integer('active', 100, 'Clients per round.')
_ALGORITHM = flags.DEFINE_enum('algorithm', 'selffl', ['fedavg', 'selffl'], 'Algorithm.')
_ROUNDS = flags.DEFINE_integer('rounds', 60, 'Training rounds.')
_CHECKPOINT_EVERY = flags.DEFINE_integer('checkpoint_every', 10, 'Rounds between checkpoints.')
_KILL_AFTER = flags.DEFINE_integer('kill_after', 35, 'SIGKILL once this round is printed.')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 30, 'Rounds between sampled evaluations.')
_EVAL_CLIENTS = flags.DEFINE_integer('eval_clients', 500, 'Clients of a sampled evaluation.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where runs go (default: a temporary directory here).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/scale_resume', 'Result path prefix (.json, .md).')
_REPORT_ONLY = flags.DEFINE_bool('report_only', False, 'Run nothing: write --out.md again from --out.json.')
_DATA = flags.DEFINE_enum(
    'data', 'shared', ['shared', 'synthetic'], 'shared: benchmarks/shared_population.py; synthetic: Synthetic(1,1).'
)
_HETEROGENEITY = flags.DEFINE_float('heterogeneity', 0.1, '--data=shared: h of the population.')
_POPULATION_DIR = flags.DEFINE_string(
    'population_dir',
    os.path.join(tempfile.gettempdir(), 'tff_pfl_scale_populations'),
    '--data=shared: where the population is written once (shared with scale_population.py).',
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {'round_seconds', 'personalize_seconds'}
ALGORITHM_FLAGS = {
    'fedavg': ['--local_steps=20'],
    # Smoothing 1: the paper's C = 100 / N (1e-3 here) hardly moves the global model, and 0.1 learns
    # too slowly for this population in 60 rounds (docs/algorithms/selffl.md).
    'selffl': ['--selffl_max_steps=40', '--selffl_default_steps=20', '--selffl_smoothing=1'],
}
FINAL_COLUMNS = ('eval_clients', 'test_global_model_accuracy_mean', 'test_personalized_model_accuracy_mean')
_ROUND_LINE = re.compile(r'round (\d+)/(\d+)')


def _population():
    return shared_population.root(_POPULATION_DIR.value, _HETEROGENEITY.value, _CLIENTS.value)


def _data_flags():
    if _DATA.value == 'synthetic':
        return ['--dataset=synthetic']
    return [f'--dataset={shared_population.dataset(_population())}', '--partition=natural']


def _command(out):
    return [
        sys.executable,
        '-m',
        'tff_pfl.cli.train',
        f'--algorithm={_ALGORITHM.value}',
        *_data_flags(),
        '--model=logistic',
        f'--num_clients={_CLIENTS.value}',
        f'--client_fraction={_ACTIVE.value / _CLIENTS.value}',
        '--batch_size=10',
        '--client_learning_rate=0.03',
        f'--rounds={_ROUNDS.value}',
        f'--eval_every={_EVAL_EVERY.value}',
        f'--eval_clients={_EVAL_CLIENTS.value}',
        f'--checkpoint_every={_CHECKPOINT_EVERY.value}',
        '--seed=0',
        f'--output_dir={out}',
        *ALGORITHM_FLAGS[_ALGORITHM.value],
    ]


def _run(name, out, kill_after=None):
    """Runs the binary, echoing its round lines; with `kill_after`, SIGKILLs its process group at that round."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED='1', TF_CPP_MIN_LOG_LEVEL='3')
    start = time.monotonic()
    process = subprocess.Popen(
        _command(out),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    record, lines = dict(name=name), []
    for line in process.stdout:
        lines.append(line.rstrip())
        now = time.monotonic() - start
        if line.startswith('resuming after'):
            record['resumed_after'] = int(re.search(r'after round (\d+)', line).group(1))
            record['resume_message_seconds'] = now
        match = _ROUND_LINE.match(line)
        if not match:
            continue
        done = int(match.group(1))
        record.setdefault('first_round', done)
        record.setdefault('first_round_seconds', now)
        if done % 10 == 0:
            print(f'{name}: {line.rstrip()}', flush=True)
        if kill_after is not None and done == kill_after:
            os.killpg(process.pid, signal.SIGKILL)  # the driver and, through PR_SET_PDEATHSIG, its TFF worker
            record['killed_at_round'] = done
            break
    process.wait()
    record['seconds'] = time.monotonic() - start
    record['returncode'] = process.returncode
    if kill_after is None and process.returncode != 0:
        raise SystemExit(f'{name}: exit {process.returncode}\n' + '\n'.join(lines[-20:]))
    if kill_after is not None and process.returncode != -signal.SIGKILL:
        raise SystemExit(f'{name}: ended with {process.returncode} before round {kill_after}')
    return record


def _rows(path):
    with open(path, newline='') as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _compare(a, b):
    result = {}
    for name in ('metrics.csv', 'clients.csv'):
        rows_a, rows_b = _rows(os.path.join(a, name)), _rows(os.path.join(b, name))
        differing = sum(x != y for x, y in zip(rows_a, rows_b)) + abs(len(rows_a) - len(rows_b))
        result[name] = dict(rows=len(rows_a), resumed_rows=len(rows_b), differing_rows=differing)
    return result


def _final(out):
    """The last round's numbers that are not timings: its evaluation of every client."""
    with open(os.path.join(out, 'metrics.csv'), newline='') as f:
        last = list(csv.DictReader(f))[-1]
    return {k: float(last[k]) for k in FINAL_COLUMNS if last.get(k)}


def _checkpoint_files(out):
    directory = os.path.join(out, 'checkpoints')
    return [(n, os.path.getsize(os.path.join(directory, n))) for n in sorted(os.listdir(directory))]


def _first_line(final):
    """Whether the run's models learned (final mean test accuracy above 25 %; chance 10 %), and why not."""
    accuracy = {m: final.get(f'test_{m}_model_accuracy_mean') for m in ('global', 'personalized')}
    cells = ', '.join(f'{m} model {100 * v:.1f} %' for m, v in accuracy.items() if v is not None)
    if all(v is None or v >= 0.25 for v in accuracy.values()):
        return f'The run learns: final mean test accuracy over every client {cells} (chance 10 %).'
    why = ''
    if _ALGORITHM.value == 'selffl':
        why = (
            ": Self-FL's global model did not learn in "
            f'{_ROUNDS.value} rounds (scale_population_shared.md: 59-62 % after 100 rounds with smoothing weight 1, '
            'about 15 % with 0.1), and a client that never took part (most of them: '
            f'{_ROUNDS.value * _ACTIVE.value:,} participations for {_CLIENTS.value:,} clients) is scored with it. '
            'What this check tests, that the resumed run ends with the same numbers, does not depend on it'
        )
    return f'**Not learned** (final mean test accuracy over every client {cells}; chance 10 %){why}.'


def _report(record):
    flags_line = ' '.join(
        flags.FLAGS[h.name].serialize()
        for h in (_CLIENTS, _ACTIVE, _ALGORITHM, _ROUNDS, _CHECKPOINT_EVERY, _KILL_AFTER, _EVAL_EVERY, _EVAL_CLIENTS)
        + ((_DATA, _HETEROGENEITY, _POPULATION_DIR) if _DATA.value == 'shared' else (_DATA,))
    )
    data = (
        'Synthetic(1,1)'
        if _DATA.value == 'synthetic'
        else f'the shared population (`benchmarks/shared_population.py`: {shared_population.DESCRIPTION}, '
        f'h = {_HETEROGENEITY.value:g})'
    )
    extra = ' '.join(ALGORITHM_FLAGS[_ALGORITHM.value])
    runs = {r['name']: r for r in record['runs']}
    same = all(c['differing_rows'] == 0 and c['rows'] == c['resumed_rows'] for c in record['compare'].values())
    final = record['final']
    same = same and final['uninterrupted'] == final['resumed']
    lines = [
        _first_line(final['uninterrupted']),
        '',
        f'# kill -9 and resume with {_CLIENTS.value:,} clients',
        '',
        f'`uv run --locked python benchmarks/scale_resume.py {flags_line}`',
        '',
        f'`tff-pfl-train --algorithm={_ALGORITHM.value} {extra}` on {data}, logistic regression, '
        f'{_CLIENTS.value:,} clients, {_ACTIVE.value} per round, {_ROUNDS.value} rounds, a checkpoint every '
        f'{_CHECKPOINT_EVERY.value} rounds, a sampled evaluation of {_EVAL_CLIENTS.value} clients every '
        f'{_EVAL_EVERY.value} rounds and every client evaluated after the last. The killed run got SIGKILL (its '
        f'process group: the driver and its TFF worker) when it printed round {_KILL_AFTER.value}. Run on a 2-core '
        'machine shared with other work: the seconds are indicative.',
        '',
        '| run | seconds | first round printed at | resumed after round | exit |',
        '|---|---|---|---|---|',
    ]
    for r in record['runs']:
        lines.append(
            f'| {r["name"]} | {r["seconds"]:.0f} | {r.get("first_round_seconds", 0):.0f} s (round '
            f'{r.get("first_round", "-")}) | {r.get("resumed_after", "-")} | {r["returncode"]} |'
        )
    lines += ['', '| final round, every client | uninterrupted | killed, then resumed |', '|---|---|---|']
    for column in FINAL_COLUMNS:
        cells = [final[run].get(column) for run in ('uninterrupted', 'resumed')]
        text = ['-' if v is None else f'{v:.0f}' if column == 'eval_clients' else f'{100 * v:.2f} %' for v in cells]
        lines.append(f'| {column} | {text[0]} | {text[1]} |')
    lines += ['', '| file | rows (uninterrupted) | rows (killed, then resumed) | rows that differ |']
    lines.append('|---|---|---|---|')
    for name, c in record['compare'].items():
        lines.append(f'| {name} | {c["rows"]} | {c["resumed_rows"]} | {c["differing_rows"]} |')
    lines += [
        '',
        "Result: the resumed run's final numbers, `metrics.csv` and `clients.csv` "
        f"{'equal' if same else 'DIFFER FROM'} the uninterrupted run's, timing columns (`round_seconds`, "
        '`personalize_seconds`) aside. '
        f'The resume redid rounds {runs["resumed"]["resumed_after"] + 1}..{_KILL_AFTER.value}, lost with the kill.',
        '',
        'Checkpoint files left by the resumed run (bytes): '
        + ', '.join(f'`{n}` {size:,}' for n, size in record['checkpoint_files']),
    ]
    return lines, same


def main(argv):
    del argv
    if _REPORT_ONLY.value:
        with open(_OUT.value + '.json') as f:
            lines, _ = _report(json.load(f))
        with open(_OUT.value + '.md', 'w') as f:
            f.write('\n'.join(lines) + '\n')
        return
    if not 0 < _KILL_AFTER.value < _ROUNDS.value or _KILL_AFTER.value % _CHECKPOINT_EVERY.value == 0:
        raise app.UsageError('--kill_after must fall strictly between two checkpoints and before the last round')
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    if _DATA.value == 'shared':  # once, before the runs (their setup then converts its npz files)
        shared_population.write(_population(), _CLIENTS.value, _HETEROGENEITY.value)
    workdir = tempfile.mkdtemp(dir=_WORKDIR.value or '.', prefix='scale_resume_')
    try:
        whole, killed = os.path.join(workdir, 'uninterrupted'), os.path.join(workdir, 'killed')
        runs = [_run('uninterrupted', whole)]
        runs.append(_run('killed', killed, kill_after=_KILL_AFTER.value))
        if os.path.exists(os.path.join(killed, 'report.md')):
            raise SystemExit('the killed run finished before it was killed; nothing was tested')
        runs.append(_run('resumed', killed))
        record = dict(
            runs=runs,
            compare=_compare(whole, killed),
            final=dict(uninterrupted=_final(whole), resumed=_final(killed)),
            checkpoint_files=_checkpoint_files(killed),
            dataset=_data_flags()[0].partition('=')[2],
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lines, same = _report(record)
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(record, f, indent=1)
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    if not same:
        raise SystemExit(1)


if __name__ == '__main__':
    app.run(main)
