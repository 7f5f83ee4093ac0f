"""Checkpoints of a run: one `.npz` file per checkpointed round, written atomically.

A checkpoint holds everything the run loop needs to continue as if it had
never stopped: the round number, the server state, every client's state, the
client-sampling generator's state, and the metrics rows so far. Training
randomness needs nothing more: every client's batch order and every seeded
draw inside the computations derive from (run seed, round number, client id).

Each checkpoint is written to a temporary file, flushed to disk and renamed
into place (`os.replace`), so a crash while writing leaves the last good
checkpoint intact; the newest two are kept. (`tff.program`'s
FileProgramStateManager does the same with SavedModel directories, but each
save made the driver's memory grow: benchmarks/results/memory_rounds.md.)

Nested values are flattened in TFF's structure order into one flat
`OrderedDict` of arrays (no empty containers, which SavedModel does not keep),
and the client states are stacked leaf by leaf over clients, so the number of
saved tensors does not grow with the number of clients. Loading rebuilds the
structures from templates: the process's initial server state and a client's
initial state.
"""

import collections
import json
import os
import re
import zipfile
from collections.abc import Mapping, Sequence

import numpy as np

from tff_pfl.computations import device_state

KEEP = 2
_NAME = re.compile(r'^round_(\d+)\.npz$')


def _scalar(value):
    """0-d arrays as numpy scalars (dtype kept), others as they are."""
    value = np.asarray(value)
    return value[()] if value.ndim == 0 else value


# Client leaves are read back in pieces of at most this many bytes, straight
# into the store's arrays (which may be memory-mapped).
_READ_BYTES = 16 * 2**20


def stack_states(client_states: Mapping) -> tuple:
    """`(client ids, leaves)`: every client's state stacked leaf by leaf, one `[num_clients, ...]` array per leaf.

    Args:
      client_states: client id -> client state (nested structures of arrays,
        all of the same structure).

    Returns:
      A tuple `(ids, leaves)`: the client ids in `client_states` order, and
      one `[num_clients, ...]` array per leaf, in TFF's structure order.
    """
    ids = list(client_states)
    per_client = [device_state.flatten(client_states[c]) for c in ids]
    leaves = [np.stack([np.asarray(leaves[i]) for leaves in per_client]) for i in range(len(per_client[0]))]
    return ids, leaves


class Checkpoint(
    collections.namedtuple('Checkpoint', ['round_num', 'server_state', 'client_ids', 'rng_state', 'rows', 'path'])
):
    """A loaded checkpoint; the client states stay in its file until read.

    Attributes:
      round_num: the last round it includes.
      server_state: the server state after that round.
      client_ids: every client id, in the order of the stacked leaves.
      rng_state: the sampling generator's `bit_generator.state`.
      rows: the metrics rows of rounds 1..round_num.
      path: the checkpoint's file.
    """

    def client_leaf(self, index: int) -> np.ndarray:
        """Client leaf `index`, `[num_clients, ...]`, read whole.

        Args:
          index: the leaf's position in the client state's flattened
            structure.

        Returns:
          The leaf of every client, stacked in `client_ids` order.
        """
        with np.load(self.path, allow_pickle=False) as archive:
            return archive[f'client_{index:04d}']

    def read_client_leaf(self, index: int, out: np.ndarray) -> None:
        """Reads client leaf `index` into `out` (same shape and dtype) piece by piece.

        Args:
          index: the leaf's position in the client state's flattened
            structure.
          out: the `[num_clients, ...]` array to fill (may be memory-mapped).

        Raises:
          ValueError: if the stored leaf's shape or dtype differs from `out`'s.
        """
        with zipfile.ZipFile(self.path) as archive, archive.open(f'client_{index:04d}.npy') as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read_header(f)
            if tuple(shape) != out.shape or dtype != out.dtype or fortran_order:
                raise ValueError(
                    f'{self.path}: client leaf {index} is {dtype}{list(shape)}, '
                    f'the run needs {out.dtype}{list(out.shape)}'
                )
            row_bytes = max(1, out[0].nbytes if len(out) else 1)
            step = max(1, _READ_BYTES // row_bytes)
            for start in range(0, shape[0], step):
                count = min(step, shape[0] - start)
                data = f.read(count * row_bytes)
                out[start : start + count] = np.frombuffer(data, dtype).reshape((count, *shape[1:]))

    def client_states(self, client_template) -> collections.OrderedDict:
        """Client id -> client state, every client (read whole; for small stores).

        Args:
          client_template: one client state of the run's process.

        Returns:
          Client id -> client state of `client_template`'s structure, in
          `client_ids` order.
        """
        num_client = len(device_state.flatten(client_template))
        with np.load(self.path, allow_pickle=False) as archive:
            stacked = [archive[f'client_{i:04d}'] for i in range(num_client)]
        return collections.OrderedDict(
            (c, device_state.fill(client_template, iter([_scalar(leaf[j]) for leaf in stacked])))
            for j, c in enumerate(self.client_ids)
        )


class RunCheckpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, round_num: int) -> str:
        return os.path.join(self.directory, f'round_{round_num}.npz')

    def rounds(self) -> list[int]:
        """The rounds that have a complete checkpoint, oldest first.

        Returns:
          The round numbers; empty if the directory does not exist.
        """
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m)

    def save(
        self,
        round_num: int,
        server_state,
        client_ids: Sequence[str],
        client_leaves: Sequence[np.ndarray],
        rng_state: Mapping,
        rows: Sequence[Mapping],
    ) -> None:
        """Writes the checkpoint of round `round_num` (atomically) and drops older ones beyond the newest two.

        Args:
          round_num: the round just finished.
          server_state: the server state after it.
          client_ids: every client id.
          client_leaves: every client's state stacked leaf by leaf, one
            `[num_clients, ...]` array per leaf (`stack_states`, or a store's
            own arrays, which are written piece by piece).
          rng_state: the sampling generator's `bit_generator.state`.
          rows: the metrics rows so far (JSON-serializable values).
        """
        flat = collections.OrderedDict(
            round_num=np.int64(round_num),
            client_ids=np.array([c.encode() for c in client_ids]),
            rng_state=np.array(json.dumps(rng_state)),
            rows=np.array(json.dumps(list(rows))),
        )
        for i, leaf in enumerate(device_state.flatten(server_state)):
            flat[f'server_{i:04d}'] = np.asarray(leaf)
        for i, leaf in enumerate(client_leaves):
            flat[f'client_{i:04d}'] = leaf
        os.makedirs(self.directory, exist_ok=True)
        final = self._path(int(round_num))
        temporary = f'{final}.tmp'
        with open(temporary, 'wb') as f:
            np.savez(f, **flat)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        for old in self.rounds()[:-KEEP]:
            os.remove(self._path(old))

    def latest_round(self) -> int | None:
        """The newest round that has a complete checkpoint, or None if none has.

        Returns:
          The round number, or None.
        """
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def load_latest(self, server_template) -> Checkpoint | None:
        """The newest checkpoint, or None if there is none; its client states stay in the file.

        Args:
          server_template: a server state of the run's process (for its structure).

        Returns:
          The newest `Checkpoint`, or None.
        """
        round_num = self.latest_round()
        if round_num is None:
            return None
        path = self._path(round_num)
        num_server = len(device_state.flatten(server_template))
        with np.load(path, allow_pickle=False) as archive:
            flat = {
                key: archive[key]
                for key in ['round_num', 'client_ids', 'rng_state', 'rows']
                + [f'server_{i:04d}' for i in range(num_server)]
            }
        server_state = device_state.fill(
            server_template, iter([_scalar(flat[f'server_{i:04d}']) for i in range(num_server)])
        )
        return Checkpoint(
            round_num=int(flat['round_num']),
            server_state=server_state,
            client_ids=[c.decode() if isinstance(c, bytes) else str(c) for c in flat['client_ids'].tolist()],
            rng_state=json.loads(_text(flat['rng_state'])),
            rows=json.loads(_text(flat['rows'])),
            path=path,
        )


def _text(value) -> str:
    value = np.asarray(value).item()
    return value.decode() if isinstance(value, bytes) else str(value)
