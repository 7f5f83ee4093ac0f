"""Seconds per round and driver memory as the number of clients grows, at 100 active clients per round.

Self-FL's MNIST setting (ds3: two digits per client, log-normal sizes, at
least 10 examples; logistic regression, batch 10, eta 0.03) with 250, 1000
and 4000 clients and activity rates 0.4, 0.1 and 0.025, so every round
trains 100 clients; Self-FL takes at most 40 local steps (they adapt to each
client's uncertainty, and ds3's client sizes depend on N). As a control with
the same work per client at every N, FedAvg takes 20 local steps on ds1
clients of exactly 15 examples (2 classes each). Then
PersFL with the MLP 784-100-10, 1000 clients, rate 0.1: two models of state
per client (its optimal teacher and its personalized model, 0.6 MB), run
with the client-state store on the heap, memory-mapped (the default above
`client_states.SPILL_BYTES`), and memory-mapped with the TFF worker on
glibc's default malloc arenas instead of `runtime.WORKER_MALLOC_ARENAS`.

Each run is `tff-pfl-train`'s code (`experiment.run_experiment`) in a
process of its own (with its own TFF worker); every client is evaluated
once, at the end. Seconds per round: median over rounds
2..R of the training round alone (sampling, `next`, storing the states).
Memory: the driver's anonymous resident memory (RssAnon: heap and other
private memory) and its file-backed resident pages (RssFile: mapped files,
which the kernel can drop and read again), and the worker's RSS, every 5
rounds and after the last one.

    uv run python benchmarks/scale_clients.py
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import process_memory  # benchmarks/, the script's own directory
from absl import app, flags

from tff_pfl import runtime
from tff_pfl.program import client_states, experiment, run_config

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_ROUNDS = flags.DEFINE_integer('rounds', 12, 'Training rounds per run.')
_ACTIVE = flags.DEFINE_integer('active', 100, 'Clients per round.')
_SIZES = flags.DEFINE_list('num_clients', ['250', '1000', '4000'], 'Total clients of the Self-FL setting.')
_PERSFL_ROUNDS = flags.DEFINE_integer('persfl_rounds', 40, 'Training rounds of the PersFL runs.')
_PERSFL_CLIENTS = flags.DEFINE_integer('persfl_clients', 1000, 'Total clients of the PersFL runs.')
_JOB = flags.DEFINE_integer('job', -1, 'Internal: run only this job and write its record into --workdir.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Internal: where a job writes its run and record.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/scale_clients', 'Result path prefix (.json, .md).')

SELFFL_SETTING = dict(partition='ds3', model='logistic', batch_size=10, client_learning_rate=0.03)
ALGORITHMS = {
    # Equal clients (15 examples, 2 classes each), so every client costs the same at every N.
    'fedavg': dict(algorithm='fedavg', local_steps=20, partition='ds1', classes_per_client=2, examples_per_client=15),
    'selffl': dict(algorithm='selffl', selffl_max_steps=40, selffl_default_steps=20),
}
PERSFL = dict(
    algorithm='persfl',
    partition='ds1',
    classes_per_client=4,
    model='mnist_dnn',
    batch_size=32,
    client_learning_rate=0.05,
    temperatures=(1.0,),
    imitations=(0.5,),
    distill_epochs=1,
)


class _RecordingStore(client_states.ClientStateStore):
    """The run's store, kept for its size."""

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _RecordingStore.last = self


def _run(name, num_clients, settings, workdir, rounds):
    samples = {}

    def log(line):
        match = re.match(r'round (\d+)/(\d+)', line)
        if match and (int(match.group(1)) % 5 == 0 or int(match.group(1)) in (1, int(match.group(2)) - 1)):
            samples[int(match.group(1))] = process_memory.driver_and_worker_mb()
        if match and match.group(1) == match.group(2):
            samples['after_last_round'] = process_memory.driver_and_worker_mb()
        if match:
            print(f'{name} N={num_clients}: {line}', flush=True)

    config = run_config.make_config(
        output_dir=os.path.join(workdir, f'{name}_{num_clients}'),
        dataset=f'npz:{_MNIST.value}',
        num_clients=num_clients,
        client_fraction=_ACTIVE.value / num_clients,
        rounds=rounds,
        eval_every=0,
        checkpoint_every=0,
        seed=0,
        **settings,
    )
    start = time.monotonic()
    result = experiment.run_experiment(config, overwrite=True, log=log)
    total = time.monotonic() - start
    rounds = result.rounds
    store = _RecordingStore.last
    anon, mapped, worker = samples['after_last_round']
    record = dict(
        name=name,
        num_clients=num_clients,
        client_fraction=config.schedule.client_fraction,
        active=round(config.schedule.client_fraction * num_clients),
        seconds_per_round=statistics.median(r['round_seconds'] for r in rounds[1:]),
        round_seconds=[round(r['round_seconds'], 4) for r in rounds],
        total_seconds=total,
        store_mb=store.nbytes / 2**20,
        store_spilled=store.spilled,
        driver_anon_mb=anon,
        driver_file_mb=mapped,
        worker_mb=worker,
        # Training rounds only (the last round adds personalization and evaluation of every client).
        worker_mb_round_1=samples[1][2],
        worker_mb_round_before_last=samples[len(rounds) - 1][2],
        driver_anon_mb_round_1=samples[1][0],
        driver_anon_mb_round_before_last=samples[len(rounds) - 1][0],
        memory_by_round=[
            dict(round=k, driver_anon_mb=v[0], driver_file_mb=v[1], worker_mb=v[2])
            for k, v in sorted((k, v) for k, v in samples.items() if isinstance(k, int))
        ],
        worker_malloc_arenas=runtime.WORKER_MALLOC_ARENAS,
        accuracy={model: summary['weighted_mean'] for model, summary in result.summary.items()},
    )
    if 'mean_local_steps' in rounds[-1]:
        record['local_steps_mean'] = statistics.mean(r['mean_local_steps'] for r in rounds)
    print(json.dumps({k: v for k, v in record.items() if k != 'round_seconds'}), flush=True)
    return record


def _jobs():
    """(name, num_clients, settings, rounds, spill_bytes, malloc_arenas) of every run, in order."""
    spill, arenas = client_states.SPILL_BYTES, runtime.WORKER_MALLOC_ARENAS
    jobs = [
        (name, n, dict(SELFFL_SETTING, **settings), _ROUNDS.value, spill, arenas)
        for n in map(int, _SIZES.value)
        for name, settings in ALGORITHMS.items()
    ]
    jobs += [
        ('persfl, store on the heap', _PERSFL_CLIENTS.value, PERSFL, _PERSFL_ROUNDS.value, 2**62, arenas),
        ('persfl, store memory-mapped', _PERSFL_CLIENTS.value, PERSFL, _PERSFL_ROUNDS.value, spill, arenas),
        (
            "persfl, store memory-mapped, worker with glibc's default arenas",
            _PERSFL_CLIENTS.value,
            PERSFL,
            _PERSFL_ROUNDS.value,
            spill,
            None,
        ),
    ]
    return jobs


def main(argv):
    del argv
    if _JOB.value >= 0:  # one run, in a fresh process, so that runs do not share the driver's memory
        name, num_clients, settings, rounds, spill, arenas = _jobs()[_JOB.value]
        client_states.ClientStateStore = _RecordingStore
        client_states.SPILL_BYTES, runtime.WORKER_MALLOC_ARENAS = spill, arenas
        record = _run(name, num_clients, settings, _WORKDIR.value, rounds)
        with open(os.path.join(_WORKDIR.value, f'record_{_JOB.value}.json'), 'w') as f:
            json.dump(record, f)
        return
    records = []
    with tempfile.TemporaryDirectory(dir='.') as workdir:
        for index in range(len(_jobs())):
            settings = [
                flags.FLAGS[holder.name].serialize()
                for holder in (_MNIST, _ROUNDS, _ACTIVE, _SIZES, _PERSFL_ROUNDS, _PERSFL_CLIENTS)
            ]
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), f'--job={index}', f'--workdir={workdir}', *settings],
                check=True,
            )
            with open(os.path.join(workdir, f'record_{index}.json')) as f:
                records.append(json.load(f))
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(
            {
                'rounds': _ROUNDS.value,
                'persfl_rounds': _PERSFL_ROUNDS.value,
                'active': _ACTIVE.value,
                'selffl_setting': SELFFL_SETTING,
                'algorithms': ALGORITHMS,
                'persfl': PERSFL,
                'records': records,
            },
            f,
            indent=1,
        )
    lines = [
        '# Scale: seconds per round and driver memory against the number of clients',
        '',
        f'`uv run python benchmarks/scale_clients.py`: {_ACTIVE.value} clients per round; FedAvg and Self-FL '
        f'{_ROUNDS.value} rounds, PersFL {_PERSFL_ROUNDS.value}; each run in a process of its own. Self-FL in its '
        'MNIST setting: ds3 (log-normal sizes, at least 10 examples), logistic regression, batch 10, eta 0.03, at '
        'most 40 local steps. FedAvg, the control with equal work per client at every N: 20 local steps on ds1 '
        'clients of exactly 15 examples, same model and rates. '
        f'PersFL: ds1 (4 classes), MLP 784-100-10, {_PERSFL_CLIENTS.value} clients. s/round: median over rounds '
        '2..R of the training round alone. Memory after the last round: driver RssAnon (heap) and RssFile '
        '(mapped files, which the kernel can drop), TFF worker RSS.',
        '',
        '| run | clients | rate | s/round | store MB | store | driver RssAnon MB | driver RssFile MB | worker MB | '
        'mean local steps | weighted test accuracy %: global / personalized | total s |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for r in records:
        steps = f'{r["local_steps_mean"]:.1f}' if 'local_steps_mean' in r else ''
        lines.append(
            f'| {r["name"]} | {r["num_clients"]} | {r["client_fraction"]:.3g} | {r["seconds_per_round"]:.3f} | '
            f'{r["store_mb"]:.0f} | {"mapped" if r["store_spilled"] else "heap"} | {r["driver_anon_mb"]:.0f} | '
            f'{r["driver_file_mb"]:.0f} | {r["worker_mb"]:.0f} | {steps} | '
            f'{" / ".join(f"{100 * a:.1f}" for a in r["accuracy"].values())} | '
            f'{r["total_seconds"]:.0f} |'
        )
    persfl = [r for r in records if r['name'].startswith('persfl')]
    lines += [
        '',
        f'Memory over the PersFL runs ({_PERSFL_ROUNDS.value} rounds; the last sample includes '
        'personalization and evaluation of every client), MB:',
        '',
        '| round | ' + ' | '.join(f'{r["name"]}: driver RssAnon / worker' for r in persfl) + ' |',
        '|---|' + '---|' * len(persfl),
    ]
    for i, sample in enumerate(persfl[0]['memory_by_round']):
        cells = [
            f'{r["memory_by_round"][i]["driver_anon_mb"]:.0f} / {r["memory_by_round"][i]["worker_mb"]:.0f}'
            for r in persfl
        ]
        lines.append(f'| {sample["round"]} | ' + ' | '.join(cells) + ' |')
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
