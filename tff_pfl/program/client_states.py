"""Where a run keeps its clients' states between rounds: one protocol, two stores.

Client states are pass-in/pass-out (TFF's stateful-clients pattern): the run
loop reads the sampled clients' states from a store, passes them into the
round and writes the returned ones back. `ClientStates` is what the loops
(`training_loop.run`, `decentralized.run`) and checkpoints need of a store;
`ClientStateStore` keeps the states in the driver (stacked arrays, spilled to
memory-mapped files when large); `device_store.DeviceStateStore` leaves them
on the devices as files, for rounds split over several workers.
"""

import os
import tempfile
import typing
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tff_pfl.computations import device_state, template
from tff_pfl.program import checkpoints as checkpoints_lib


@typing.runtime_checkable
class ClientStates(typing.Protocol):
    """What the run loops and checkpoints need of a store (`ClientStateStore`, `device_store.DeviceStateStore`).

    `get(client_ids) -> [state]` (a client's first read makes its initial
    state); `ids() -> [client_id]` and `all() -> [state]` of every client the
    store can return, in one order; `states() -> {client_id: state}` for the
    reports; `nbytes`, what it holds in the driver; `initialize(process) ->
    server state`; `run_round(process, state, client_ids) -> (state,
    metrics)`, one round whose new client states it keeps;
    `personalize(process, state)` and `evaluate(process, state, client_ids=None)
    -> [evaluation]` over every (or the given) client in client order;
    `changes(everything) -> checkpoints.ClientRows`, `saved()` and
    `restore(checkpoint)`, what a checkpoint writes and reads.
    """

    nbytes: int

    def get(self, client_ids: Sequence[str]) -> list:
        """The states of some clients (a client's first read makes its initial state).

        Args:
          client_ids: the clients.

        Returns:
          Their states, in `client_ids` order.
        """

    def ids(self) -> list[str]:
        """Every client the store can return.

        Returns:
          Client ids, in the store's order (that of `all()`).
        """

    def all(self) -> list:
        """Every client's state.

        Returns:
          The states, in `ids()` order.
        """

    def states(self) -> Mapping:
        """Every client's state by id, for the reports.

        Returns:
          A mapping client id -> state.
        """

    def initialize(self, process: template.PersonalizedProcess):
        """The server state a run starts from.

        Args:
          process: the algorithm.

        Returns:
          Its initial server state (of the form this store runs rounds in).
        """

    def run_round(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str]):
        """One round over some clients; keeps their new states.

        Args:
          process: the algorithm.
          state: the server state.
          client_ids: the round's clients.

        Returns:
          `(state, metrics)` after the round.
        """

    def personalize(self, process: template.PersonalizedProcess, state) -> None:
        """Runs the process's `personalize` on every client and keeps the results.

        Args:
          process: the algorithm (with a `personalize` stage).
          state: the server state.
        """

    def evaluate(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str] | None = None) -> list:
        """Each client's evaluation on its own test split.

        Args:
          process: the algorithm.
          state: the server state.
          client_ids: the clients (default every client).

        Returns:
          The evaluations, in client order.
        """

    def changes(self, everything: bool) -> checkpoints_lib.ClientRows:
        """What a checkpoint writes of the client states.

        Args:
          everything: every row, not only those changed since the last checkpoint.

        Returns:
          The rows.
        """

    def saved(self) -> None:
        """Records that a checkpoint now holds every change so far."""

    def restore(self, checkpoint: checkpoints_lib.Checkpoint) -> None:
        """Takes the client states of a checkpoint.

        Args:
          checkpoint: the checkpoint read back.
        """


# Above this many bytes of client state, the driver's store lives in a
# memory-mapped file instead of the heap.
SPILL_BYTES = 128 * 2**20

# `evaluate` and `personalize` of every client run this many clients per call,
# so neither side holds all client states (and models) at once.
CLIENTS_PER_CALL = 100


class ClientStateStore:
    """The states of the clients that have taken part, kept by the driver; pass-in/pass-out around `next`.

    The store is sparse: a client that has never taken part has no stored
    state. Its initial state is made when it is first read (the new clients of
    a call in one batched TFF call, `PersonalizedProcess.initial_client_states`)
    and stored when its first new state is put, so setup makes one TFF call
    and the store's memory grows with the clients that have taken part, not
    with the population.

    Stored states are held stacked leaf by leaf: one array of shape
    `[capacity, *leaf_shape]` per tensor of the client-state structure, a row
    per stored client in the order clients joined, grown by doubling; so the
    store costs its tensors' bytes and nothing per client, and the rows of a
    round's clients are gathered and scattered by index. Once the numeric
    leaves exceed `spill_bytes`, they live in memory-mapped files in
    `spill_dir` (unlinked at once: the mapping keeps them, and nothing is left
    behind if the process dies); the OS pages them in and out, so the driver's
    resident memory does not grow with the number of clients.

    The store remembers which clients changed since the last checkpoint
    (`changes`), so a checkpoint writes those and not every client.
    """

    def __init__(
        self,
        process: template.PersonalizedProcess,
        client_ids: Sequence[str],
        *,
        spill_dir: str | None = None,
        spill_bytes: int | None = None,
        clients_per_call: int | None = None,
    ):
        """Makes an empty store (one TFF call, for the state's structure).

        Args:
          process: the algorithm.
          client_ids: every client id.
          spill_dir: where the memory-mapped files go once the store is
            large; None: always on the heap.
          spill_bytes: size of the numeric leaves above which they spill
            (default `SPILL_BYTES`).
          clients_per_call: clients per `evaluate`/`personalize` call
            (default `CLIENTS_PER_CALL`).

        Raises:
          ValueError: if `clients_per_call` < 1 or `client_ids` is empty or
            has duplicates.
        """
        spill_bytes = SPILL_BYTES if spill_bytes is None else spill_bytes
        clients_per_call = CLIENTS_PER_CALL if clients_per_call is None else clients_per_call
        if clients_per_call < 1:
            raise ValueError(f'clients_per_call must be >= 1, got {clients_per_call}')
        self._clients_per_call = clients_per_call
        self._process = process
        self._ids = list(client_ids)
        if not self._ids or len(set(self._ids)) != len(self._ids):
            raise ValueError('a client-state store needs at least one client id and no duplicates')
        self._known = frozenset(self._ids)
        self._template = process.initial_client_state(self._ids[0])
        self._like = [np.asarray(leaf) for leaf in device_state.flatten(self._template)]
        self._row_bytes = sum(leaf.nbytes for leaf in self._like if leaf.dtype.kind not in 'SUO')
        self._spill_dir, self._spill_bytes = spill_dir, spill_bytes
        self.spilled = False
        self._rows = {}  # client id -> row, for stored clients, in the order they joined
        self._changed = set()  # ids changed since the last `saved`
        self._complete = False  # True after a checkpoint or a restore: `_changed` is all that changed
        self._capacity = 0
        self._leaves = self._allocate(0)

    def _allocate(self, capacity: int) -> list:
        """Empty leaves for `capacity` rows, memory-mapped once they are large."""
        if self._spill_dir is not None and self._row_bytes * capacity > self._spill_bytes:
            self.spilled = True
        leaves = []
        for leaf in self._like:
            if leaf.dtype.kind in 'SUO':
                leaves.append([None] * capacity)  # client ids and other strings: small
            elif self.spilled:
                os.makedirs(self._spill_dir, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self._spill_dir, prefix='client_store_', suffix='.bin') as f:
                    shape = (max(capacity, 1), *leaf.shape)  # a memory map cannot be empty
                    leaves.append(np.memmap(f.name, dtype=leaf.dtype, mode='w+', shape=shape))
            else:
                leaves.append(np.empty((capacity, *leaf.shape), leaf.dtype))
        return leaves

    def _reserve(self, count: int) -> None:
        """Room for `count` stored rows: doubles the capacity as needed, copying the rows in pieces."""
        capacity = self._capacity
        if count <= capacity:
            return
        while capacity < count:
            capacity = max(2 * capacity, 16)
        grown = self._allocate(capacity)
        used = len(self._rows)
        step = max(1, checkpoints_lib.PIECE_BYTES // max(self._row_bytes, 1))
        for old, new in zip(self._leaves, grown):
            if isinstance(old, list):
                new[:used] = old[:used]
                continue
            for start in range(0, used, step):
                new[start : min(used, start + step)] = old[start : min(used, start + step)]
        self._leaves, self._capacity = grown, capacity

    @property
    def nbytes(self) -> int:
        """Bytes of the stored clients' numeric leaves."""
        return self._row_bytes * len(self._rows)

    @property
    def num_stored(self) -> int:
        """How many clients have a stored state."""
        return len(self._rows)

    def stored_ids(self) -> list[str]:
        """The clients with a stored state, in the order they were first stored.

        Returns:
          A new list of the ids.
        """
        return list(self._rows)

    def _write(self, row: int, state) -> None:
        for leaf, value in zip(self._leaves, device_state.flatten(state)):
            leaf[row] = value

    def _read(self, row: int):
        values = (leaf[row] if isinstance(leaf, list) else _value(leaf[row]) for leaf in self._leaves)
        return device_state.fill(self._template, values)

    def _row_for(self, client_id: str) -> int:
        """The stored row of `client_id`, added (empty) if it has none."""
        row = self._rows.get(client_id)
        if row is None:
            row = len(self._rows)
            self._reserve(row + 1)
            self._rows[client_id] = row
        return row

    def get(self, client_ids: Sequence[str]) -> list:
        """The states of `client_ids`: stored ones read, the others' initial states made in one call.

        Args:
          client_ids: ids of clients of the store.

        Returns:
          One client state per id, in `client_ids` order (numeric leaves
          copied out of the store). Nothing is stored.

        Raises:
          KeyError: if an id is not a client of the store.
        """
        unknown = [c for c in client_ids if c not in self._known]
        if unknown:
            raise KeyError(unknown[0])
        new = [c for c in client_ids if c not in self._rows]
        initial = dict(zip(new, _initial_states(self._process, new))) if new else {}
        return [initial[c] if c in initial else self._read(self._rows[c]) for c in client_ids]

    def put(self, client_ids: Sequence[str], states: Sequence) -> None:
        """Stores `states` as the new states of `client_ids`.

        Args:
          client_ids: ids of clients of the store.
          states: one client state per id, in `client_ids` order.

        Raises:
          KeyError: if an id is not a client of the store.
          RuntimeError: if a state's `client_id` is not the id of its slot.
        """
        for client_id, state in zip(client_ids, states):
            if client_id not in self._known:
                raise KeyError(client_id)
            returned_id = state['client_id']
            if isinstance(returned_id, bytes):
                returned_id = returned_id.decode()
            if returned_id != client_id:
                raise RuntimeError(f'client state of {returned_id!r} returned in the slot of {client_id!r}')
            self._write(self._row_for(client_id), state)
            self._changed.add(client_id)

    def all(self) -> list:
        """The state of every client, in the store's client order (initial states where none is stored).

        Returns:
          One client state per client.
        """
        return self.get(self._ids)

    def ids(self) -> list[str]:
        """Every client id, in the store's order.

        Returns:
          A new list of the ids.
        """
        return list(self._ids)

    def states(self) -> 'StateView':
        """Client id -> client state, for every client (read as looked up).

        Returns:
          A `StateView` over the store.
        """
        return StateView(self._ids, self.get, self.stored_ids)

    def changes(self, everything: bool) -> checkpoints_lib.ClientRows:
        """The stored clients a checkpoint must write.

        Args:
          everything: every stored client (a full checkpoint), else the
            clients changed since the last checkpoint or restore.

        Returns:
          A `checkpoints.ClientRows` over the store's own arrays, read piece
          by piece as it is written; `complete` says whether the rows alone
          (without the checkpoints before) hold every stored state.
        """
        if everything or not self._complete:
            ids = list(self._rows)
        else:
            ids = [c for c in self._rows if c in self._changed]
        return checkpoints_lib.ClientRows(
            ids=ids,
            rows=np.array([self._rows[c] for c in ids], np.int64),
            leaves=self._leaves,
            complete=everything or not self._complete,
            row_bytes=self._row_bytes,
        )

    def saved(self) -> None:
        """Marks every stored state as written by a checkpoint."""
        self._changed.clear()
        self._complete = True

    def restore(self, checkpoint: checkpoints_lib.Checkpoint) -> None:
        """Puts back the stored clients' states from a checkpoint (its segments in order), leaf by leaf.

        Clients the checkpoint holds no state of go back to having none.

        Args:
          checkpoint: a checkpoint of this run.

        Raises:
          ValueError: if a stored numeric leaf's shape or dtype differs from
            the store's, or a stored client is not a client of the run.
        """
        self._rows, self._changed = {}, set()
        self._capacity, self._leaves = 0, self._allocate(0)
        for segment in checkpoint.segments():
            ids = segment.ids()
            unknown = [c for c in ids if c not in self._known]
            if unknown:
                raise ValueError(f'{segment.path}: client {unknown[0]!r} is not a client of this run')
            rows = np.array([self._row_for(c) for c in ids], np.int64)
            for i, leaf in enumerate(self._leaves):
                if isinstance(leaf, list):
                    for row, value in zip(rows, segment.leaf(i).tolist()):
                        leaf[row] = value
                else:
                    segment.read_leaf(i, leaf, rows)
        self._complete = True

    def initialize(self, process: template.PersonalizedProcess):
        """The initial server state of `process`.

        Args:
          process: the algorithm.

        Returns:
          The result of `process.initialize()`.
        """
        return process.initialize()

    def run_round(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str]):
        """One `next` over `client_ids`; stores their new states and returns `(state, metrics)`.

        Args:
          process: the algorithm.
          state: the server state before the round.
          client_ids: the round's clients.

        Returns:
          `(new server state, round metrics)`.
        """
        output = process.next(state, self.get(client_ids))
        self.put(client_ids, output.client_states)
        return output.state, output.metrics

    def run_rounds(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str], count: int):
        """`count` rounds over the same clients in one TFF call (`process.several_rounds`); stores their states.

        The numbers are those of `count` calls of `run_round` over
        `client_ids`.

        Args:
          process: the algorithm.
          state: the server state before the first round.
          client_ids: every round's clients.
          count: the rounds, at least 1.

        Returns:
          `(server state after the last round, [metrics of each round])`.
        """
        if count == 1:
            state, metrics = self.run_round(process, state, client_ids)
            return state, [metrics]
        output = process.several_rounds(count)(state, self.get(client_ids))
        self.put(client_ids, output.client_states)
        return output.state, list(output.metrics)

    def chunks(self, client_ids: Sequence[str] | None = None) -> list:
        """`client_ids` (default: every client) in pieces of `clients_per_call`.

        Args:
          client_ids: the clients to cut; None: every client.

        Returns:
          A list of lists of ids.
        """
        ids = self._ids if client_ids is None else list(client_ids)
        step = self._clients_per_call
        return [ids[i : i + step] for i in range(0, len(ids), step)]

    def personalize(
        self, process: template.PersonalizedProcess, state, client_ids: Sequence[str] | None = None
    ) -> None:
        """Runs `process.personalize` on `client_ids` (default every client) and stores the new states.

        Clients go in chunks of `clients_per_call` per call.

        Args:
          process: the algorithm; it has a `personalize` stage.
          state: the server state.
          client_ids: the clients to personalize; None: every client.
        """
        for chunk in self.chunks(client_ids):
            self.put(chunk, process.personalize(state, self.get(chunk)))

    def evaluate(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str] | None = None) -> list:
        """Runs `process.evaluate` on `client_ids` (default every client), `clients_per_call` per call.

        Args:
          process: the algorithm.
          state: the server state.
          client_ids: the clients to evaluate; None: every client.

        Returns:
          One evaluation result per client, in `client_ids` order.
        """
        results = []
        for chunk in self.chunks(client_ids):
            results.extend(process.evaluate(state, self.get(chunk)))
        return results


def _initial_states(process, client_ids: Sequence[str]) -> list:
    """`process`'s initial states of `client_ids`: one batched call where the process has it."""
    batched = getattr(process, 'initial_client_states', None)
    if batched is not None:
        return batched(client_ids)
    return [process.initial_client_state(c) for c in client_ids]


def _value(leaf):
    """A stored row as a fresh array (numpy scalar for rank 0)."""
    leaf = np.array(leaf)
    return leaf[()] if leaf.ndim == 0 else leaf


class StateView(Mapping):
    """Read-only client id -> client state, built on lookup (no copy of the store)."""

    def __init__(
        self,
        client_ids: Sequence[str],
        get: Callable[[Sequence[str]], list],
        stored_ids: Callable[[], Sequence[str]] | None = None,
    ):
        self._ids, self._get, self._stored_ids = list(client_ids), get, stored_ids
        self._known = frozenset(self._ids)

    def __getitem__(self, client_id):
        if client_id not in self._known:
            raise KeyError(client_id)
        return self._get([client_id])[0]

    def __iter__(self):
        return iter(self._ids)

    def __len__(self):
        return len(self._ids)

    def _batches(self):
        # Every client's state, read `CLIENTS_PER_CALL` at a time: clients
        # without a stored state get their initial states in one call per batch.
        for start in range(0, len(self._ids), CLIENTS_PER_CALL):
            ids = self._ids[start : start + CLIENTS_PER_CALL]
            yield from zip(ids, self._get(ids))

    def values(self):
        """Every client's state, in client order, read in batches.

        Returns:
          An iterator over the states.
        """
        return (state for _, state in self._batches())

    def items(self):
        """`(client id, state)` of every client, in client order, read in batches.

        Returns:
          An iterator over the pairs.
        """
        return self._batches()

    def fields(self, names: Sequence[str]) -> dict:
        """Some fields of every client's state, as arrays over the clients in client order.

        A client without a stored state has its initial state. When the view
        knows which clients are stored, and two such clients' initial states
        (the first and the last) agree on `names`, every unstored client gets
        those values: one call instead of one per `CLIENTS_PER_CALL` clients,
        which at 1,000,000 clients is most of the cost. Otherwise every state
        is read in batches.

        Args:
          names: keys of the client state, each a tensor (or scalar) leaf.

        Returns:
          `{name: np.ndarray [num_clients, ...]}`.
        """
        stored = set(self._stored_ids()) if self._stored_ids is not None else None
        if stored is not None and len(self._ids) - len(stored & self._known) >= 2:
            fresh = [c for c in self._ids if c not in stored]
            first, last = self._get([fresh[0], fresh[-1]])
            if all(np.array_equal(np.asarray(first[n]), np.asarray(last[n])) for n in names):
                out = {n: np.repeat(np.asarray(first[n])[None], len(self._ids), axis=0) for n in names}
                positions = [i for i, c in enumerate(self._ids) if c in stored]
                for start in range(0, len(positions), CLIENTS_PER_CALL):
                    rows = positions[start : start + CLIENTS_PER_CALL]
                    for row, state in zip(rows, self._get([self._ids[r] for r in rows])):
                        for n in names:
                            out[n][row] = np.asarray(state[n])
                return out
        values = {n: [] for n in names}
        for _, state in self._batches():
            for n in names:
                values[n].append(np.asarray(state[n]))
        return {n: np.stack(v) if v else np.zeros((0,)) for n, v in values.items()}
