"""The run loop every algorithm shares: sampling, client-state store, rounds,
evaluation of every client, and release of metrics as the run goes.

The loop talks to a `template.PersonalizedProcess` only through its typed
computations, so the same loop drives every algorithm.
"""

import collections
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tff_pfl import metrics as metrics_lib
from tff_pfl.computations import device_state, template
from tff_pfl.program import checkpoints as checkpoints_lib
from tff_pfl.program import health


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many clients `sample_clients` draws without Poisson sampling.

    Args:
      num_clients: N, every client.
      fraction: share of clients per round, in (0, 1].

    Returns:
      `ceil(fraction * N)`, at least 1 (N for a fraction of 1).
    """
    if fraction >= 1.0:
        return num_clients
    return max(1, int(np.ceil(fraction * num_clients)))


def sample_clients(
    rng: np.random.Generator, client_ids: Sequence[str], fraction: float, *, poisson: bool = False
) -> list[str]:
    """Clients of one round: all of them, `ceil(fraction * n)` without replacement, or a Poisson draw.

    Args:
      rng: the run's sampling generator (its state advances).
      client_ids: every client id.
      fraction: share of clients per round, in (0, 1].
      poisson: each client takes part independently with probability
        `fraction` (the sampling DP accounting assumes); the draw may be
        empty.

    Returns:
      The sampled ids, in the order of `client_ids`.
    """
    if fraction >= 1.0:
        return list(client_ids)
    if poisson:
        return [c for c, chosen in zip(client_ids, rng.random(len(client_ids)) < fraction) if chosen]
    count = clients_per_round(len(client_ids), fraction)
    chosen = np.sort(rng.choice(len(client_ids), size=count, replace=False))
    return [client_ids[i] for i in chosen]


def flatten(nested: Mapping, prefix: str = '') -> collections.OrderedDict:
    """`{'a': {'b': 1}}` -> `{'a_b': 1}`, values as Python scalars.

    Args:
      nested: a (nested) mapping of metrics; values are array-likes.
      prefix: prepended to every flattened key.

    Returns:
      Flat key -> value, in `nested`'s order: rank-0 values as Python
      scalars, others as (nested) lists.
    """
    flat = collections.OrderedDict()
    for key, value in nested.items():
        name = f'{prefix}{key}'
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + '_'))
        else:
            value = np.asarray(value)
            flat[name] = value.item() if value.ndim == 0 else value.tolist()
    return flat


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


class DeviceStateStore:
    """Client states kept by the devices, as files in `state_dir`.

    The process runs as its `DeviceProcess`: each client's work reads its
    state from `<state_dir>/<client_id>.state` and writes the new one back,
    so rounds have the shape `(S@SERVER, D@CLIENTS) -> <S@SERVER, M@SERVER>`
    that TFF's mergeable context splits over several workers. Every worker
    must see `state_dir` at the same path (as it sees the client data).
    """

    def __init__(self, process: template.PersonalizedProcess, client_ids: Sequence[str], state_dir: str):
        """Args: the process (it must have a `device` form), every client id, and the state directory.

        Raises:
          ValueError: if the process has no device-state form, or a state
            path is not usable.
        """
        if process.device is None:
            raise ValueError('this algorithm has no device-state form')
        os.makedirs(state_dir, exist_ok=True)
        self._process = process
        self._inputs = collections.OrderedDict((c, device_state.device_input(c, state_dir)) for c in client_ids)

    def get(self, client_ids: Sequence[str]) -> list:
        """The device inputs of `client_ids` (their ids and state files).

        Args:
          client_ids: ids of clients of the store.

        Returns:
          One `device_state.device_input` per id, in `client_ids` order.
        """
        return [self._inputs[c] for c in client_ids]

    def restore(self, checkpoint: checkpoints_lib.Checkpoint) -> None:
        """Writes every client's state from a checkpoint back to its state file.

        Args:
          checkpoint: a checkpoint of this run.
        """
        for client_id, state in checkpoint.client_states(self._process.initial_client_state(self.ids()[0])).items():
            device_state.save(self._inputs[client_id]['state_file'], state)

    @property
    def nbytes(self) -> int:
        """0: the states are on the devices, and every checkpoint writes all of them."""
        return 0

    def changes(self, everything: bool) -> checkpoints_lib.ClientRows:
        """Every client's state, read from the files (a checkpoint writes all of them).

        Args:
          everything: ignored; the device files do not say what changed.

        Returns:
          A complete `checkpoints.ClientRows` of every client's state.
        """
        del everything
        return checkpoints_lib.ClientRows.from_states(self.states())

    def saved(self) -> None:
        """Nothing to remember: every checkpoint writes every client."""

    def all(self) -> list:
        """The device input of every client, in the store's client order.

        Returns:
          One `device_state.device_input` per client.
        """
        return list(self._inputs.values())

    def ids(self) -> list[str]:
        """Every client id, in the store's order.

        Returns:
          A new list of the ids.
        """
        return list(self._inputs)

    def states(self) -> dict:
        """Client id -> client state, read from the state files (initial state where none yet).

        Returns:
          A dict of every client's state, in the store's client order.
        """
        states = {}
        for client_id, device in self._inputs.items():
            initial = self._process.initial_client_state(client_id)
            if os.path.exists(device['state_file']):
                states[client_id] = device_state.load(device['state_file'], initial)
            else:
                states[client_id] = initial
        return states

    def initialize(self, process: template.PersonalizedProcess):
        """The initial server state of `process`'s device form.

        Args:
          process: the algorithm; it has a `device` form.

        Returns:
          The result of `process.device.initialize()`.
        """
        return process.device.initialize()

    def run_round(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str]):
        """One round of `process.device` over `client_ids`; the devices write their new states.

        Args:
          process: the algorithm; it has a `device` form.
          state: the server state before the round.
          client_ids: the round's clients.

        Returns:
          `(new server state, metrics)`, the metrics of every phase in one
          `OrderedDict`.
        """
        return device_state.run_round(process.device, state, self.get(client_ids))

    def personalize(self, process: template.PersonalizedProcess, state) -> None:
        """Runs `process.device.personalize` on every client; the devices write their new states.

        Args:
          process: the algorithm; it has a `device` form.
          state: the server state.
        """
        process.device.personalize(state, self.all())

    def evaluate(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str] | None = None) -> list:
        """Runs `process.device.evaluate` on `client_ids` (default every client).

        Args:
          process: the algorithm; it has a `device` form.
          state: the server state.
          client_ids: the clients to evaluate; None: every client.

        Returns:
          One evaluation result per client, in `client_ids` order.

        Raises:
          RuntimeError: if the devices' results do not name exactly the
            evaluated clients.
        """
        ids = self.ids() if client_ids is None else list(client_ids)
        return device_state.in_client_order(process.device.evaluate(state, self.get(ids)), ids)


@dataclasses.dataclass
class RunResult:
    """What a finished run returns.

    Attributes:
      state: final server state.
      client_states: client id -> final client state (a read-only
        mapping; a `StateView` reads each state from the store on lookup;
        a client that never took part reads as its initial state, made by
        a TFF call, so look it up while the run's TFF runtime is up).
      rounds: one metrics dict per round.
      clients: one dict per client: its final evaluation, flattened.
      summary: model name -> metric summary of per-client test accuracy.
      diverged_round: the round whose mean training loss was NaN or
        infinite, where the run stopped (`diverged`); None: it ran every
        round.
      warnings: what the run warned about, one line each: the pre-run
        warnings (`health.pre_run_warnings`, added by
        `experiment.run_experiment`), then the first `STALLED` and
        `DIVERGING` finding of the rounds (`health.RunMonitor`).
    """

    state: object
    client_states: Mapping
    rounds: list
    clients: list
    summary: dict
    diverged_round: int | None = None
    warnings: list = dataclasses.field(default_factory=list)


def diverged(row: Mapping) -> bool:
    """Whether a round's mean training loss is NaN or infinite.

    Args:
      row: the round's metrics row (a round that trained nobody has no
        `train_loss`).

    Returns:
      True if `train_loss` is there and not finite.
    """
    loss = row.get('train_loss')
    return loss is not None and not math.isfinite(float(loss))


def divergence_line(label: str, row: Mapping) -> str:
    """The log line of a run that stops at a diverged round (`diverged`).

    Args:
      label: the step, e.g. `round 3`.
      row: the step's metrics row.

    Returns:
      The line, without a trailing newline.
    """
    return (
        f'{label}: the mean training loss is {float(row["train_loss"])}: the run diverged and stops here; its models '
        "are evaluated as the last round's (--nostop_on_divergence trains every round)"
    )


def summarize_evaluation(
    client_ids: Sequence[str], evaluations: Sequence[Mapping], source_ids: Mapping[str, str] | None = None
):
    """Per-client rows and across-client summaries of an `evaluate` result.

    Args:
      client_ids: the evaluated clients, in the order of `evaluations`.
      evaluations: one (nested) evaluation mapping per client; every entry
        that holds an `accuracy` is a model, with its `num_examples`.
      source_ids: client id -> the client's id in its source (a user's
        `ClientData` ids, a naturally federated dataset's), added to each row
        as `source_id`; None: no such column.

    Returns:
      `(rows, summaries)`: one flat dict per client (`client_id` first, then
      `source_id` where given), and model name (e.g. 'global_model') ->
      `metrics.summarize` of its test accuracies weighted by the clients'
      test sizes.
    """
    rows = []
    for c, e in zip(client_ids, evaluations):
        row = collections.OrderedDict(client_id=c)
        if source_ids is not None:
            row['source_id'] = source_ids[c]
        row.update(flatten(e))
        rows.append(row)
    summaries = collections.OrderedDict()
    model_names = [k for k, v in evaluations[0].items() if isinstance(v, Mapping) and 'accuracy' in v]
    for model_name in model_names:
        accuracies = [float(e[model_name]['accuracy']) for e in evaluations]
        sizes = [float(e[model_name]['num_examples']) for e in evaluations]
        summaries[model_name] = metrics_lib.summarize(accuracies, sizes)
        # Self-FL's Table 1: weighted accuracy of the 10% of clients with the
        # most samples (test sizes are proportional to client sizes).
        summaries[model_name]['top_10_by_samples'] = metrics_lib.top_by_weight_mean(accuracies, sizes)
    return rows, summaries


def source_id_map(client_ids: Sequence[str], source_ids: Sequence[str] | None) -> dict | None:
    """client id -> source id, for `summarize_evaluation` (None when `source_ids` is None).

    Args:
      client_ids: every client id.
      source_ids: one source id per client, in `client_ids` order, or None.

    Returns:
      The mapping, or None.

    Raises:
      ValueError: if `source_ids` does not hold one id per client.
    """
    if source_ids is None:
        return None
    source_ids = list(source_ids)
    if len(source_ids) != len(client_ids):
        raise ValueError(f'source_ids has {len(source_ids)} ids for {len(client_ids)} clients')
    return dict(zip(client_ids, (str(s) for s in source_ids)))


def evaluation_sample(seed: int, round_num: int, num_clients: int, eval_clients: int) -> np.ndarray | None:
    """The clients an intermediate evaluation scores: a seeded sample, or None for every client.

    The draw depends only on (seed, round), not on the run's sampling
    generator, so sampled evaluation changes no training number, and a resumed
    run scores the same clients.

    Args:
      seed: the run's seed.
      round_num: the round (or interval) evaluated.
      num_clients: the population.
      eval_clients: the sample size; 0 or at least `num_clients`: every client.

    Returns:
      Sorted client indices without repetition, or None.
    """
    if not 0 < eval_clients < num_clients:
        return None
    rng = np.random.default_rng([seed, 0xE7A1, round_num])
    return np.sort(rng.choice(num_clients, size=eval_clients, replace=False))


def evaluate_all(
    process, state, store, row: dict, sample: np.ndarray | None = None, source_ids: Mapping[str, str] | None = None
):
    """Evaluates every client (or a sample of them); adds the across-client summaries to `row`.

    Args:
      process: the algorithm.
      state: the server state.
      store: the run's `ClientStateStore` or `DeviceStateStore`.
      row: the current metrics row; gets a
        `test_<model>_accuracy_<statistic>` entry per model and statistic,
        and `eval_clients`, the number of clients scored. A sample also adds
        `test_<model>_accuracy_mean_ci95`, the half-width of the 95 %
        confidence interval of the population's mean
        (`metrics.sample_mean_interval`).
      sample: indices (into `store.ids()`) of the clients to score; None:
        every client.
      source_ids: as in `summarize_evaluation`.

    Returns:
      `summarize_evaluation`'s `(client rows, summaries)` of the scored
      clients.
    """
    ids = store.ids()
    if sample is not None:
        ids = [ids[i] for i in sample]
    evaluations = store.evaluate(process, state, None if sample is None else ids)
    client_rows, summaries = summarize_evaluation(ids, evaluations, source_ids)
    row['eval_clients'] = len(ids)
    for model_name, summary in summaries.items():
        for stat in ('mean', 'weighted_mean', 'std', 'worst_10', 'best_10', 'top_10_by_samples'):
            row[f'test_{model_name}_accuracy_{stat}'] = summary[stat]
        if sample is not None:
            accuracies = [float(e[model_name]['accuracy']) for e in evaluations]
            row[f'test_{model_name}_accuracy_mean_ci95'] = metrics_lib.sample_mean_interval(
                accuracies, len(store.ids())
            )
    return client_rows, summaries


def progress_line(
    label: str, done: int, total: int, row: Mapping, summaries: Mapping, started: float, tags: Sequence[str] = ()
) -> str:
    """One progress line: training metrics, test accuracies if evaluated, time, ETA and warning tags.

    Args:
      label: e.g. `round 3/100`.
      done: steps finished.
      total: steps in the run (for the ETA).
      row: this step's metrics row (`train_loss`, `train_accuracy`, `round_seconds`).
      summaries: model name -> accuracy summary, empty when not evaluated.
      started: `time.monotonic()` at the start of the run.
      tags: `health.RunMonitor.observe`'s findings for this step
        (`STALLED: ...`, `DIVERGING: ...`), appended at the end.

    Returns:
      The line, without a trailing newline.
    """
    eta = (time.monotonic() - started) / done * (total - done)
    line = f'{label}  train_loss {row.get("train_loss", float("nan")):.4f}  '
    line += f'train_acc {row.get("train_accuracy", float("nan")):.4f}'
    for model_name, summary in summaries.items():
        line += f'  test_acc[{model_name}] {summary["mean"]:.4f}'
    line += f'  {row["round_seconds"]:.2f}s  ETA {_format_eta(eta)}'
    return ''.join([line, *(f'  {tag}' for tag in tags)])


def _format_eta(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    seconds = int(round(seconds))
    return f'{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


def save_checkpoint(
    checkpoints: checkpoints_lib.RunCheckpoints, round_num: int, state, store, rng: np.random.Generator, rows: list
) -> None:
    """Writes the checkpoint of `round_num`: the clients changed since the last one, or every stored client.

    Every stored client is written when the store asks for it (its first
    checkpoint) or when the chain of segments grows past
    `checkpoints.COMPACT_RATIO` times the stored states.

    Args:
      checkpoints: the run's checkpoints.
      round_num: the round (or interval) just finished.
      state: the server state after it.
      store: the run's `ClientStateStore` or `DeviceStateStore`.
      rng: the run's sampling generator.
      rows: the metrics rows so far.
    """
    clients = store.changes(everything=False)
    if not clients.complete and checkpoints.wants_everything(clients.nbytes, store.nbytes):
        clients = store.changes(everything=True)
    checkpoints.save(round_num, state, store.ids(), clients, rng.bit_generator.state, rows)
    store.saved()


def resume(
    checkpoints: checkpoints_lib.RunCheckpoints | None,
    state,
    store,
    rng: np.random.Generator,
    client_ids: Sequence[str],
    last: int,
    unit: str,
    log: Callable[[str], None],
    on_resume: Callable[[int, list], None] | None,
) -> tuple:
    """Continues from the newest checkpoint that can be read whole, if there is one.

    A newer damaged checkpoint costs its rounds: it is skipped with one log
    line naming it and why, and set aside (`RunCheckpoints.load_latest`).

    Args:
      checkpoints: the run's checkpoints (None: none).
      state: the initial server state (for its structure).
      store: the client-state store; its states are overwritten.
      rng: the run's generator; its state is overwritten.
      client_ids: every client id of this run.
      last: the run's last round (or interval).
      unit: 'round' or 'interval', for the messages.
      log: as in `run`.
      on_resume: as in `run`.

    Returns:
      `(server state, metrics rows so far, first round to run)`.

    Raises:
      ValueError: if the checkpoint belongs to another run.
      checkpoints.CheckpointError: if there are checkpoints and none can be
        read whole.
    """
    restored = checkpoints.load_latest(state) if checkpoints is not None else None
    if restored is None:
        return state, [], 1
    if restored.round_num >= last or restored.client_ids != list(client_ids):
        raise ValueError(
            f'the checkpoint of {unit} {restored.round_num} in {checkpoints.directory} does not belong to this run'
        )
    store.restore(restored)
    rng.bit_generator.state = restored.rng_state
    rows = list(restored.rows)
    for damage in restored.skipped:  # one line each; set aside by `load_latest`
        aside = ', '.join(os.path.basename(f) + checkpoints_lib.DAMAGED_SUFFIX for f in damage.files)
        log(f'{damage}; skipped (kept as {aside}), resuming from the checkpoint of {unit} {restored.round_num}')
    log(f'resuming after {unit} {restored.round_num} (checkpoint in {checkpoints.directory})')
    if on_resume is not None:
        on_resume(restored.round_num, rows)
    return restored.server_state, rows, restored.round_num + 1


def run(
    process: template.PersonalizedProcess,
    client_ids: Sequence[str],
    *,
    rounds: int,
    client_fraction: float,
    seed: int,
    eval_every: int = 0,
    on_round: Callable[[Mapping], None] | None = None,
    log: Callable[[str], None] = print,
    device_state_dir: str | None = None,
    checkpoints: checkpoints_lib.RunCheckpoints | None = None,
    checkpoint_every: int = 0,
    on_resume: Callable[[int, list], None] | None = None,
    spill_dir: str | None = None,
    poisson_sampling: bool = False,
    privacy: Callable[[int], Mapping] | None = None,
    eval_clients: int = 0,
    stop_on_divergence: bool = False,
    num_classes: int | None = None,
    source_ids: Sequence[str] | None = None,
) -> RunResult:
    """Trains for `rounds` rounds, evaluating every client as it goes.

    Args:
      process: the algorithm.
      client_ids: every client of the partition.
      rounds: number of training rounds.
      client_fraction: share of clients sampled per round.
      seed: seeds client sampling (independently of training randomness).
      eval_every: evaluate all clients every this many rounds (0: only at the
        end); the last round is always evaluated.
      After the last round, a process with a `personalize` stage runs it on
      every client before the final evaluation.
      on_round: called with each round's metrics row (e.g. to append CSV).
      log: receives one progress line per round.
      device_state_dir: if given, the client states stay on the devices as
        files in this directory (`DeviceStateStore`), and the rounds run as
        the process's `DeviceProcess` (needed to split them over several
        workers); default: the driver keeps them (`ClientStateStore`).
      checkpoints: where the run's checkpoints live; if it holds one, the
        run continues after its round, with its server state, client states,
        sampling state and metrics rows, and gives the numbers an
        uninterrupted run gives.
      checkpoint_every: write a checkpoint after every this many rounds
        (0: never); never after the last round, whose results follow at once.
      on_resume: called with the round resumed after and the restored rows.
      spill_dir: where the driver's client-state store is memory-mapped
        once it exceeds `SPILL_BYTES` (None: it stays on the heap).
      poisson_sampling: sample clients by `sample_clients(poisson=True)`. A
        round that draws no client uploads nothing and changes nothing
        (`num_clients` 0 in its row).
      privacy: `round -> columns` added to each round's row (the privacy
        spent after that round, `dp_epsilon`).
      eval_clients: evaluations before the last round score a seeded sample
        of this many clients (`evaluation_sample`), with a confidence
        interval of the mean; 0: every client. The last round always scores
        every client.
      stop_on_divergence: a round whose mean training loss is NaN or
        infinite (`diverged`) becomes the last: the clients are personalized
        and evaluated as after the last round, and the run stops there
        (`RunResult.diverged_round`).
      num_classes: the data's classes, for `health.RunMonitor`'s checks
        against chance and a uniform guess (None: only the growth of the
        training loss is checked).
      source_ids: the clients' own ids in their source, one per client in
        `client_ids` order (`ClientDataSpec.source_ids`: a user's
        `ClientData` ids, kept by `tff_pfl.data.federated`): each row of
        `RunResult.clients` then carries its client's as `source_id`.
        None: rows carry `client_id` only.

    Returns:
      A `RunResult`.

    Raises:
      ValueError: if `source_ids` does not hold one id per client.
    """
    source_map = source_id_map(client_ids, source_ids)
    rng = np.random.default_rng([seed, 0x5A3D])
    if device_state_dir is None:
        store = ClientStateStore(process, client_ids, spill_dir=spill_dir)
    else:
        store = DeviceStateStore(process, client_ids, device_state_dir)
    state = store.initialize(process)
    started = time.monotonic()
    state, rows, first_round = resume(checkpoints, state, store, rng, client_ids, rounds, 'round', log, on_resume)
    monitor = health.RunMonitor(rounds, num_classes)
    monitor.replay(rows)
    diverged_round = None
    for round_num in range(first_round, rounds + 1):
        round_start = time.monotonic()
        sampled = sample_clients(rng, client_ids, client_fraction, poisson=poisson_sampling)
        if sampled:
            state, round_metrics = store.run_round(process, state, sampled)
        else:  # an empty Poisson draw: nothing to aggregate
            round_metrics = {'num_clients': 0}
        row = collections.OrderedDict(round=round_num, **flatten(round_metrics))
        if privacy is not None:
            row.update(privacy(round_num))
        row['round_seconds'] = time.monotonic() - round_start
        if stop_on_divergence and diverged(row):
            diverged_round = round_num
            log(divergence_line(f'round {round_num}', row))
        last = round_num == rounds or diverged_round is not None
        evaluate_now = last or (eval_every and round_num % eval_every == 0)
        if last and process.personalize is not None:
            log(f'personalizing {len(client_ids)} clients ...')
            personalize_start = time.monotonic()
            store.personalize(process, state)
            row['personalize_seconds'] = time.monotonic() - personalize_start
        if evaluate_now:
            sample = None if last else evaluation_sample(seed, round_num, len(client_ids), eval_clients)
            client_rows, summaries = evaluate_all(process, state, store, row, sample, source_map)
        rows.append(row)
        if on_round is not None:
            on_round(row)
        if checkpoints is not None and checkpoint_every and round_num % checkpoint_every == 0 and not last:
            save_checkpoint(checkpoints, round_num, state, store, rng, rows)
        log(
            progress_line(
                f'round {round_num}/{rounds}',
                round_num - first_round + 1,
                rounds - first_round + 1,
                row,
                summaries if evaluate_now else {},
                started,
                monitor.observe(row),
            )
        )
        if diverged_round is not None:
            break
    return RunResult(
        state=state,
        client_states=store.states(),
        rounds=rows,
        clients=client_rows,
        summary=summaries,
        diverged_round=diverged_round,
        warnings=monitor.warnings,
    )
