"""A damaged checkpoint costs rounds, never the run: the newest intact one is resumed, or one line and exit 2."""

import collections
import csv
import os
import shutil
import struct
import zipfile

import numpy as np
import pytest

from tff_pfl.program import checkpoints, client_states, experiment, run_config, training_loop

TIMING = {'round_seconds', 'personalize_seconds'}
# FedAvg on the tiny data, 8 rounds, a checkpoint every 2; the crashed run stops in round 7 (checkpoints 4 and 6).
SETTINGS = dict(
    algorithm='fedavg',
    model='mnist_dnn',
    partition='ds1',
    classes_per_client=2,
    num_clients=4,
    rounds=8,
    eval_every=2,
    batch_size=8,
    client_learning_rate=0.1,
    client_fraction=0.5,
    checkpoint_every=2,
)


def _config(tiny_npz, out):
    return run_config.make_config(output_dir=str(out), dataset=f'npz:{tiny_npz}', **SETTINGS)


def _rows(path):
    with open(path, newline='') as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _crash_at(label):
    def log(line):
        if line.startswith(label):
            raise KeyboardInterrupt(line)

    return log


def _files(directory):
    """Relative path -> bytes of every file under `directory`."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, 'rb') as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


def _flip(path, offset, mask=0x5A):
    data = bytearray(open(path, 'rb').read())
    data[offset] ^= mask
    with open(path, 'wb') as f:
        f.write(data)


def _truncate(path):
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
        f.write(data[: len(data) // 2])


def _corrupt_middle(path):
    _flip(path, os.path.getsize(path) // 2)


def _empty(path):
    open(path, 'wb').close()


def _corrupt_member(path, member):
    """Flips a byte near the end of `member`'s data (past its `.npy` header)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, 'rb') as f:
        f.seek(info.header_offset + 26)
        name_bytes, extra_bytes = struct.unpack('<HH', f.read(4))
    _flip(path, info.header_offset + 30 + name_bytes + extra_bytes + info.compress_size - 2)


@pytest.fixture(scope='module')
def plain(tiny_npz, tmp_path_factory, tff_runtime):
    out = tmp_path_factory.mktemp('plain') / 'run'
    experiment.run_experiment(_config(tiny_npz, out), log=lambda line: None)
    return out


@pytest.fixture(scope='module')
def crashed(tiny_npz, tmp_path_factory, tff_runtime):
    out = tmp_path_factory.mktemp('crashed') / 'run'
    with pytest.raises(KeyboardInterrupt):
        experiment.run_experiment(_config(tiny_npz, out), log=_crash_at('round 7/'))
    kept = sorted(os.listdir(out / 'checkpoints'))
    assert [n for n in kept if n.startswith('round_')] == ['round_4.npz', 'round_6.npz'], kept
    assert 'clients_6.npz' in kept  # round 6's own segment (clients trained in rounds 5 and 6)
    return out


@pytest.mark.parametrize(
    'damaged_file, damage, why',
    [
        ('round_6.npz', _truncate, 'truncated or not a zip file'),
        ('round_6.npz', _corrupt_middle, 'bad CRC-32 in server_'),  # the middle of the server model's weights
        ('round_6.npz', _empty, 'empty file'),
        ('clients_6.npz', _corrupt_middle, 'client-state segment clients_6.npz: bad CRC-32 in client_'),
    ],
    ids=['truncated', 'corrupt_middle', 'empty', 'corrupt_segment'],
)
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_with_the_same_numbers(
    damaged_file, damage, why, tiny_npz, plain, crashed, tmp_path, tff_runtime
):
    out = tmp_path / 'run'
    shutil.copytree(crashed, out)
    directory = out / 'checkpoints'
    damage(directory / damaged_file)
    damaged_bytes = (directory / damaged_file).read_bytes()
    lines = []
    experiment.run_experiment(_config(tiny_npz, out), log=lines.append)
    skipped = [line for line in lines if 'unreadable' in line]
    assert len(skipped) == 1, lines[:5]
    aside = 'round_6.npz.damaged' if damaged_file == 'round_6.npz' else 'round_6.npz.damaged, clients_6.npz.damaged'
    assert skipped[0].startswith(f'checkpoint {directory / "round_6.npz"} is unreadable ({why}'), skipped[0]
    assert skipped[0].endswith(f'); skipped (kept as {aside}), resuming from the checkpoint of round 4'), skipped[0]
    assert any(line.startswith('resuming after round 4 ') for line in lines), lines[:5]
    for name in ('metrics.csv', 'clients.csv'):
        assert _rows(out / name) == _rows(plain / name), name
    # The damaged file is kept aside, as it was; the rerun wrote a good round 6 and kept round 4 until then.
    assert (directory / f'{damaged_file}.damaged').read_bytes() == damaged_bytes
    assert [n for n in sorted(os.listdir(directory)) if n.startswith('round_')] == [
        'round_4.npz',
        'round_6.npz',
        'round_6.npz.damaged',
    ]
    assert checkpoints.RunCheckpoints(str(directory)).check() == (6, [])


def test_no_readable_checkpoint_is_one_line_and_exit_2_and_nothing_changes(
    tiny_npz, crashed, tmp_path, train_in_process
):
    out = tmp_path / 'run'
    shutil.copytree(crashed, out)
    directory = out / 'checkpoints'
    _truncate(directory / 'round_6.npz')
    _corrupt_middle(directory / 'round_4.npz')
    before = _files(out)
    flags = [f'--{k}={v}' for k, v in SETTINGS.items()]
    code, stderr = train_in_process(*flags, f'--dataset=npz:{tiny_npz}', f'--output_dir={out}')
    assert code == 2, stderr[-2000:]
    assert stderr.strip().splitlines() == [
        f'tff-pfl-train: error: output_dir {out} cannot continue: no checkpoint in {directory} can be read: '
        f'checkpoint {directory / "round_6.npz"} is unreadable (truncated or not a zip file); '
        f'checkpoint {directory / "round_4.npz"} is unreadable (bad CRC-32 in server_0000.npy); nothing was '
        f'changed: move the damaged files out of {directory} to start again from round 1, or pass --overwrite to '
        'replace it'
    ]
    assert _files(out) == before


class _Process:
    """Stands in for a process: the store only asks for initial client states."""

    @staticmethod
    def initial_client_state(client_id):
        return collections.OrderedDict(client_id=client_id.encode(), w=np.zeros(3, np.float32))


def _checkpoints(directory, rounds, ids=('a', 'b', 'c')):
    """Checkpoints of `rounds` (client i trained in round r: w = r + i), each saved by one store and one object."""
    store = client_states.ClientStateStore(_Process, list(ids))
    runs = checkpoints.RunCheckpoints(str(directory))
    for round_num in rounds:
        chosen = [ids[round_num % len(ids)]]
        states = [collections.OrderedDict(client_id=c.encode(), w=np.full(3, round_num, np.float32)) for c in chosen]
        store.put(chosen, states)
        training_loop.save_checkpoint(
            runs, round_num, {'round_num': np.int32(round_num)}, store, np.random.default_rng(round_num), []
        )
    return runs, store


def test_every_flipped_byte_is_detected_or_changes_nothing_read(tmp_path):
    """A flipped byte anywhere in the manifest or the segment: refused, or everything loads as before."""
    runs, _ = _checkpoints(tmp_path, [1])
    server = {'round_num': np.int32(0)}
    want = runs.load_latest(server)
    want_states = want.client_states(_Process.initial_client_state('a'))
    missed, checked = [], 0
    for name in ('round_1.npz', 'clients_1.npz'):
        path = tmp_path / name
        data = path.read_bytes()
        for offset in range(0, len(data), 7):
            checked += 1
            _flip(path, offset)
            try:
                checkpoints.RunCheckpoints(str(tmp_path)).check()
            except checkpoints.CheckpointError:
                path.write_bytes(data)
                continue
            got = checkpoints.RunCheckpoints(str(tmp_path)).load_latest(server)
            states = got.client_states(_Process.initial_client_state('a'))
            same = (got.round_num, got.client_ids, got.rows, got.rng_state) == (
                want.round_num,
                want.client_ids,
                want.rows,
                want.rng_state,
            ) and list(states) == list(want_states)
            same = same and all(np.array_equal(states[c]['w'], want_states[c]['w']) for c in states)
            if not same:
                missed.append((name, offset))
            path.write_bytes(data)
    assert checked > 200 and not missed


def test_a_damaged_base_segment_makes_every_checkpoint_on_it_unreadable_and_nothing_is_touched(tmp_path):
    _checkpoints(tmp_path, [1, 2])  # round 2's chain builds on round 1's segment
    _corrupt_member(tmp_path / 'clients_1.npz', 'client_0001.npy')  # a byte of the last client's `w`
    before = _files(tmp_path)
    with pytest.raises(checkpoints.CheckpointError) as refused:
        checkpoints.RunCheckpoints(str(tmp_path)).load_latest({'round_num': np.int32(0)})
    assert str(refused.value).startswith(f'no checkpoint in {tmp_path} can be read: checkpoint ')
    assert str(refused.value).count('client-state segment clients_1.npz: bad CRC-32 in client_0001.npy') == 2
    assert _files(tmp_path) == before


def test_the_checkpoint_resumed_from_is_kept_until_a_newer_good_one_exists(tmp_path):
    """Resume skips a damaged round 4 for round 2; saving round 3 keeps round 2; the damaged file stays aside."""
    _checkpoints(tmp_path, [2, 4])
    _empty(tmp_path / 'round_4.npz')
    runs = checkpoints.RunCheckpoints(str(tmp_path))
    store = client_states.ClientStateStore(_Process, ['a', 'b', 'c'])
    restored = runs.load_latest({'round_num': np.int32(0)})
    assert restored.round_num == 2
    assert [(d.path, d.why) for d in restored.skipped] == [(str(tmp_path / 'round_4.npz'), 'empty file')]
    store.restore(restored)
    assert runs.rounds() == [2]  # set aside: not chosen again, not counted among the kept ones
    store.put(['a'], [collections.OrderedDict(client_id=b'a', w=np.full(3, 3, np.float32))])
    training_loop.save_checkpoint(runs, 3, {'round_num': np.int32(3)}, store, np.random.default_rng(3), [])
    assert runs.rounds() == [2, 3]
    assert (tmp_path / 'round_4.npz.damaged').read_bytes() == b''
    again = checkpoints.RunCheckpoints(str(tmp_path)).load_latest({'round_num': np.int32(0)})
    assert again.round_num == 3 and again.skipped == ()
    states = again.client_states(_Process.initial_client_state('a'))
    np.testing.assert_array_equal(states['a']['w'], np.full(3, 3))


def test_a_kept_manifest_damaged_later_neither_stops_saving_nor_loses_segments(tmp_path):
    runs, store = _checkpoints(tmp_path, [1, 2])
    _truncate(tmp_path / 'round_2.npz')
    segments = sorted(n for n in os.listdir(tmp_path) if n.startswith('clients_'))
    store.put(['a'], [collections.OrderedDict(client_id=b'a', w=np.full(3, 3, np.float32))])
    training_loop.save_checkpoint(runs, 3, {'round_num': np.int32(3)}, store, np.random.default_rng(3), [])
    assert set(segments) <= set(os.listdir(tmp_path))  # what the damaged round 2 needed is unknown: all kept
    restored = checkpoints.RunCheckpoints(str(tmp_path)).load_latest({'round_num': np.int32(0)})
    assert restored.round_num == 3
