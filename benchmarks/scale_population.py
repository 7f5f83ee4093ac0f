"""Cross-device scale: setup, seconds per round, memory and checkpoints from 1,000 to 100,000 clients.

Synthetic(1,1) (FedProx's generator: log-normal client sizes, 60 features,
10 classes), logistic regression, 100 clients per round (activity rate
100 / N), batch 10, eta 0.03, 20 local steps (Self-FL: at most 40, adapted
to each client's uncertainty); FedAvg, Self-FL and PersFL (stage 2: one
candidate, T = 1, lambda = 0.5, one epoch). Each run is `tff-pfl-train`'s
code (`experiment.run_experiment`) in a process of its own, with a
checkpoint every `--checkpoint_every` rounds and a seeded sample of
`--eval_clients` clients evaluated every `--eval_every` rounds.

Measured per run:
- setup: from the start of the run to the start of round 1 (data
  generation, partition, client files, the process, the client-state store);
- s/round: median over rounds 2..R of the training round alone;
- memory every 20 rounds: the driver's RssAnon (heap) and RssFile (mapped
  files, which the kernel can drop), the TFF worker's RSS;
- every checkpoint: seconds, bytes written, clients stored;
- the final stage (personalization and evaluation of every client). With
  `--final_clients=M`, the last round personalizes and evaluates only the
  first M clients, and the report gives the seconds per client (the stage is
  per-client work: it grows with N by construction).

With `--data=mnist` or `--data=fashion_mnist` the population is that file
split by the FedProx power-law generator (`ds3`) instead.

    uv run python benchmarks/scale_population.py
    uv run python benchmarks/scale_population.py --data=mnist --num_clients=10000 \
        --out=benchmarks/results/scale_population_ds3
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import process_memory  # benchmarks/, the script's own directory
from absl import app, flags

from tff_pfl.program import checkpoints, experiment, training_loop

_ROUNDS = flags.DEFINE_integer('rounds', 200, 'Training rounds per run.')
_ACTIVE = flags.DEFINE_integer('active', 100, 'Clients per round.')
_SIZES = flags.DEFINE_list('num_clients', ['1000', '100000'], 'Populations.')
_ALGORITHMS = flags.DEFINE_list('algorithms', ['fedavg', 'selffl', 'persfl'], 'Algorithms.')
_CHECKPOINT_EVERY = flags.DEFINE_integer('checkpoint_every', 20, 'Rounds between checkpoints.')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 50, 'Rounds between sampled evaluations.')
_EVAL_CLIENTS = flags.DEFINE_integer('eval_clients', 500, 'Clients of a sampled evaluation.')
_FINAL_CLIENTS = flags.DEFINE_integer('final_clients', 0, 'Clients of the final stage (0: every client).')
_JOB = flags.DEFINE_integer('job', -1, 'Internal: run only this job and write its record into --workdir.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where runs go (default: a temporary directory here).')
_APPEND = flags.DEFINE_bool('append', False, 'Add the records to those already in --out.json.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/scale_population', 'Result path prefix (.json, .md).')
_DATA = flags.DEFINE_enum(
    'data',
    'synthetic',
    ['synthetic', 'mnist', 'fashion_mnist', 'small_iid'],
    'synthetic: Synthetic(1,1) generated per client; mnist, fashion_mnist: the Keras-layout file in --data_dir '
    'split by the FedProx power-law generator (ds3, two classes per client, 2 base examples per class); '
    'small_iid: SMALL_IID_EXAMPLES Gaussian examples per client, labelled by one random linear model, split iid '
    '(a population whose data fit on disk at 1,000,000 clients).',
)
_DATA_DIR = flags.DEFINE_string('data_dir', '../shared/data', 'Folder of mnist.npz and fashion_mnist.npz.')

COMMON = dict(model='logistic', batch_size=10, client_learning_rate=0.03)
DATA_NAMES = {
    'synthetic': 'Synthetic(1,1)',
    'mnist': 'MNIST split by the FedProx power-law generator (ds3, 2 base examples per class)',
    'fashion_mnist': 'Fashion-MNIST split by the FedProx power-law generator (ds3, 2 base examples per class)',
    'small_iid': 'small_iid (6 Gaussian examples per client: 4 train, 1 validation, 1 test)',
}
SMALL_IID_EXAMPLES = 6


def _write_small_iid(path, num_clients):
    """`SMALL_IID_EXAMPLES` examples per client: 60 N(0, 1) features, labels argmax(x W) for one random W."""
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(60, 10)).astype(np.float32)
    arrays = {}
    for split, count in (('train', num_clients * (SMALL_IID_EXAMPLES - 1)), ('test', num_clients)):
        x = rng.normal(size=(count, 60)).astype(np.float32)
        arrays[f'x_{split}'], arrays[f'y_{split}'] = x, np.argmax(x @ weights, axis=1).astype(np.int32)
    np.savez(path, **arrays)


def _data_settings(num_clients=None, workdir=None):
    if _DATA.value == 'synthetic':
        return dict(dataset='synthetic')
    if _DATA.value == 'small_iid':
        if workdir is None:
            return dict(dataset='npz:small_iid_N.npz', partition='iid')
        path = os.path.join(workdir, f'small_iid_{num_clients}.npz')
        if not os.path.exists(path):
            _write_small_iid(path, num_clients)
        return dict(dataset=f'npz:{path}', partition='iid')
    path = os.path.join(_DATA_DIR.value, f'{_DATA.value}.npz')
    return dict(dataset=f'npz:{path}', partition='ds3', classes_per_client=2, base_examples_per_class=2)


ALGORITHMS = {
    'fedavg': dict(algorithm='fedavg', local_steps=20),
    'selffl': dict(algorithm='selffl', selffl_max_steps=40, selffl_default_steps=20),
    'persfl': dict(algorithm='persfl', local_steps=20, temperatures=(1.0,), imitations=(0.5,), distill_epochs=1),
}


class _RecordingStore(training_loop.ClientStateStore):
    """The run's store: kept for its size; the final stage limited to `final_clients` and timed."""

    last = None
    final_clients = 0
    final = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _RecordingStore.last = self

    def _final_ids(self):
        return self.ids()[: self.final_clients] if self.final_clients else self.ids()

    def personalize(self, process, state):
        ids, start = self._final_ids(), time.monotonic()
        super().personalize(process, state, ids)
        _RecordingStore.final['personalize_seconds'] = time.monotonic() - start
        _RecordingStore.final['personalized_clients'] = len(ids)

    def evaluate(self, process, state, client_ids=None):
        if client_ids is not None:  # a sampled evaluation before the last round
            return super().evaluate(process, state, client_ids)
        ids, start = self._final_ids(), time.monotonic()
        results = super().evaluate(process, state, ids)
        _RecordingStore.final['evaluate_seconds'] = time.monotonic() - start
        _RecordingStore.final['evaluated_clients'] = len(ids)
        return results  # the run's clients.csv then lists the first M clients


def _run(name, num_clients, workdir):
    samples, saves, marks = {}, [], {}
    save = checkpoints.RunCheckpoints.save

    def timed_save(self, round_num, *args, **kwargs):
        before = set(os.listdir(self.directory)) if os.path.isdir(self.directory) else set()
        start = time.monotonic()
        save(self, round_num, *args, **kwargs)
        seconds = time.monotonic() - start
        written = set(os.listdir(self.directory)) - before | {f'round_{round_num}.npz', f'clients_{round_num}.npz'}
        size = sum(
            os.path.getsize(os.path.join(self.directory, n))
            for n in written
            if os.path.exists(os.path.join(self.directory, n))
        )
        on_disk = sum(os.path.getsize(os.path.join(self.directory, n)) for n in os.listdir(self.directory))
        saves.append(
            dict(
                round=round_num,
                seconds=seconds,
                bytes=size,
                dir_bytes=on_disk,
                stored_clients=_RecordingStore.last.num_stored,
                full=args[2].complete,
            )
        )

    checkpoints.RunCheckpoints.save = timed_save

    def log(line):
        match = re.match(r'round (\d+)/(\d+)', line)
        if match:
            done, total = int(match.group(1)), int(match.group(2))
            if done == 1:
                marks['after_round_1'] = time.monotonic()
            if done % 20 == 0 or done in (1, total - 1):
                samples[done] = process_memory.driver_and_worker_mb()
            if done % 20 == 0 or done == total:
                print(f'{name} N={num_clients}: {line}', flush=True)

    config = experiment.make_config(
        output_dir=os.path.join(workdir, f'{name}_{num_clients}'),
        num_clients=num_clients,
        client_fraction=_ACTIVE.value / num_clients,
        rounds=_ROUNDS.value,
        eval_every=_EVAL_EVERY.value,
        eval_clients=_EVAL_CLIENTS.value,
        checkpoint_every=_CHECKPOINT_EVERY.value,
        seed=0,
        **_data_settings(num_clients, workdir),
        **COMMON,
        **ALGORITHMS[name],
    )
    start = time.monotonic()
    result = experiment.run_experiment(config, overwrite=True, log=log)
    total = time.monotonic() - start
    rounds = result.rounds
    setup = marks['after_round_1'] - start - rounds[0]['round_seconds']
    store = _RecordingStore.last
    record = dict(
        name=name,
        data=_DATA.value,
        num_clients=num_clients,
        active=_ACTIVE.value,
        setup_seconds=setup,
        seconds_per_round=statistics.median(r['round_seconds'] for r in rounds[1:]),
        round_seconds=[round(r['round_seconds'], 4) for r in rounds],
        total_seconds=total,
        stored_clients=store.num_stored,
        store_mb=store.nbytes / 2**20,
        store_spilled=store.spilled,
        memory_by_round=[
            dict(round=k, driver_anon_mb=v[0], driver_file_mb=v[1], worker_mb=v[2]) for k, v in sorted(samples.items())
        ],
        checkpoints=saves,
        final=dict(_RecordingStore.final),
        sampled_accuracy=[
            dict(
                round=r['round'],
                mean=r['test_global_model_accuracy_mean'],
                ci95=r.get('test_global_model_accuracy_mean_ci95'),
                clients=r['eval_clients'],
            )
            for r in rounds[:-1]
            if 'eval_clients' in r
        ],
    )
    print(json.dumps({k: v for k, v in record.items() if k not in ('round_seconds', 'checkpoints')}), flush=True)
    return record


def _jobs():
    return [(name, int(n)) for n in _SIZES.value for name in _ALGORITHMS.value]


def _flag_args():
    holders = (_ROUNDS, _ACTIVE, _SIZES, _ALGORITHMS, _CHECKPOINT_EVERY, _EVAL_EVERY, _EVAL_CLIENTS, _FINAL_CLIENTS)
    holders += (_DATA, _DATA_DIR) if _DATA.value != 'synthetic' else ()
    return [flags.FLAGS[h.name].serialize() for h in holders]


def _report(records):
    lines = [
        '# Cross-device scale: setup, seconds per round, memory and checkpoints against the population',
        '',
        '`uv run python benchmarks/scale_population.py '
        + ' '.join(_flag_args())
        + '`'
        + ('; these rows added to the earlier ones (--append)' if _APPEND.value else ''),
        '',
        '; '.join(dict.fromkeys(DATA_NAMES[r.get('data', 'synthetic')] for r in records))
        + f'; logistic regression, {_ACTIVE.value} clients per round, {_ROUNDS.value} rounds, batch 10, '
        'eta 0.03, 20 local steps (Self-FL: adaptive, at most 40); PersFL stage 2 with one candidate (T 1, lambda '
        f'0.5, one epoch). A checkpoint every {_CHECKPOINT_EVERY.value} rounds; a sampled evaluation of '
        f'{_EVAL_CLIENTS.value} clients every {_EVAL_EVERY.value} rounds. Each run in a process of its own, beside '
        'other work on a 2-core machine: compare rows of one table, not across tables.',
        '',
        '| data | algorithm | clients | setup s | s/round | stored clients | store MB '
        '| driver RssAnon MB: round 20 / last | driver RssFile MB (last) | worker MB: round 20 / last '
        '| final stage s per client | total s |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for r in records:
        memory = {m['round']: m for m in r['memory_by_round']}
        first = memory.get(20, r['memory_by_round'][0])
        last = r['memory_by_round'][-1]
        final = r['final']
        clients = final.get('evaluated_clients', r['num_clients'])
        per_client = (final.get('personalize_seconds', 0) + final.get('evaluate_seconds', 0)) / max(clients, 1)
        lines.append(
            f'| {r.get("data", "synthetic")} | {r["name"]} | {r["num_clients"]} | {r["setup_seconds"]:.1f} | '
            f'{r["seconds_per_round"]:.3f} | '
            f'{r["stored_clients"]} | {r["store_mb"]:.1f} | '
            f'{first["driver_anon_mb"]:.0f} / {last["driver_anon_mb"]:.0f} | '
            f'{last["driver_file_mb"]:.0f} | {first["worker_mb"]:.0f} / {last["worker_mb"]:.0f} | '
            f'{1000 * per_client:.2f} ms ({clients} clients) | {r["total_seconds"]:.0f} |'
        )
    lines += [
        '',
        'Checkpoints (seconds, bytes written, stored clients; F: a full segment):',
        '',
        '| algorithm | clients | ' + ' | '.join(f'round {c["round"]}' for c in records[0]['checkpoints']) + ' |',
        '|---|---|' + '---|' * len(records[0]['checkpoints']),
    ]
    for r in records:
        cells = [
            f'{c["seconds"]:.2f} s, {c["bytes"] / 2**20:.2f} MB, {c["stored_clients"]}{" F" if c["full"] else ""}'
            for c in r['checkpoints']
        ]
        lines.append(f'| {r.get("data", "synthetic")} {r["name"]} | {r["num_clients"]} | ' + ' | '.join(cells) + ' |')
    lines += [
        '',
        'Sampled evaluations (mean test accuracy of the global model +- the 95 % interval, clients scored) and '
        'the final evaluation of every client:',
        '',
    ]
    for r in records:
        cells = [
            f'round {s["round"]}: {100 * s["mean"]:.1f} +- {100 * (s["ci95"] or 0):.1f} ({s["clients"]})'
            for s in r['sampled_accuracy']
        ]
        lines.append(f'- {r.get("data", "synthetic")} {r["name"]}, {r["num_clients"]} clients: ' + '; '.join(cells))
    return lines


def main(argv):
    del argv
    if _JOB.value >= 0:  # one run, in a fresh process, so that runs do not share the driver's memory
        name, num_clients = _jobs()[_JOB.value]
        training_loop.ClientStateStore = _RecordingStore
        _RecordingStore.final_clients = _FINAL_CLIENTS.value
        record = _run(name, num_clients, _WORKDIR.value)
        with open(os.path.join(_WORKDIR.value, f'record_{_JOB.value}.json'), 'w') as f:
            json.dump(record, f)
        return
    records = []
    if _APPEND.value and os.path.exists(_OUT.value + '.json'):
        with open(_OUT.value + '.json') as f:
            records = json.load(f)['records']
    with tempfile.TemporaryDirectory(dir=_WORKDIR.value or '.') as workdir:
        for index in range(len(_jobs())):
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), f'--job={index}', f'--workdir={workdir}', *_flag_args()],
                check=True,
            )
            with open(os.path.join(workdir, f'record_{index}.json')) as f:
                records.append(json.load(f))
            with open(_OUT.value + '.json', 'w') as f:
                common = dict(COMMON, **_data_settings())
                json.dump({'common': common, 'algorithms': ALGORITHMS, 'records': records}, f, indent=1)
            lines = _report(records)
            with open(_OUT.value + '.md', 'w') as f:
                f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
