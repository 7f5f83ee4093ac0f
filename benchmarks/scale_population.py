"""Cross-device scale: setup, seconds per round, memory, checkpoints and final accuracy, 1,000 to 1,000,000 clients.

Logistic regression, 100 clients per round (activity rate 100 / N), batch 10,
eta 0.03, 20 local steps (Self-FL: at most 40, adapted to each client's
uncertainty; smoothing weight 0.1, `selffl_paper` the paper's C, `selffl_w1`
1); FedAvg, Self-FL, PersFL (stage 2: one candidate, T = 1, lambda = 0.5, one
epoch) and Ditto (lambda 0.1, 20 steps for each model). Each run is
`tff-pfl-train`'s code (`experiment.run_experiment`) in a process of its own,
with a checkpoint every `--checkpoint_every` rounds and a seeded sample of
`--eval_clients` clients evaluated every `--eval_every` rounds.

Populations (`--data`):
- `shared` (the learnable cross-device population, `shared_population.py`):
  Synthetic(0,0) whose clients share 1 - h of one labelling model
  (`--heterogeneity` h, default 0.1), 6 examples per client (4 train, 1
  validation, 1 test); written once per population into `--population_dir`
  as a `clients:DIR` source (what the runs name as their dataset) and, in the
  same pass, through `client_data_writer.ClientDataWriter` as the run's client files,
  hard-linked into each run instead of converted again (the same bytes);
- `mnist`, `fashion_mnist`: that file split by the FedProx power-law
  generator (`ds3`, two classes per client, 2 base examples per class);
- `synthetic`: Synthetic(1,1) (every client labels with a model of its own:
  nothing can be learned; the first version of this benchmark);
- `small_iid`: 6 Gaussian examples per client, one labelling model, iid.

Measured per run:
- setup: from the start of the run to the start of round 1 (partition,
  client files, the process, the client-state store);
- s/round: median over rounds 2..R of the training round alone;
- memory every 20 rounds: the driver's RssAnon (heap) and RssFile (mapped
  files, which the kernel can drop), the TFF worker's RSS;
- every checkpoint: seconds, bytes written, clients stored;
- the final stage: personalization (PersFL) and evaluation of every client up
  to `--final_clients` (10,000), above that of a seeded sample of that many
  (`evaluation.evaluation_sample(seed, rounds, N, n)`); the mean test
  accuracy of the global and the personalized model over the scored clients
  with the half-width of the 95 % interval of the population's mean
  (`metrics.sample_mean_interval`, 0 when every client is scored), and the
  seconds per client (the stage is per-client work).

The results in benchmarks/results/ (run one at a time, from the repository root):

    C="--data=shared --rounds=100 --eval_every=50 --checkpoint_every=20 --workdir=/tmp/scale_work \\
       --population_dir=/tmp/scale_work/populations --out=benchmarks/results/scale_population_shared --append"
    uv run --locked python benchmarks/scale_population.py $C --num_clients=1000000 --algorithms=fedavg
    uv run --locked python benchmarks/scale_population.py $C --num_clients=1000,10000,100000 \\
        --algorithms=fedavg,selffl,persfl,ditto
    uv run --locked python benchmarks/scale_population.py $C --num_clients=1000000 \\
        --algorithms=selffl,persfl,ditto,selffl_paper
    uv run --locked python benchmarks/scale_population.py $C --num_clients=1000,10000,100000,1000000 \\
        --algorithms=selffl_w1
    uv run --locked python benchmarks/scale_population.py --data=mnist --data_dir=../shared/data \\
        --num_clients=10000 --algorithms=fedavg,selffl,selffl_w1,persfl,ditto --rounds=100 --eval_every=50 \\
        --checkpoint_every=20 --workdir=/tmp/scale_work --out=benchmarks/results/scale_population_mnist10k
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
import shared_population
from absl import app, flags

from tff_pfl import metrics
from tff_pfl.program import checkpoints, client_states, evaluation, experiment, run_config

_ROUNDS = flags.DEFINE_integer('rounds', 200, 'Training rounds per run.')
_ACTIVE = flags.DEFINE_integer('active', 100, 'Clients per round.')
_SIZES = flags.DEFINE_list('num_clients', ['1000', '100000'], 'Populations.')
_ALGORITHMS = flags.DEFINE_list('algorithms', ['fedavg', 'selffl', 'persfl', 'ditto'], 'Algorithms (ALGORITHMS).')
_CHECKPOINT_EVERY = flags.DEFINE_integer('checkpoint_every', 20, 'Rounds between checkpoints.')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 50, 'Rounds between sampled evaluations.')
_EVAL_CLIENTS = flags.DEFINE_integer('eval_clients', 500, 'Clients of a sampled evaluation.')
_FINAL_CLIENTS = flags.DEFINE_integer(
    'final_clients',
    10000,
    'The final stage personalizes and evaluates a seeded sample of this many clients when the population is '
    'larger (evaluation.evaluation_sample with the run seed and the last round); 0: every client.',
)
_JOB = flags.DEFINE_integer('job', -1, 'Internal: run only this job and write its record into --workdir.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where runs go (default: a temporary directory here).')
_APPEND = flags.DEFINE_bool('append', False, 'Add the records to those already in --out.json.')
_REPORT_ONLY = flags.DEFINE_bool('report_only', False, 'Run nothing: write --out.md again from --out.json.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/scale_population', 'Result path prefix (.json, .md).')
_DATA = flags.DEFINE_enum(
    'data',
    'synthetic',
    ['synthetic', 'shared', 'mnist', 'fashion_mnist', 'small_iid'],
    'synthetic: Synthetic(1,1) generated per client; shared: 6 examples per client of '
    'Synthetic(0,0) whose clients share 1 - --heterogeneity of one labelling model (a learnable cross-device '
    'population, written once per population in --population_dir and read as clients:DIR); mnist, '
    'fashion_mnist: the Keras-layout file in --data_dir split by the FedProx power-law generator (ds3, two '
    'classes per client, 2 base examples per class); small_iid: SMALL_IID_EXAMPLES Gaussian examples per client, '
    'labelled by one random linear model, split iid.',
)
_DATA_DIR = flags.DEFINE_string('data_dir', '../shared/data', 'Folder of mnist.npz and fashion_mnist.npz.')
_HETEROGENEITY = flags.DEFINE_float(
    'heterogeneity', 0.1, "--data=shared: h, the share of each client's labelling model that is its own."
)
_POPULATION_DIR = flags.DEFINE_string(
    'population_dir',
    os.path.join(tempfile.gettempdir(), 'tff_pfl_scale_populations'),
    '--data=shared: where each population is written once and kept for later runs.',
)

COMMON = dict(model='logistic', batch_size=10, client_learning_rate=0.03)
DATA_NAMES = {
    'synthetic': 'Synthetic(1,1)',
    'shared': 'shared: ' + shared_population.DESCRIPTION,
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


def _population_root(num_clients):
    """Where the --data=shared population of `num_clients` lives (`shared_population.write`)."""
    return shared_population.root(_POPULATION_DIR.value, _HETEROGENEITY.value, num_clients)


def _data_settings(num_clients=None, workdir=None):
    if _DATA.value == 'synthetic':
        return dict(dataset='synthetic')
    if _DATA.value == 'shared':
        return dict(dataset=shared_population.dataset(_population_root(num_clients or 'N')), partition='natural')
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
    # Self-FL's smoothing weight 0.1 in place of the paper's activity rate C = 100 / N (1e-4 at 1,000,000
    # clients, where its global model hardly moves: docs/algorithms/selffl.md); selffl_paper keeps C.
    'selffl': dict(algorithm='selffl', selffl_max_steps=40, selffl_default_steps=20, selffl_smoothing=0.1),
    'selffl_paper': dict(algorithm='selffl', selffl_max_steps=40, selffl_default_steps=20),
    # Smoothing weight 1: the global model is the round's precision-weighted estimate (what w = 0.1 slows down).
    'selffl_w1': dict(algorithm='selffl', selffl_max_steps=40, selffl_default_steps=20, selffl_smoothing=1.0),
    'persfl': dict(algorithm='persfl', local_steps=20, temperatures=(1.0,), imitations=(0.5,), distill_epochs=1),
    # Ditto: w and every personal model v_k take 20 steps a round; lambda its default (0.1).
    'ditto': dict(algorithm='ditto', local_steps=20),
}


class _RecordingStore(client_states.ClientStateStore):
    """The run's store: kept for its size; the final stage on a seeded sample of `final_clients`, timed and scored.

    Above `final_clients` clients the last round personalizes and evaluates the
    sample `evaluation.evaluation_sample(seed, rounds, N, final_clients)` (the
    run seed and the last round: the draw of the sampled evaluations, so the same
    clients for every algorithm of a population); up to it, every client. The
    mean test accuracy of each model over the scored clients is recorded with the
    half-width of its 95 % interval (`metrics.sample_mean_interval`: 0 when every
    client is scored, the mean is then the population's).
    """

    last = None
    final_clients = 0
    seed = 0
    final_round = 0
    final = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _RecordingStore.last = self

    def _final_ids(self):
        ids = self.ids()
        sample = evaluation.evaluation_sample(self.seed, self.final_round, len(ids), self.final_clients)
        return ids if sample is None else [ids[i] for i in sample]

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
        for model in [k for k, v in results[0].items() if isinstance(v, dict) and 'accuracy' in v]:
            accuracies = [float(r[model]['accuracy']) for r in results]
            _RecordingStore.final[model] = dict(
                mean=float(np.mean(accuracies)), ci95=metrics.sample_mean_interval(accuracies, len(self.ids()))
            )
        return results  # the run's clients.csv then lists the scored clients


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

    config = run_config.make_config(
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
        dataset=config.data.dataset,
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
        final_row={k: v for k, v in rounds[-1].items() if isinstance(v, (int, float))},
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
        warnings=list(result.warnings),  # the run's pre-run warnings and STALLED / DIVERGING findings
    )
    if _DATA.value == 'shared':
        record['population'] = shared_population.write(_population_root(num_clients), num_clients, _HETEROGENEITY.value)
    print(json.dumps({k: v for k, v in record.items() if k not in ('round_seconds', 'checkpoints')}), flush=True)
    return record


def _jobs():
    return [(name, int(n)) for n in _SIZES.value for name in _ALGORITHMS.value]


def _flag_args():
    holders = (_ROUNDS, _ACTIVE, _SIZES, _ALGORITHMS, _CHECKPOINT_EVERY, _EVAL_EVERY, _EVAL_CLIENTS, _FINAL_CLIENTS)
    holders += (_DATA,) if _DATA.value != 'synthetic' else ()
    holders += (_DATA_DIR,) if _DATA.value in ('mnist', 'fashion_mnist') else ()
    holders += (_HETEROGENEITY, _POPULATION_DIR) if _DATA.value == 'shared' else ()
    return [flags.FLAGS[h.name].serialize() for h in holders]


LEARNS_ABOVE = 0.25  # a final mean test accuracy below this (chance: 0.10) is named in the report's first line
WHY_NOT = {
    ('selffl_paper', 'global_model'): "Self-FL with the paper's smoothing weight C = {active} / N = {rate:g} moves "
    'its global model by C of the round estimate per round, so it stays near the initial model '
    '(docs/algorithms/selffl.md)',
    ('selffl_paper', 'personalized_model'): "Self-FL with the paper's C: a client that never took part is scored "
    'with the global model, which does not move',
    ('selffl', 'global_model'): "Self-FL's global model moves w = 0.1 of the way to the round's precision-weighted "
    'estimate per round (the smoothing average; FedAvg moves all the way), too slow for {rounds} rounds: with w = 1 '
    '(the selffl_w1 rows) the same clients make a global model that learns',
    ('selffl', 'personalized_model'): 'Self-FL scores a client that never took part ({active} clients a round '
    'reach at most {reached:,} of the {n:,}) with its global model, which does not learn (above)',
}


def _accuracy(final, model, num_clients):
    """`mean +- ci95` in percent; `(all)` when every client was scored (the population's mean, no interval)."""
    if model not in final:
        return '-'
    cell = f'{100 * final[model]["mean"]:.1f}'
    if final.get('evaluated_clients', num_clients) >= num_clients:
        return cell + ' (all)'
    return cell + f' +- {100 * final[model]["ci95"]:.1f}'


def _first_line(records):
    """What did not learn and why (a final mean accuracy below LEARNS_ABOVE), or that everything learned."""
    failures = {}
    for r in records:
        for model in ('global_model', 'personalized_model'):
            value = r['final'].get(model, {}).get('mean')
            if value is not None and value < LEARNS_ABOVE:
                failures.setdefault((r['name'], model), []).append((r['num_clients'], value))
    if not failures:
        above = f'{100 * LEARNS_ABOVE:.0f} %'
        return f'Every algorithm learns here: every final mean test accuracy is above {above} (chance: 10 %).'
    parts = []
    for (name, model), rows in failures.items():
        where = ', '.join(f'{100 * v:.1f} % at {n:,} clients' for n, v in rows)
        n = max(n for n, _ in rows)
        reached = min(n, _ROUNDS.value * _ACTIVE.value)
        why = WHY_NOT.get((name, model), 'not explained')
        why = why.format(active=_ACTIVE.value, reached=reached, n=n, rate=_ACTIVE.value / n, rounds=_ROUNDS.value)
        parts.append(f"{name}'s {model.replace('_', ' ')} ({where}): {why}")
    return (
        f'**Not learned** (final mean test accuracy below {100 * LEARNS_ABOVE:.0f} %; chance 10 %): '
        + '; '.join(parts)
        + '.'
    )


def _population_lines(records):
    """What writing the --data=shared populations took (once each, outside the runs' setup)."""
    written = {r['num_clients']: r['population'] for r in records if 'population' in r}
    if not written:
        return []
    cells = ', '.join(f'{n:,} clients {p["seconds"]:.0f} s' for n, p in sorted(written.items()))
    return [
        f'Each population was written once before its runs ({cells}: the clients:DIR npz files and, in the same '
        "pass, the client files `client_data_writer.ClientDataWriter` makes of them); a run's setup hard-links those "
        'client files (the bytes `pipeline.prepare` writes from clients:DIR, which costs about 1.3 ms per client: '
        '22 min at 1,000,000 clients).',
        '',
    ]


def _report(records):
    order = list(ALGORITHMS)
    records = sorted(records, key=lambda r: (r.get('data', 'synthetic'), r['num_clients'], order.index(r['name'])))
    lines = [
        _first_line(records),
        '',
        '# Cross-device scale: setup, seconds per round, memory, checkpoints and final accuracy against the population',
        '',
        '`uv run --locked python benchmarks/scale_population.py '
        + ' '.join(a for a in _flag_args() if not a.startswith(('--num_clients=', '--algorithms=')))
        + ' --num_clients=N --algorithms=A'
        + (' --append`' if _APPEND.value else '`')
        + ", one invocation per group of rows (the exact ones: the script's docstring); here N in "
        + ', '.join(f'{n:,}' for n in sorted({r['num_clients'] for r in records}))
        + ', A in '
        + ', '.join(n for n in ALGORITHMS if any(r['name'] == n for r in records))
        + '.',
        '',
        '; '.join(dict.fromkeys(DATA_NAMES[r.get('data', 'synthetic')] for r in records))
        + f'; logistic regression, {_ACTIVE.value} clients per round, {_ROUNDS.value} rounds, batch 10, '
        'eta 0.03, 20 local steps (Self-FL: adaptive, at most 40); PersFL stage 2 with one candidate (T 1, lambda '
        f'0.5, one epoch). A checkpoint every {_CHECKPOINT_EVERY.value} rounds; a sampled evaluation of '
        f'{_EVAL_CLIENTS.value} clients every {_EVAL_EVERY.value} rounds. Self-FL with smoothing weight 0.1 '
        "(selffl_paper: the paper's, the activity rate C; selffl_w1: 1); Ditto lambda 0.1, 20 steps for each "
        'model. The final '
        f'stage personalizes (PersFL) and evaluates every client up to {_FINAL_CLIENTS.value:,} clients, above that '
        f'a seeded sample of {_FINAL_CLIENTS.value:,} (the same clients for every algorithm of a population). Each run '
        'in a process of its own, beside other work on a 2-core machine: compare rows of one table, not across tables.',
        '',
        *_population_lines(records),
        "Final mean test accuracy over the scored clients, in %: `(all)`, every client scored (the population's "
        "mean); `+- x`, the half-width of the 95 % interval of the population's mean from the sample "
        "(`metrics.sample_mean_interval`). Personalized: the algorithm's per-client model (PersFL's stage 2, "
        "Self-FL's theta_m, Ditto's v_k); FedAvg has none.",
        '',
        '| data | algorithm | clients | setup s | s/round | stored clients | store MB '
        '| driver RssAnon MB: round 20 / last | driver RssFile MB (last) | worker MB: round 20 / last '
        '| global model % | personalized % | final stage ms per client (clients) | total s |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|',
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
            f'{_accuracy(final, "global_model", r["num_clients"])} | '
            f'{_accuracy(final, "personalized_model", r["num_clients"])} | '
            f'{1000 * per_client:.2f} ({clients}) | {r["total_seconds"]:.0f} |'
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
        'Sampled evaluations before the last round (mean test accuracy of the global model +- the 95 % interval, '
        'clients scored), then the final one (global / personalized):',
        '',
    ]
    for r in records:
        cells = [
            f'round {s["round"]}: {100 * s["mean"]:.1f} +- {100 * (s["ci95"] or 0):.1f} ({s["clients"]})'
            for s in r['sampled_accuracy']
        ]
        final = r['final']
        if 'global_model' in final:
            cells.append(
                f'round {_ROUNDS.value}: {_accuracy(final, "global_model", r["num_clients"])} / '
                f'{_accuracy(final, "personalized_model", r["num_clients"])} ({final["evaluated_clients"]})'
            )
        warned = '; '.join(r.get('warnings', []))  # recorded since the runs of 2026-11-28
        lines.append(
            f'- {r.get("data", "synthetic")} {r["name"]}, {r["num_clients"]} clients: '
            + '; '.join(cells)
            + (f'; the run warned: {warned}' if warned else '')
        )
    return lines


def main(argv):
    del argv
    if _JOB.value >= 0:  # one run, in a fresh process, so that runs do not share the driver's memory
        name, num_clients = _jobs()[_JOB.value]
        client_states.ClientStateStore = _RecordingStore
        _RecordingStore.final_clients = _FINAL_CLIENTS.value
        _RecordingStore.final_round = _ROUNDS.value
        from tff_pfl.data import pipeline

        pipeline.prepare = shared_population.prepare_linked(pipeline.prepare)
        record = _run(name, num_clients, _WORKDIR.value)
        with open(os.path.join(_WORKDIR.value, f'record_{_JOB.value}.json'), 'w') as f:
            json.dump(record, f)
        return
    records = []
    if _REPORT_ONLY.value:
        with open(_OUT.value + '.json') as f:
            lines = _report(json.load(f)['records'])
        with open(_OUT.value + '.md', 'w') as f:
            f.write('\n'.join(lines) + '\n')
        return
    if _APPEND.value and os.path.exists(_OUT.value + '.json'):
        with open(_OUT.value + '.json') as f:
            records = json.load(f)['records']
    if _DATA.value == 'shared':  # each population once, before the runs (not in their setup or memory)
        for n in dict.fromkeys(int(n) for n in _SIZES.value):
            shared_population.write(_population_root(n), n, _HETEROGENEITY.value)
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
                if _DATA.value == 'shared':
                    common.update(heterogeneity=_HETEROGENEITY.value, examples_per_client=shared_population.EXAMPLES)
                json.dump({'common': common, 'algorithms': ALGORITHMS, 'records': records}, f, indent=1)
            lines = _report(records)
            with open(_OUT.value + '.md', 'w') as f:
                f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
