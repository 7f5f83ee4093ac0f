"""What the integrity check of a resume costs on a 1,000,000-client run's checkpoint.

Before a run continues, `RunCheckpoints.check` (and `load_latest`) reads the
newest checkpoint whole: the manifest and every client-state segment it names,
each member's CRC-32 compared (`checkpoints.check_archive`). This builds the
checkpoints of the scale benchmark's Self-FL run at 1,000,000 clients
(docs/reliability.md, "Where it stops") with the real store and checkpoint
code: 200 rounds of 100 clients drawn from 1,000,000, a client state of
4.7 kB (1,175 float32s), a checkpoint every 20 rounds. Then it times, on the
newest checkpoint (round 180), the check with the files dropped from the page
cache (`posix_fadvise(DONTNEED)`: read from disk) and cached, and for
comparison the whole resume read (`load_latest`, which checks too, and
restoring every stored client into the store), with and without the CRC pass.

    uv run --locked python benchmarks/checkpoint_integrity.py
"""

import argparse
import collections
import os
import statistics
import tempfile
import time

import numpy as np

from tff_pfl.program import checkpoints, client_states, training_loop


class _Process:
    """Stands in for a process: the store only asks for initial client states."""

    def __init__(self, state_floats: int):
        self.state_floats = state_floats

    def initial_client_state(self, client_id):
        return collections.OrderedDict(
            client_id=client_id.encode(), steps=np.int32(0), weights=np.zeros(self.state_floats, np.float32)
        )


def _trained(state, round_num):
    state = collections.OrderedDict(state)
    state['steps'] = np.int32(state['steps'] + 1)
    state['weights'] = state['weights'] + np.float32(round_num)
    return state


def _drop_cache(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _seconds(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--num_clients', type=int, default=1_000_000)
    parser.add_argument('--rounds', type=int, default=200)
    parser.add_argument('--active', type=int, default=100, help='clients per round')
    parser.add_argument('--checkpoint_every', type=int, default=20)
    parser.add_argument('--state_floats', type=int, default=1175, help='float32s per client state (4.7 kB)')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--workdir', default=None, help='where the checkpoints go (default: a temporary directory)')
    args = parser.parse_args()

    process = _Process(args.state_floats)
    ids = [f'client_{i:07d}' for i in range(args.num_clients)]
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix='checkpoint_integrity_') as workdir:
        directory = os.path.join(workdir, 'checkpoints')
        runs = checkpoints.RunCheckpoints(directory)
        store = client_states.ClientStateStore(process, ids)
        rng = np.random.default_rng(0)
        server = {'model': [np.zeros((60, 10), np.float32), np.zeros(10, np.float32)]}
        for round_num in range(1, args.rounds + 1):
            chosen = [ids[i] for i in np.sort(rng.choice(len(ids), size=args.active, replace=False))]
            store.put(chosen, [_trained(s, round_num) for s in store.get(chosen)])
            if round_num % args.checkpoint_every == 0 and round_num < args.rounds:
                training_loop.save_checkpoint(runs, round_num, server, store, rng, [{'round': round_num}])
        newest = runs.latest_round()
        checked = checkpoints.RunCheckpoints(directory)
        assert checked.check() == (newest, [])
        loaded = checked.load_latest(server)
        files = [loaded.path] + [p for p in loaded.segment_paths if p != loaded.path]
        sizes = [os.path.getsize(p) for p in files]

        def check():
            checkpoints.RunCheckpoints(directory).check()

        def resume():
            restored = client_states.ClientStateStore(process, ids)
            restored.restore(checkpoints.RunCheckpoints(directory).load_latest(server))

        cold = _seconds(check, args.repeats, before=lambda: _drop_cache(directory))
        warm = _seconds(check, args.repeats)
        whole = _seconds(resume, args.repeats)
        check_archive = checkpoints.check_archive
        checkpoints.check_archive = lambda path: None  # the CRC pass off: what the resume read costs without it
        try:
            unchecked = _seconds(resume, args.repeats)
        finally:
            checkpoints.check_archive = check_archive
        print(
            f'{args.num_clients} clients, {store.num_stored} stored ({store.nbytes / 1e6:.1f} MB), '
            f'checkpoint of round {newest}: manifest {sizes[0] / 1e6:.1f} MB + {len(sizes) - 1} segments '
            f'{sum(sizes[1:]) / 1e6:.1f} MB = {sum(sizes) / 1e6:.1f} MB '
            f'({", ".join(os.path.basename(p) for p in files)})'
        )
        print(f'integrity check (RunCheckpoints.check), median of {args.repeats}:')
        print(f'  from disk (page cache dropped): {cold:.3f} s ({sum(sizes) / 1e6 / cold:.0f} MB/s)')
        print(f'  cached:                         {warm:.3f} s ({sum(sizes) / 1e6 / warm:.0f} MB/s)')
        print(f'resume read (load_latest + restore of every stored client), cached: {whole:.3f} s')
        print(f'  the same without the CRC pass (check_archive off):               {unchecked:.3f} s')


if __name__ == '__main__':
    main()
