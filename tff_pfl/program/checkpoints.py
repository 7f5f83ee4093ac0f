"""Checkpoints of a run: a small manifest per checkpointed round plus client-state segments, written atomically.

A checkpoint holds everything the run loop needs to continue as if it had
never stopped: the round number, the server state, the stored client states,
the client-sampling generator's state, and the metrics rows so far. Training
randomness needs nothing more: every client's batch order and every seeded
draw inside the computations derive from (run seed, round number, client id).

Client states are written as segments (`clients_<round>.npz`: the ids of the
clients it holds and their states stacked leaf by leaf). A checkpoint writes
one segment with the clients whose state changed since the previous
checkpoint, and its manifest (`round_<round>.npz`: round, server state,
sampling state, rows, every client id of the run, and the names of the
segments to apply in order) names the earlier segments it builds on. So the
cost of a checkpoint follows the clients that took part since the last one,
not the population. When the chain of segments would hold more than
`COMPACT_RATIO` times the bytes of the stored states, a full segment of every
stored client starts a new chain. A client that is in no segment has no stored
state (it has not taken part).

Every file is written to a temporary name, flushed to disk and renamed into
place (`os.replace`), segments before the manifest that names them, so a crash
while writing leaves the last good checkpoint intact; the newest two manifests
are kept, with the segments they name.

Loading checks a checkpoint whole before using it (`check_archive`): every
member of the manifest and of each segment it names is read and its CRC-32
compared, and the zip directory must account for every byte before it. A
damaged checkpoint (empty, truncated, a flipped byte, a missing or damaged
segment) is skipped for the newest intact one, and set aside (renamed
`<name>.damaged`) so that it is neither chosen again nor counted among the
kept ones; if none is intact, loading refuses (`CheckpointError`) and touches
nothing. (`tff.program`'s
FileProgramStateManager does the same with SavedModel directories, but each
save made the driver's memory grow: benchmarks/results/memory_rounds.md.)

Nested values are flattened in TFF's structure order into one flat
`OrderedDict` of arrays (no empty containers, which SavedModel does not keep),
and client states are stacked leaf by leaf over clients, so the number of
saved tensors does not grow with the number of clients; numeric leaves are
written and read in pieces of at most `PIECE_BYTES`, so a memory-mapped store
is never copied whole. Loading rebuilds the structures from templates: the
process's initial server state and a client's initial state. A checkpoint of
an earlier version (every client's state inside the manifest) loads as a
manifest with one full segment, itself.
"""

import collections
import dataclasses
import json
import os
import re
import struct
import zipfile
from collections.abc import Mapping, Sequence

import numpy as np

from tff_pfl.computations import device_state

KEEP = 2
# A new full segment once the chain would exceed this many times the stored states' bytes.
COMPACT_RATIO = 2.0
_NAME = re.compile(r'^round_(\d+)\.npz$')
_SEGMENT = re.compile(r'^clients_(\d+)\.npz$')
_CLIENT_LEAF = re.compile(r'^client_(\d{4})$')

# Numeric client leaves are written and read in pieces of at most this many
# bytes, from and into the store's arrays (which may be memory-mapped).
PIECE_BYTES = 16 * 2**20

# A damaged checkpoint's files are renamed to `<name>` + this (never read, never deleted).
DAMAGED_SUFFIX = '.damaged'


class CheckpointError(ValueError):
    """A run directory has checkpoints but none of them is intact."""


class DamagedFile(Exception):
    """A checkpoint file that cannot be read whole; the message says why."""


@dataclasses.dataclass(frozen=True)
class Damage:
    """A checkpoint skipped because it cannot be read.

    Attributes:
      path: its manifest (`round_<N>.npz`).
      why: what is wrong, naming the segment if the damage is in one.
      files: the damaged files (the manifest, a segment, or both); those
        present are set aside.
    """

    path: str
    why: str
    files: tuple[str, ...]

    def __str__(self) -> str:
        return f'checkpoint {self.path} is unreadable ({self.why})'


def check_archive(path: str) -> None:
    """Reads every member of the `.npz` at `path` in full; raises `DamagedFile` unless it is intact.

    Each member's CRC-32 (`zipfile.ZipFile.testzip`) covers its bytes; the
    layout check (each member starts where the previous one ends, and the
    last ends where the zip directory starts) catches a directory that no
    longer lists every member. What neither covers (timestamps, attributes,
    unused size fields) does not change what is read.

    Args:
      path: the file.

    Raises:
      DamagedFile: if the file is missing, empty, truncated, not a zip, or
        a member's bytes or the directory are damaged.
    """
    try:
        if os.path.getsize(path) == 0:
            raise DamagedFile('empty file')
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            if bad is not None:
                raise DamagedFile(f'bad CRC-32 in {bad}')
            _check_layout(archive)
    except FileNotFoundError:
        raise DamagedFile('missing') from None
    except zipfile.BadZipFile as e:
        why = 'truncated or not a zip file' if str(e) == 'File is not a zip file' else f'damaged zip: {e}'
        raise DamagedFile(why) from None
    except DamagedFile:
        raise
    except Exception as e:  # a damaged file fails in many ways (struct.error, OverflowError, ...)
        raise DamagedFile(f'{type(e).__name__}: {e}') from None


def _check_layout(archive: zipfile.ZipFile) -> None:
    """Raises `DamagedFile` unless the members fill the file up to the zip directory, in order."""
    infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
    if any(info.flag_bits & 0x08 for info in infos):
        return  # data descriptors after the members (not written here): sizes are in the directory only
    end = 0
    for info in infos:
        if info.header_offset != end:
            raise DamagedFile(f'zip directory does not match the members (at {info.filename})')
        archive.fp.seek(info.header_offset)
        header = archive.fp.read(30)
        name_bytes, extra_bytes = struct.unpack('<HH', header[26:30])
        end = info.header_offset + 30 + name_bytes + extra_bytes + info.compress_size
    if end != archive.start_dir:
        raise DamagedFile('zip directory does not list every member')


def _scalar(value):
    """0-d arrays as numpy scalars (dtype kept), others as they are."""
    value = np.asarray(value)
    return value[()] if value.ndim == 0 else value


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


@dataclasses.dataclass(frozen=True)
class ClientRows:
    """Client states for a checkpoint to write: rows of stacked leaves.

    Attributes:
      ids: the clients, in segment order.
      rows: each client's row in `leaves`.
      leaves: one array (or list, for strings) per leaf of the client-state
        structure, `[capacity, ...]`; only `rows` are read.
      complete: True if these clients are every stored client (a full
        segment), False if they are the changes since the previous checkpoint.
      row_bytes: bytes of one client's numeric leaves.
    """

    ids: Sequence[str]
    rows: np.ndarray
    leaves: Sequence
    complete: bool
    row_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes of these clients' numeric leaves."""
        return self.row_bytes * len(self.ids)

    @classmethod
    def from_states(cls, client_states: Mapping) -> 'ClientRows':
        """Every client of `client_states`, as one full segment.

        Args:
          client_states: client id -> client state, at least one.

        Returns:
          A complete `ClientRows` of `stack_states(client_states)`.
        """
        ids, leaves = stack_states(client_states)
        row_bytes = sum(leaf[0].nbytes for leaf in leaves if leaf.dtype.kind not in 'SUO')
        return cls(ids=ids, rows=np.arange(len(ids)), leaves=leaves, complete=True, row_bytes=row_bytes)


def _write_array(archive: zipfile.ZipFile, name: str, array) -> None:
    with archive.open(f'{name}.npy', 'w', force_zip64=True) as f:
        np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)


def _write_rows(archive: zipfile.ZipFile, name: str, leaf, rows: np.ndarray, row_bytes: int) -> None:
    """Writes `leaf[rows]` as `name.npy`, gathering at most `PIECE_BYTES` at a time."""
    if isinstance(leaf, list):
        _write_array(archive, name, np.array([leaf[r] for r in rows]))
        return
    header = {
        'descr': np.lib.format.dtype_to_descr(leaf.dtype),
        'fortran_order': False,
        'shape': (len(rows), *leaf.shape[1:]),
    }
    step = max(1, PIECE_BYTES // max(1, leaf[0].nbytes if len(leaf) else row_bytes))
    with archive.open(f'{name}.npy', 'w', force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        for start in range(0, len(rows), step):
            f.write(np.ascontiguousarray(leaf[rows[start : start + step]]).tobytes())


def _write_npz(path: str, arrays: Mapping, clients: ClientRows | None = None) -> None:
    """Writes an `.npz` (readable by `np.load`) atomically: temporary file, fsync, rename."""
    temporary = f'{path}.tmp'
    with open(temporary, 'wb') as f:
        with zipfile.ZipFile(f, 'w', zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                _write_array(archive, name, array)
            if clients is not None:
                for i, leaf in enumerate(clients.leaves):
                    _write_rows(archive, f'client_{i:04d}', leaf, clients.rows, clients.row_bytes)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


class Segment(collections.namedtuple('Segment', ['path', 'ids_key'])):
    """One file of client states: the ids it holds (under `ids_key`) and `client_XXXX` leaves.

    Attributes:
      path: the file.
      ids_key: the archive key of its client ids (`ids`; `client_ids` in a
        checkpoint of an earlier version, whose manifest held every client).
    """

    def ids(self) -> list[str]:
        """The clients whose states the segment holds, in its row order.

        Returns:
          A list of client ids.
        """
        with np.load(self.path, allow_pickle=False) as archive:
            return [c.decode() if isinstance(c, bytes) else str(c) for c in archive[self.ids_key].tolist()]

    def leaf(self, index: int) -> np.ndarray:
        """Client leaf `index`, `[num_clients, ...]`, read whole.

        Args:
          index: the leaf's position in the client state's flattened
            structure.

        Returns:
          The leaf of every client of the segment, in its row order.
        """
        with np.load(self.path, allow_pickle=False) as archive:
            return archive[f'client_{index:04d}']

    def read_leaf(self, index: int, out, rows: np.ndarray) -> None:
        """Reads client leaf `index` into `out[rows]`, piece by piece.

        Args:
          index: the leaf's position in the client state's flattened
            structure.
          out: the `[capacity, ...]` array to fill (may be memory-mapped).
          rows: the row of `out` for each of the segment's clients.

        Raises:
          ValueError: if the stored leaf's shape or dtype differs from what
            `out` and `rows` need.
        """
        with zipfile.ZipFile(self.path) as archive, archive.open(f'client_{index:04d}.npy') as f:
            shape, fortran_order, dtype = _npy_header(f)
            needed = (len(rows), *out.shape[1:])
            if tuple(shape) != needed or dtype != out.dtype or fortran_order:
                raise ValueError(
                    f'{self.path}: client leaf {index} is {dtype}{list(shape)}, the run needs {out.dtype}{list(needed)}'
                )
            row_bytes = max(1, out[0].nbytes)
            step = max(1, PIECE_BYTES // row_bytes)
            for start in range(0, shape[0], step):
                count = min(step, shape[0] - start)
                data = f.read(count * row_bytes)
                out[rows[start : start + count]] = np.frombuffer(data, dtype).reshape((count, *shape[1:]))


class Checkpoint(
    collections.namedtuple(
        'Checkpoint',
        ['round_num', 'server_state', 'client_ids', 'rng_state', 'rows', 'path', 'segment_paths', 'skipped'],
        defaults=((),),
    )
):
    """A loaded checkpoint; the client states stay in their segments until read.

    Attributes:
      round_num: the last round it includes.
      server_state: the server state after that round.
      client_ids: every client id of the run.
      rng_state: the sampling generator's `bit_generator.state`.
      rows: the metrics rows of rounds 1..round_num.
      path: the manifest's file.
      segment_paths: the client-state segments, in the order they apply
        (a later one's state of a client replaces an earlier one's).
      skipped: a `Damage` per newer checkpoint that was skipped, newest
        first.
    """

    def segments(self) -> list[Segment]:
        """The client-state segments, in the order they apply.

        Returns:
          A list of `Segment`s.
        """
        return [Segment(p, 'client_ids' if p == self.path else 'ids') for p in self.segment_paths]

    def client_states(self, client_template) -> collections.OrderedDict:
        """Client id -> client state, every stored client (read whole; for small stores).

        Args:
          client_template: one client state of the run's process.

        Returns:
          Client id -> client state of `client_template`'s structure, for the
          clients the segments hold, in the order they first appear.
        """
        num_client = len(device_state.flatten(client_template))
        states = collections.OrderedDict()
        for segment in self.segments():
            stacked = [segment.leaf(i) for i in range(num_client)]
            for j, c in enumerate(segment.ids()):
                states[c] = device_state.fill(client_template, iter([_scalar(leaf[j]) for leaf in stacked]))
        return states


class RunCheckpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: str):
        self.directory = directory
        self._chain = None  # [(segment name, bytes of its states)] of the newest manifest, once known

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

    def wants_everything(self, changed_bytes: int, stored_bytes: int) -> bool:
        """Whether the next checkpoint should write every stored client (start a new chain).

        Args:
          changed_bytes: bytes of the clients changed since the last
            checkpoint.
          stored_bytes: bytes of every stored client.

        Returns:
          True if no chain is known (no checkpoint saved or loaded by this
          object) or the chain with the changes would exceed `COMPACT_RATIO`
          times `stored_bytes`.
        """
        if self._chain is None:
            return True
        return sum(size for _, size in self._chain) + changed_bytes > COMPACT_RATIO * max(stored_bytes, 1)

    def save(
        self,
        round_num: int,
        server_state,
        client_ids: Sequence[str],
        clients: ClientRows,
        rng_state: Mapping,
        rows: Sequence[Mapping],
    ) -> None:
        """Writes the checkpoint of round `round_num` (atomically) and drops older ones beyond the newest two.

        Args:
          round_num: the round just finished.
          server_state: the server state after it.
          client_ids: every client id of the run.
          clients: the client states to write: every stored client
            (`complete`), or those changed since the previous checkpoint
            saved or loaded by this object.
          rng_state: the sampling generator's `bit_generator.state`.
          rows: the metrics rows so far (JSON-serializable values).

        Raises:
          ValueError: if `clients` is not complete and no earlier checkpoint
            is known to build on.
        """
        if not clients.complete and self._chain is None:
            raise ValueError('a checkpoint of changed clients needs the previous checkpoint to build on')
        os.makedirs(self.directory, exist_ok=True)
        chain = [] if clients.complete else list(self._chain)
        if clients.ids or clients.complete:
            name = f'clients_{int(round_num)}.npz'
            path = os.path.join(self.directory, name)
            _write_npz(path, {'ids': np.array([c.encode() for c in clients.ids], dtype=bytes)}, clients)
            chain.append((name, clients.nbytes))
        flat = collections.OrderedDict(
            round_num=np.int64(round_num),
            client_ids=np.array([c.encode() for c in client_ids]),
            rng_state=np.array(json.dumps(rng_state)),
            rows=np.array(json.dumps(list(rows))),
            segments=np.array(json.dumps(chain)),
        )
        for i, leaf in enumerate(device_state.flatten(server_state)):
            flat[f'server_{i:04d}'] = np.asarray(leaf)
        _write_npz(self._path(int(round_num)), flat)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._chain = chain
        self._drop_old()

    def _manifest_segments(self, round_num: int) -> list[tuple[str, int]]:
        """`(name, bytes of its states)` of each segment the manifest of `round_num` applies.

        An earlier version's manifest is its own only segment, with bytes -1.
        """
        path = self._path(round_num)
        with np.load(path, allow_pickle=False) as archive:
            if 'segments' not in archive.files:
                return [(os.path.basename(path), -1)]
            return [(name, int(size)) for name, size in json.loads(_text(archive['segments']))]

    def _drop_old(self) -> None:
        """Removes manifests beyond the newest `KEEP`, and segments and temporary files no manifest needs.

        A kept manifest that cannot be read (damaged since it was written)
        keeps every segment: what it needs is unknown.
        """
        rounds = self.rounds()
        for old in rounds[:-KEEP]:
            os.remove(self._path(old))
        needed = set()
        for round_num in rounds[-KEEP:]:
            try:
                needed.update(name for name, _ in self._manifest_segments(round_num))
            except Exception:  # a damaged manifest: the next load skips it; delete no segment now
                needed = None
                break
        for name in os.listdir(self.directory):
            if (needed is not None and _SEGMENT.match(name) and name not in needed) or name.endswith('.npz.tmp'):
                os.remove(os.path.join(self.directory, name))

    def latest_round(self) -> int | None:
        """The newest round that has a complete checkpoint, or None if none has.

        Returns:
          The round number, or None.
        """
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def _verify(self, round_num: int, num_server: int | None):
        """`(manifest arrays, chain)` of the checkpoint of `round_num` if it can be read whole, else its `Damage`.

        The manifest and every segment it names are read in full
        (`check_archive`); the manifest must hold its fields (and
        `num_server` server leaves, if given) and its own round, and every
        segment its ids and the same client leaves, one row per id.
        """
        path = self._path(round_num)
        try:
            check_archive(path)
            with np.load(path, allow_pickle=False) as archive:
                flat = {key: archive[key] for key in archive.files if not _CLIENT_LEAF.match(key)}
            needed = ['round_num', 'client_ids', 'rng_state', 'rows']
            needed += [f'server_{i:04d}' for i in range(num_server or 0)]
            missing = [key for key in needed if key not in flat]
            if missing:
                raise DamagedFile(f'it has no {missing[0]}')
            if int(flat['round_num']) != round_num:
                raise DamagedFile(f'it holds round {int(flat["round_num"])}')
            json.loads(_text(flat['rng_state']))
            json.loads(_text(flat['rows']))
            if 'segments' in flat:
                chain = [(str(name), int(size)) for name, size in json.loads(_text(flat['segments']))]
            else:  # an earlier version's manifest holds every client: its own only segment
                chain = [(os.path.basename(path), -1)]
        except DamagedFile as e:
            return Damage(path, str(e), (path,))
        except Exception as e:  # a damaged file fails in many ways
            return Damage(path, f'{type(e).__name__}: {e}', (path,))
        leaves = None
        for name, _ in chain:
            segment = os.path.join(self.directory, name)
            if not os.path.exists(segment):
                return Damage(path, f'client-state segment {name} is missing', (path,))
            try:
                if segment != path:
                    check_archive(segment)
                count = _segment_leaves(segment, 'client_ids' if segment == path else 'ids')
                if leaves is not None and count != leaves:
                    raise DamagedFile(f'it holds {count} client leaves, the segment before it {leaves}')
                leaves = count
            except DamagedFile as e:
                return Damage(path, f'client-state segment {name}: {e}', (path, segment))
            except Exception as e:  # a damaged file fails in many ways
                return Damage(path, f'client-state segment {name}: {type(e).__name__}: {e}', (path, segment))
        return flat, chain

    def _newest_intact(self, num_server: int | None):
        """`((round, arrays, chain) or None, [Damage of each newer checkpoint])`, newest first.

        Raises:
          CheckpointError: if there are checkpoints and none can be read whole.
        """
        damaged = []
        for round_num in reversed(self.rounds()):
            verified = self._verify(round_num, num_server)
            if isinstance(verified, Damage):
                damaged.append(verified)
            else:
                return (round_num, *verified), damaged
        if damaged:
            raise CheckpointError(f'no checkpoint in {self.directory} can be read: {"; ".join(map(str, damaged))}')
        return None, []

    def check(self) -> tuple[int | None, list[Damage]]:
        """The round of the newest checkpoint that can be read whole, and the damaged ones newer than it.

        Reads every file of those checkpoints in full; changes nothing.

        Returns:
          `(round or None if there is no checkpoint, [Damage, newest first])`.

        Raises:
          CheckpointError: if there are checkpoints and none can be read whole.
        """
        found, damaged = self._newest_intact(None)
        return (None if found is None else found[0]), damaged

    def load_latest(self, server_template) -> Checkpoint | None:
        """The newest checkpoint that can be read whole, or None if there is none; client states stay in segments.

        A newer checkpoint that cannot be read whole (empty, truncated, a
        damaged byte, a missing or damaged segment: `_verify`) is skipped
        and set aside: its damaged files are renamed `<name>.damaged`, so
        it is neither loaded again nor kept in place of a good one. Later
        checkpoints saved by this object build on the one loaded.

        Args:
          server_template: a server state of the run's process (for its structure).

        Returns:
          The `Checkpoint` (its `skipped` the damaged ones), or None.

        Raises:
          CheckpointError: if there are checkpoints and none can be read
            whole; then nothing is renamed or removed.
        """
        num_server = len(device_state.flatten(server_template))
        found, skipped = self._newest_intact(num_server)
        if found is None:
            return None
        round_num, flat, chain = found
        for damage in skipped:
            for damaged_file in damage.files:
                if os.path.exists(damaged_file):
                    os.replace(damaged_file, damaged_file + DAMAGED_SUFFIX)
        server_state = device_state.fill(
            server_template, iter([_scalar(flat[f'server_{i:04d}']) for i in range(num_server)])
        )
        # An earlier version's checkpoint (bytes -1): the next checkpoint writes every client.
        self._chain = None if chain[0][1] < 0 else chain
        return Checkpoint(
            round_num=int(flat['round_num']),
            server_state=server_state,
            client_ids=[c.decode() if isinstance(c, bytes) else str(c) for c in flat['client_ids'].tolist()],
            rng_state=json.loads(_text(flat['rng_state'])),
            rows=json.loads(_text(flat['rows'])),
            path=self._path(round_num),
            segment_paths=[os.path.join(self.directory, name) for name, _ in chain],
            skipped=tuple(skipped),
        )


def _npy_header(f) -> tuple:
    """`(shape, fortran_order, dtype)` of the `.npy` member open in `f`, which is left at the data."""
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return read_header(f)


def _segment_leaves(path: str, ids_key: str) -> int:
    """How many client leaves the segment at `path` holds; `DamagedFile` unless each has a row per id."""
    with zipfile.ZipFile(path) as archive:
        with archive.open(f'{ids_key}.npy') as f:
            num_ids = len(np.lib.format.read_array(f, allow_pickle=False))
        names = [name.removesuffix('.npy') for name in archive.namelist()]
        indices = sorted(int(m.group(1)) for m in map(_CLIENT_LEAF.match, names) if m)
        if indices != list(range(len(indices))):
            raise DamagedFile(f'client leaves {indices} are not numbered from 0')
        for i in indices:
            with archive.open(f'client_{i:04d}.npy') as f:
                shape = _npy_header(f)[0]
            if not shape or shape[0] != num_ids:
                raise DamagedFile(f'client_{i:04d} has shape {list(shape)} for {num_ids} clients')
    return len(indices)


def _text(value) -> str:
    value = np.asarray(value).item()
    return value.decode() if isinstance(value, bytes) else str(value)
