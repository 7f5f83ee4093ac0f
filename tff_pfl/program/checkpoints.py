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
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

from tff_pfl.computations import device_state

KEEP = 2
_NAME = re.compile(r'^round_(\d+)\.npz$')


def _scalar(value):
    """0-d arrays as numpy scalars (dtype kept), others as they are."""
    value = np.asarray(value)
    return value[()] if value.ndim == 0 else value


class Checkpoint(collections.namedtuple('Checkpoint', ['round_num', 'server_state', 'client_states', 'rng_state',
                                                       'rows'])):
    """A loaded checkpoint.

    Attributes:
      round_num: the last round it includes.
      server_state: the server state after that round.
      client_states: client id -> client state.
      rng_state: the sampling generator's `bit_generator.state`.
      rows: the metrics rows of rounds 1..round_num.
    """


class RunCheckpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, round_num: int) -> str:
        return os.path.join(self.directory, f'round_{round_num}.npz')

    def rounds(self) -> list[int]:
        """The rounds that have a complete checkpoint, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m)

    def save(self, round_num: int, server_state, client_states: Mapping, rng_state: Mapping,
             rows: Sequence[Mapping]) -> None:
        """Writes the checkpoint of round `round_num` (atomically) and drops older ones beyond the newest two.

        Args:
          round_num: the round just finished.
          server_state: the server state after it.
          client_states: client id -> client state, every client.
          rng_state: the sampling generator's `bit_generator.state`.
          rows: the metrics rows so far (JSON-serializable values).
        """
        ids = list(client_states)
        flat = collections.OrderedDict(
            round_num=np.int64(round_num),
            client_ids=np.array([c.encode() for c in ids]),
            rng_state=np.array(json.dumps(rng_state)),
            rows=np.array(json.dumps(list(rows))),
        )
        for i, leaf in enumerate(device_state.flatten(server_state)):
            flat[f'server_{i:04d}'] = np.asarray(leaf)
        per_client = [device_state.flatten(client_states[c]) for c in ids]
        for i in range(len(per_client[0]) if per_client else 0):
            flat[f'client_{i:04d}'] = np.stack([np.asarray(leaves[i]) for leaves in per_client])
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

    def latest_round(self) -> Optional[int]:
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def load_latest(self, server_template, client_template) -> Optional[Checkpoint]:
        """The newest checkpoint, or None if there is none.

        Args:
          server_template: a server state of the run's process (for its structure).
          client_template: one client state of the run's process.
        """
        round_num = self.latest_round()
        if round_num is None:
            return None
        num_server = len(device_state.flatten(server_template))
        num_client = len(device_state.flatten(client_template))
        with np.load(self._path(round_num), allow_pickle=False) as archive:
            flat = {key: archive[key] for key in archive.files}
        server_state = device_state.fill(server_template, iter([_scalar(flat[f'server_{i:04d}']) for i in range(num_server)]))
        ids = [c.decode() if isinstance(c, bytes) else str(c) for c in flat['client_ids'].tolist()]
        stacked = [flat[f'client_{i:04d}'] for i in range(num_client)]
        client_states = collections.OrderedDict(
            (c, device_state.fill(client_template, iter([_scalar(leaf[j]) for leaf in stacked]))) for j, c in enumerate(ids))
        return Checkpoint(
            round_num=int(flat['round_num']),
            server_state=server_state,
            client_states=client_states,
            rng_state=json.loads(_text(flat['rng_state'])),
            rows=json.loads(_text(flat['rows'])),
        )


def _text(value) -> str:
    value = np.asarray(value).item()
    return value.decode() if isinstance(value, bytes) else str(value)
