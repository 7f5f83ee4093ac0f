"""The driver's client-state store: stacked, spilled to memory-mapped files when large, checkpointed in pieces."""

import collections
import csv
import os

import numpy as np
import pytest

from tff_pfl.program import checkpoints, experiment, training_loop

TIMING = {'round_seconds', 'personalize_seconds'}


class _Process:
    """Stands in for a process: only `initial_client_state` is used by the store."""

    @staticmethod
    def initial_client_state(client_id):
        seed = sum(client_id.encode())
        return collections.OrderedDict(
            client_id=client_id.encode(),
            num_participations=np.int32(0),
            model=[np.full((3, 2), seed, np.float32), np.arange(2, dtype=np.float32) + seed],
            loss=np.float32(np.inf),
        )


def _trained(state, step):
    state = collections.OrderedDict(state)
    state['num_participations'] = np.int32(state['num_participations'] + step)
    state['model'] = [w * 2 + step for w in state['model']]
    state['loss'] = np.float32(step / 10)
    return state


def _assert_same(a, b):
    assert list(a) == list(b)
    for x, y in zip(a.values(), b.values()):
        assert x['client_id'] == y['client_id']
        assert x['num_participations'] == y['num_participations'] and x['loss'] == y['loss']
        for u, v in zip(x['model'], y['model']):
            np.testing.assert_array_equal(u, v)


def test_a_spilled_store_keeps_what_the_heap_store_keeps_and_leaves_no_file(tmp_path):
    ids = [f'client_{i}' for i in range(7)]
    heap = training_loop.ClientStateStore(_Process, ids, spill_dir=str(tmp_path))
    spilled = training_loop.ClientStateStore(_Process, ids, spill_dir=str(tmp_path), spill_bytes=0)
    assert not heap.spilled and spilled.spilled
    assert all(isinstance(leaf, np.memmap) for leaf in spilled.stacked()[1:])
    assert os.listdir(tmp_path) == []  # mapped files are unlinked at once
    assert spilled.nbytes == heap.nbytes == 7 * (4 + 6 * 4 + 2 * 4 + 4)
    for step, chosen in enumerate([ids[1:4], ids[::3], ids], start=1):
        for store in (heap, spilled):
            store.put(chosen, [_trained(s, step) for s in store.get(chosen)])
    expected = collections.OrderedDict((c, _Process.initial_client_state(c)) for c in ids)
    for step, chosen in enumerate([ids[1:4], ids[::3], ids], start=1):
        for c in chosen:
            expected[c] = _trained(expected[c], step)
    _assert_same(heap.states(), expected)
    _assert_same(spilled.states(), expected)
    assert isinstance(spilled.states()['client_2']['loss'], np.float32)
    with pytest.raises(KeyError):
        spilled.states()['nobody']
    with pytest.raises(RuntimeError, match="client state of 'client_0' returned in the slot of 'client_1'"):
        spilled.put(['client_1'], spilled.get(['client_0']))


def test_a_checkpoint_is_read_back_into_a_spilled_store_piece_by_piece(tmp_path, monkeypatch):
    ids = [f'c{i}' for i in range(11)]
    store = training_loop.ClientStateStore(_Process, ids, spill_dir=str(tmp_path), spill_bytes=0)
    store.put(ids[::2], [_trained(s, 3) for s in store.get(ids[::2])])
    runs = checkpoints.RunCheckpoints(str(tmp_path / 'checkpoints'))
    runs.save(4, {'round_num': np.int32(4)}, store.ids(), store.stacked(), {'s': 1}, [])
    monkeypatch.setattr(checkpoints, '_READ_BYTES', 2 * 24)  # 2 rows of the (3, 2) leaf per piece
    restored_into = training_loop.ClientStateStore(_Process, ids, spill_dir=str(tmp_path), spill_bytes=0)
    restored_into.restore(runs.load_latest({'round_num': np.int32(0)}))
    _assert_same(restored_into.states(), store.states())
    smaller = training_loop.ClientStateStore(_Process, ids[:5])
    with pytest.raises(ValueError, match=r'client leaf 1 is int32\[11\], the run needs int32\[5\]'):
        smaller.restore(runs.load_latest({'round_num': np.int32(0)}))


def _rows(path):
    with open(path, newline='') as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _crash_at(label):
    def log(line):
        if line.startswith(label):
            raise KeyboardInterrupt(line)

    return log


@pytest.mark.parametrize(
    'algorithm,extra',
    [
        (
            'persfl',
            dict(
                partition='ds1',
                classes_per_client=2,
                client_fraction=0.5,
                temperatures=(1.0, 3.0),
                imitations=(0.0, 0.5),
                distill_epochs=1,
                eval_every=2,
            ),
        ),
        (
            'kdpdfl',
            dict(
                partition='kd_dirichlet',
                kd_split_sizes=(5, 15, 5, 10),
                exchange_interval=3,
                kd_mean_neighbours=2.0,
                kd_max_neighbours=2,
                eval_every=2,
            ),
        ),
    ],
)
def test_spilled_chunked_and_resumed_runs_give_the_plain_runs_numbers(
    algorithm, extra, tiny_npz, tmp_path, monkeypatch, tff_runtime
):
    """Store memory-mapped, evaluation and personalization 3 clients per call, crash after round 5: same numbers."""

    def config(out):
        return experiment.make_config(
            output_dir=str(out),
            algorithm=algorithm,
            dataset=f'npz:{tiny_npz}',
            num_clients=4,
            model='mnist_dnn',
            rounds=6,
            checkpoint_every=2,
            batch_size=8,
            client_learning_rate=0.1,
            **extra,
        )

    experiment.run_experiment(config(tmp_path / 'plain'), log=lambda line: None)
    monkeypatch.setattr(training_loop, 'SPILL_BYTES', 0)
    monkeypatch.setattr(training_loop, 'CLIENTS_PER_CALL', 3)
    crashed = tmp_path / 'crashed'
    label = 'round 5/' if algorithm == 'persfl' else 'interval 5/'
    with pytest.raises(KeyboardInterrupt):
        experiment.run_experiment(config(crashed), log=_crash_at(label))
    assert sorted(os.listdir(crashed / 'checkpoints')) == ['round_2.npz', 'round_4.npz']
    lines = []
    experiment.run_experiment(config(crashed), log=lines.append)
    assert lines[1].startswith(f'resuming after {label.split()[0]} 4'), lines[:3]
    for name in ('metrics.csv', 'clients.csv'):
        assert _rows(crashed / name) == _rows(tmp_path / 'plain' / name), name
    assert not [f for f in os.listdir(crashed) if f.startswith('client_store_')]
