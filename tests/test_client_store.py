"""The driver's client-state store: stacked, spilled to memory-mapped files when large, checkpointed in pieces."""

import collections
import csv
import inspect
import os

import numpy as np
import pytest

from tff_pfl.program import checkpoints, client_states, device_store, experiment, run_config, training_loop

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
    heap = client_states.ClientStateStore(_Process, ids, spill_dir=str(tmp_path))
    spilled = client_states.ClientStateStore(_Process, ids, spill_dir=str(tmp_path), spill_bytes=0)
    for step, chosen in enumerate([ids[1:4], ids[::3], ids], start=1):
        for store in (heap, spilled):
            store.put(chosen, [_trained(s, step) for s in store.get(chosen)])
    assert not heap.spilled and spilled.spilled
    assert all(isinstance(leaf, np.memmap) for leaf in spilled.changes(everything=True).leaves[1:])
    assert os.listdir(tmp_path) == []  # mapped files are unlinked at once
    assert spilled.nbytes == heap.nbytes == 7 * (4 + 6 * 4 + 2 * 4 + 4)
    expected = collections.OrderedDict((c, _Process.initial_client_state(c)) for c in ids)
    for step, chosen in enumerate([ids[1:4], ids[::3], ids], start=1):
        for c in chosen:
            expected[c] = _trained(expected[c], step)
    _assert_same(heap.states(), expected)
    _assert_same(spilled.states(), expected)
    assert isinstance(spilled.states()['client_2']['loss'], np.float32)
    with pytest.raises(KeyError):
        spilled.states()['nobody']
    with pytest.raises(KeyError):
        spilled.put(['nobody'], spilled.get(['client_0']))
    with pytest.raises(RuntimeError, match="client state of 'client_0' returned in the slot of 'client_1'"):
        spilled.put(['client_1'], spilled.get(['client_0']))


class _CountingProcess(_Process):
    """`_Process`, counting the clients whose initial state it made (one by one, or batched)."""

    made = []

    @classmethod
    def initial_client_states(cls, client_ids):
        cls.made.append(list(client_ids))
        return [cls.initial_client_state(c) for c in client_ids]


def test_a_client_has_no_stored_state_until_its_first_state_is_put(tmp_path, monkeypatch):
    """The store grows with the clients that took part; the others' initial states come in one call per read."""
    _CountingProcess.made = []
    ids = [f'c{i}' for i in range(1000)]
    store = client_states.ClientStateStore(_CountingProcess, ids, spill_dir=str(tmp_path), spill_bytes=20 * 40)
    assert store.num_stored == 0 and store.nbytes == 0 and _CountingProcess.made == []
    first = store.get(['c5', 'c7', 'c9'])
    assert _CountingProcess.made == [['c5', 'c7', 'c9']] and store.num_stored == 0
    store.put(['c5', 'c9'], [_trained(s, 1) for s in (first[0], first[2])])
    assert store.stored_ids() == ['c5', 'c9'] and store.nbytes == 2 * 40 and not store.spilled
    again = store.get(['c9', 'c3', 'c5'])
    assert _CountingProcess.made[-1] == ['c3']  # stored states are read, not made again
    assert again[0]['num_participations'] == 1 and again[1]['num_participations'] == 0
    for i in range(0, 30, 3):  # grows past the spill size: the rows move to a mapped file, kept
        store.put(ids[i : i + 3], [_trained(s, 2) for s in store.get(ids[i : i + 3])])
    assert store.spilled and store.num_stored == 30
    expected = collections.OrderedDict((c, _Process.initial_client_state(c)) for c in ids)
    for c in ['c5', 'c9']:
        expected[c] = _trained(expected[c], 1)
    for c in ids[:30]:
        expected[c] = _trained(expected[c], 2)
    _assert_same(store.states(), expected)
    # Iterating every state reads the clients without one in batches, not one call per client.
    _CountingProcess.made = []
    monkeypatch.setattr(client_states, 'CLIENTS_PER_CALL', 400)
    states = list(store.states().values())
    assert [len(batch) for batch in _CountingProcess.made] == [400 - 30, 400, 200]  # 30 of the first 400 are stored
    assert dict(zip(ids, states)).keys() == dict(store.states().items()).keys()
    for (c, state), expected_state in zip(store.states().items(), expected.values()):
        assert state['client_id'] == c.encode() and state['num_participations'] == expected_state['num_participations']


def test_fields_of_every_client_read_the_stored_clients_and_one_initial_state(tmp_path, monkeypatch):
    _CountingProcess.made = []
    ids = [f'c{i}' for i in range(250)]
    store = client_states.ClientStateStore(_CountingProcess, ids, spill_dir=str(tmp_path))
    chosen = ['c3', 'c100', 'c249']
    store.put(chosen, [_trained(s, 2) for s in store.get(chosen)])
    monkeypatch.setattr(client_states, 'CLIENTS_PER_CALL', 100)
    _CountingProcess.made = []
    fields = store.states().fields(['num_participations', 'loss'])
    # One call for two unstored clients' initial states (they agree), then the stored ones; no per-batch calls.
    assert _CountingProcess.made == [['c0', 'c248']]
    want = [
        _trained(_Process.initial_client_state(c), 2) if c in chosen else _Process.initial_client_state(c) for c in ids
    ]
    np.testing.assert_array_equal(fields['num_participations'], [s['num_participations'] for s in want])
    np.testing.assert_array_equal(fields['loss'], [s['loss'] for s in want])
    # A field whose initial value differs between clients is read client by client, in batches.
    _CountingProcess.made = []
    names = store.states().fields(['client_id'])
    assert [len(b) for b in _CountingProcess.made] == [2, 99, 99, 49]
    assert names['client_id'].tolist() == [c.encode() for c in ids]


def _segment_ids(directory):
    runs = checkpoints.RunCheckpoints(str(directory))
    return [segment.ids() for segment in runs.load_latest({'round_num': np.int32(0)}).segments()]


def test_checkpoints_write_the_changed_clients_and_restore_the_same_states(tmp_path, monkeypatch):
    """First checkpoint: every stored client; then only the changes; a long chain is compacted; old files go."""
    ids = [f'c{i}' for i in range(11)]
    store = client_states.ClientStateStore(_Process, ids, spill_dir=str(tmp_path), spill_bytes=0)
    runs = checkpoints.RunCheckpoints(str(tmp_path / 'checkpoints'))
    rng = np.random.default_rng(0)

    def round_of(round_num, chosen):
        store.put(chosen, [_trained(s, round_num) for s in store.get(chosen)])
        training_loop.save_checkpoint(runs, round_num, {'round_num': np.int32(round_num)}, store, rng, [])

    round_of(1, ['c1', 'c2', 'c3'])
    assert _segment_ids(runs.directory) == [['c1', 'c2', 'c3']]
    round_of(2, ['c3', 'c4'])
    assert _segment_ids(runs.directory) == [['c1', 'c2', 'c3'], ['c3', 'c4']]
    round_of(3, ids[1:5])  # chain 3 + 2 + 4 rows > 2 x 4 stored: a full segment
    assert _segment_ids(runs.directory) == [['c1', 'c2', 'c3', 'c4']]
    round_of(4, ['c0'])
    assert sorted(os.listdir(runs.directory)) == ['clients_3.npz', 'clients_4.npz', 'round_3.npz', 'round_4.npz']
    monkeypatch.setattr(checkpoints, 'PIECE_BYTES', 2 * 24)  # 2 rows of the (3, 2) leaf per piece
    restored_into = client_states.ClientStateStore(_Process, ids, spill_dir=str(tmp_path), spill_bytes=0)
    restored_into.restore(runs.load_latest({'round_num': np.int32(0)}))
    assert restored_into.stored_ids() == ['c1', 'c2', 'c3', 'c4', 'c0']
    _assert_same(restored_into.states(), store.states())
    # A resumed run's next checkpoint builds on the restored chain.
    resumed = checkpoints.RunCheckpoints(runs.directory)
    restored_into.restore(resumed.load_latest({'round_num': np.int32(0)}))
    restored_into.put(['c5'], [_trained(s, 5) for s in restored_into.get(['c5'])])
    training_loop.save_checkpoint(resumed, 5, {'round_num': np.int32(5)}, restored_into, rng, [])
    assert _segment_ids(runs.directory) == [['c1', 'c2', 'c3', 'c4'], ['c0'], ['c5']]
    other = client_states.ClientStateStore(_Process, ['c0', 'c1'])
    with pytest.raises(ValueError, match=r"clients_3.npz: client 'c2' is not a client of this run"):
        other.restore(runs.load_latest({'round_num': np.int32(0)}))


def test_a_checkpoint_of_the_earlier_format_loads_as_one_full_segment(tmp_path):
    """Manifests that held every client's state (before segments) still resume; the next save writes everything."""
    ids = ['a', 'b', 'c']
    states = collections.OrderedDict((c, _trained(_Process.initial_client_state(c), 1)) for c in ids)
    stacked_ids, leaves = checkpoints.stack_states(states)
    flat = collections.OrderedDict(
        round_num=np.int64(2),
        client_ids=np.array([c.encode() for c in stacked_ids]),
        rng_state=np.array('{"s": 1}'),
        rows=np.array('[]'),
        server_0000=np.int32(2),
    )
    flat.update((f'client_{i:04d}', leaf) for i, leaf in enumerate(leaves))
    os.makedirs(tmp_path / 'old')
    np.savez(tmp_path / 'old' / 'round_2.npz', **flat)
    runs = checkpoints.RunCheckpoints(str(tmp_path / 'old'))
    store = client_states.ClientStateStore(_Process, ids)
    store.restore(runs.load_latest({'round_num': np.int32(0)}))
    _assert_same(store.states(), states)
    assert runs.wants_everything(0, store.nbytes)


def test_a_checkpoint_with_a_missing_segment_is_refused_in_one_line(tmp_path):
    store = client_states.ClientStateStore(_Process, ['a', 'b'])
    store.put(['a'], store.get(['a']))
    runs = checkpoints.RunCheckpoints(str(tmp_path))
    training_loop.save_checkpoint(runs, 1, {'round_num': np.int32(1)}, store, np.random.default_rng(0), [])
    os.remove(tmp_path / 'clients_1.npz')
    missing = r'round_1.npz is unreadable \(client-state segment clients_1.npz is missing\)$'
    with pytest.raises(ValueError, match=missing):
        checkpoints.RunCheckpoints(str(tmp_path)).load_latest({'round_num': np.int32(0)})


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
        return run_config.make_config(
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
    monkeypatch.setattr(client_states, 'SPILL_BYTES', 0)
    monkeypatch.setattr(client_states, 'CLIENTS_PER_CALL', 3)
    crashed = tmp_path / 'crashed'
    label = 'round 5/' if algorithm == 'persfl' else 'interval 5/'
    with pytest.raises(KeyboardInterrupt):
        experiment.run_experiment(config(crashed), log=_crash_at(label))
    assert sorted(os.listdir(crashed / 'checkpoints')) == [
        'clients_2.npz',
        'clients_4.npz',
        'round_2.npz',
        'round_4.npz',
    ]
    lines = []
    experiment.run_experiment(config(crashed), log=lines.append)
    assert lines[1].startswith(f'resuming after {label.split()[0]} 4'), lines[:3]
    for name in ('metrics.csv', 'clients.csv'):
        assert _rows(crashed / name) == _rows(tmp_path / 'plain' / name), name
    assert not [f for f in os.listdir(crashed) if f.startswith('client_store_')]


@pytest.mark.parametrize('store', [client_states.ClientStateStore, device_store.DeviceStateStore])
def test_both_stores_follow_the_one_protocol_the_loops_use(store):
    members = [n for n in vars(client_states.ClientStates) if not n.startswith('_')]
    assert 'nbytes' in client_states.ClientStates.__annotations__ and isinstance(vars(store)['nbytes'], property)
    for name in members:
        protocol = inspect.signature(getattr(client_states.ClientStates, name))
        own = inspect.signature(getattr(store, name))
        # The store takes every argument of the protocol's method, by the same name, and may take more.
        assert list(protocol.parameters) == list(own.parameters)[: len(protocol.parameters)], (store, name)
        extra = list(own.parameters.values())[len(protocol.parameters) :]
        assert all(p.default is not inspect.Parameter.empty for p in extra), (store, name)
