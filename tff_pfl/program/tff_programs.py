"""Our processes under TFF's own program loop (`tff.learning.programs.train_model`).

TFF runs production training with `train_model`: a `tff.learning.templates.LearningProcess`,
a `tff.program.FederatedDataSource` that picks each round's clients, a program state manager
that saves every round and resumes a killed run from the last one, and release managers
(CSV, TensorBoard, ...) for the metrics and the final model. This module gives it what it
takes:

- `learning_process(process)`: a `PersonalizedProcess` as a `LearningProcess`.
  A process whose clients keep nothing between rounds but their participation record
  (FedAvg; not FedBN, whose server holds only the shared layers) takes the round's client ids
  at CLIENTS: each client builds its state from its id (`initial_client_state`) inside the
  round, so nothing but ids comes in and the same aggregates as `process.next` go out.
  A process whose clients keep state (PersFL's teachers, Ditto's personal models, ...) runs as
  its device form (`process.device`): each client reads its state from a file on its device
  and writes the new one back inside its own work, so the round takes the path of each
  client's state file at CLIENTS (`<state_dir>/<client_id>/<round>.state`) and nothing
  CLIENTS-placed comes out.
- `ClientIdsDataSource`: the partition's ids, sampled per round without replacement by a
  seeded generator; its iterator is serializable, so the state manager resumes the sampling.
- `DeviceStatesDataSource`: the same sample as device inputs. Each device keeps one state
  file per round it took part in (`<state_dir>/<client_id>/<round>.state`); a round's input
  points it at a new version, seeded with its latest state from before that round, so a run
  resumed from round `r` reads what the rounds before `r` wrote and nothing a killed round did.
- `evaluate_clients(process, state, source)`: the device form's evaluation of each client's
  latest state, by id.
- `native_context(runtime)`: the asynchronous context `train_model` needs
  (`tff.program.NativeFederatedContext`) on a `runtime.LocalRuntime`'s worker.

docs/own_code.md ("TFF's program loop") has the examples; tests/test_tff_programs.py kills
runs after some rounds and resumes them to the same server state and client states as
uninterrupted ones.
"""

import collections
import contextlib
import json
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import runtime
from tff_pfl.computations import device_state, template

# A client state that holds only these fields carries nothing a later round needs.
_PARTICIPATION = ('client_id', 'num_participations', 'last_round')


def learning_process(process: template.PersonalizedProcess) -> tff.learning.templates.LearningProcess:
    """`process` as a `tff.learning.templates.LearningProcess`.

    Args:
      process: a `PersonalizedProcess`: with a global model
        (`process.has_global_model`) and a client state that is only the
        participation record (`client_id, num_participations, last_round`),
        or with a device form (`process.device`) whatever its clients keep.

    Returns:
      A `LearningProcess` whose `next` returns `LearningProcessOutput(S@SERVER,
      M@SERVER)`, its metrics under `client_work/train` as in TFF's composed
      processes (where `train_model` reads them). Without client state:
      `initialize` and `get_model_weights` / `set_model_weights` are the
      process's, and `next: (S@SERVER, {string}@CLIENTS) -> ...` runs
      `process.next` on the clients' initial states (feed it a
      `ClientIdsDataSource`). With client state: `initialize` is the device
      form's, `next: (S@SERVER, {string}@CLIENTS) -> ...` takes each
      client's state file (`<state_dir>/<client_id>/<round>.state`) and
      runs the device form's phases in order (feed it a
      `DeviceStatesDataSource`), and `get_model_weights` /
      `set_model_weights` are the process's where the device form keeps the
      process's server state, else they give and take an empty structure
      (the models are the clients': `evaluate_clients` scores them).

    Raises:
      TypeError: `process` is not a `PersonalizedProcess`.
      ValueError: one line, if its clients keep state and it has no device
        form, or they keep nothing and it has no global model (run it with
        `tff_pfl.program.training_loop.run`).
    """
    if not isinstance(process, template.PersonalizedProcess):
        raise TypeError(
            f'process must be a PersonalizedProcess (a build_*_process result), got {type(process).__name__}'
        )
    fields = [name for name, _ in tff.structure.iter_elements(process.client_state_type)]
    kept = [name for name in fields if name not in _PARTICIPATION]
    if kept:
        if process.device is None:
            raise ValueError(
                f'process: its clients keep {", ".join(kept)} between rounds and it has no device form to keep '
                'them on the devices under tff.learning.programs.train_model; run it with '
                'tff_pfl.program.training_loop.run'
            )
        return _device_learning_process(process)
    if not process.has_global_model:
        process.get_model_weights  # raises the one-line reason  # noqa: B018
    state_type = process.initialize.type_signature.result
    ids_type = tff.FederatedType(np.str_, tff.CLIENTS)

    metrics_type = process.next.type_signature.result[2].member

    @tff.tensorflow.computation(metrics_type)
    def as_composed(metrics):
        # Where TFF's composed processes put a round's training metrics, which train_model releases.
        return collections.OrderedDict(client_work=collections.OrderedDict(train=metrics))

    @tff.federated_computation(state_type, ids_type)
    def next_fn(state, client_ids):
        client_states = tff.federated_map(process.initial_client_state, client_ids)
        output = process.next(state, client_states)
        return tff.learning.templates.LearningProcessOutput(
            state=output[0], metrics=tff.federated_map(as_composed, output[2])
        )

    return tff.learning.templates.LearningProcess(
        process.initialize, next_fn, process.get_model_weights, process.set_model_weights
    )


def _device_learning_process(process: template.PersonalizedProcess) -> tff.learning.templates.LearningProcess:
    """`learning_process` of a process whose clients keep state: its device form, phases in one round."""
    device = process.device
    state_type = device.initialize.type_signature.result
    phases = list(device.phases.items())
    metrics_types = collections.OrderedDict(
        (name, phase.type_signature.result['metrics'].member) for name, phase in phases
    )

    @tff.tensorflow.computation(tff.StructWithPythonType(list(metrics_types.items()), collections.OrderedDict))
    def as_composed(metrics):
        # Every phase's metrics in one mapping (as `device_state.run_round` gives them), where TFF's
        # composed processes put a round's training metrics.
        merged = collections.OrderedDict()
        for name in metrics_types:
            for key, value in tff.structure.iter_elements(tff.structure.from_container(metrics[name])):
                merged[key] = value
        return collections.OrderedDict(client_work=collections.OrderedDict(train=merged))

    @tff.tensorflow.computation(np.str_)
    def as_device_input(state_file):
        # TFF's native program context takes only tensors at CLIENTS, so a device's input comes in as its
        # state file's path, `<state_dir>/<client_id>/<round>.state`: the client id is its directory's name.
        parts = tf.strings.split(state_file, '/')
        check = tf.debugging.assert_greater_equal(
            tf.size(parts), 3, message='a device input is a state file path <state_dir>/<client_id>/<round>.state'
        )
        with tf.control_dependencies([check]):
            return collections.OrderedDict(client_id=tf.identity(parts[-2]), state_file=tf.identity(state_file))

    @tff.federated_computation(state_type, tff.FederatedType(np.str_, tff.CLIENTS))
    def next_fn(state, state_files):
        devices = tff.federated_map(as_device_input, state_files)
        metrics = collections.OrderedDict()
        for name, phase in phases:
            output = phase(state, devices)
            state = output['state']
            metrics[name] = output['metrics']
        return tff.learning.templates.LearningProcessOutput(
            state=state, metrics=tff.federated_map(as_composed, tff.federated_zip(metrics))
        )

    if process.has_global_model and process.initialize.type_signature.result.is_equivalent_to(state_type):
        get_weights, set_weights = process.get_model_weights, process.set_model_weights
    else:
        get_weights, set_weights = _no_model_weights(state_type.member)
    return tff.learning.templates.LearningProcess(device.initialize, next_fn, get_weights, set_weights)


def _no_model_weights(server_state_type: tff.Type):
    """`get_model_weights` / `set_model_weights` of a server that holds no model: an empty structure."""
    empty = tff.StructWithPythonType([], collections.OrderedDict)

    @tff.tensorflow.computation(server_state_type)
    def get_model_weights(state):
        del state
        return collections.OrderedDict()

    @tff.tensorflow.computation(server_state_type, empty)
    def set_model_weights(state, weights):
        del weights
        return state

    return get_model_weights, set_model_weights


class ClientIdsIterator(tff.program.FederatedDataSourceIterator):
    """Each round's client ids: `k` of the partition's, without replacement, from a seeded generator.

    Round `r`'s choice depends only on the seed and `r`, so an iterator
    restored from its bytes picks what the uninterrupted one would have.
    """

    def __init__(self, client_ids: Sequence[str], seed: int, round_num: int = 0):
        self._client_ids = [str(c) for c in client_ids]
        self._seed = int(seed)
        self._round = int(round_num)

    @classmethod
    def from_bytes(cls, buffer: bytes) -> 'ClientIdsIterator':
        """The iterator `to_bytes` wrote.

        Args:
          buffer: `to_bytes`'s output.

        Returns:
          A `ClientIdsIterator` at the same round.
        """
        saved = json.loads(buffer.decode())
        return cls(saved['client_ids'], saved['seed'], saved['round'])

    def to_bytes(self) -> bytes:
        """Its state.

        Returns:
          Its ids, seed and round, as UTF-8 JSON.
        """
        return json.dumps({'client_ids': self._client_ids, 'seed': self._seed, 'round': self._round}).encode()

    @property
    def federated_type(self) -> tff.FederatedType:
        """`{string}@CLIENTS`."""
        return tff.FederatedType(np.str_, tff.CLIENTS)

    def select(self, k: int | None = None) -> list[str]:
        """The next round's client ids.

        Args:
          k: how many (None: all of them).

        Returns:
          `k` distinct ids, in the partition's order.

        Raises:
          ValueError: `k` is not between 1 and the number of clients.
        """
        count = len(self._client_ids) if k is None else k
        if not 1 <= count <= len(self._client_ids):
            raise ValueError(f'k must be between 1 and {len(self._client_ids)} (the clients), got {k}')
        generator = np.random.default_rng([self._seed, self._round])
        self._round += 1
        chosen = generator.choice(len(self._client_ids), size=count, replace=False)
        return [self._client_ids[i] for i in sorted(chosen)]

    def __eq__(self, other) -> bool:
        return isinstance(other, ClientIdsIterator) and self.to_bytes() == other.to_bytes()


class ClientIdsDataSource(tff.program.FederatedDataSource):
    """The clients of a partition as a `tff.program.FederatedDataSource` of their ids."""

    def __init__(self, client_ids: Sequence[str], seed: int = 0):
        """A source of these ids.

        Args:
          client_ids: the partition's ids (`spec.client_ids`).
          seed: fixes every round's sample.

        Raises:
          ValueError: no client ids.
        """
        if not list(client_ids):
            raise ValueError('client_ids must name at least one client')
        self._client_ids, self._seed = list(client_ids), seed

    @property
    def federated_type(self) -> tff.FederatedType:
        """`{string}@CLIENTS`."""
        return tff.FederatedType(np.str_, tff.CLIENTS)

    def iterator(self) -> ClientIdsIterator:
        """A fresh iterator.

        Returns:
          A `ClientIdsIterator` at round 0.
        """
        return ClientIdsIterator(self._client_ids, self._seed)


_VERSION = re.compile(r'^(\d{8})\.state$')


def _versions(client_dir: str) -> list[int]:
    """The rounds of the state files in a device's directory, ascending."""
    if not os.path.isdir(client_dir):
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION.match, os.listdir(client_dir)) if m)


def _version_file(client_dir: str, round_num: int) -> str:
    return os.path.join(client_dir, f'{round_num:08d}.state')


class DeviceStatesIterator(ClientIdsIterator):
    """Each round's clients as their state files, versioned by round.

    Round `r`'s input points a client at `<state_dir>/<client_id>/<r>.state`,
    first made a copy of its latest state from before round `r` (or removed,
    when it has none, so that it starts from its initial state); the
    client's work reads it and writes its new state over it. An iterator
    restored from its bytes at round `r` first removes every version from
    round `r` on (what a killed run's later rounds wrote), so the resumed run
    sees what the uninterrupted one would have. Each client keeps its
    `keep` newest versions.
    """

    def __init__(
        self,
        client_ids: Sequence[str],
        seed: int,
        state_dir: str,
        round_num: int = 0,
        keep: int = 3,
        *,
        restored: bool = True,
    ):
        super().__init__(client_ids, seed, round_num)
        self._state_dir, self._keep, self._restored, self._ready = str(state_dir), int(keep), restored, False

    @classmethod
    def from_bytes(cls, buffer: bytes) -> 'DeviceStatesIterator':
        """The iterator `to_bytes` wrote.

        Args:
          buffer: `to_bytes`'s output.

        Returns:
          A `DeviceStatesIterator` at the same round, which discards later
          versions before its first round.
        """
        saved = json.loads(buffer.decode())
        return cls(saved['client_ids'], saved['seed'], saved['state_dir'], saved['round'], saved['keep'])

    def to_bytes(self) -> bytes:
        """Its state.

        Returns:
          Its ids, seed, round, state directory and versions kept, as UTF-8 JSON.
        """
        saved = json.loads(super().to_bytes().decode())
        saved.update(state_dir=self._state_dir, keep=self._keep)
        return json.dumps(saved).encode()

    def _start(self) -> None:
        """Before the first round: a fresh run needs an empty directory; a resumed one drops later versions."""
        client_dirs = [os.path.join(self._state_dir, c) for c in self._client_ids]
        if not self._restored:
            written = [d for d in client_dirs if _versions(d)]
            if written:
                raise ValueError(
                    f'state_dir {self._state_dir!r} holds client states of an earlier run ({len(written)} clients) '
                    'but this run starts from round 0 without a saved program state; give an empty directory, or '
                    "the earlier run's program state manager to resume it"
                )
        for client_dir in client_dirs:
            for version in _versions(client_dir):
                if version >= self._round:
                    os.remove(_version_file(client_dir, version))
        self._ready = True

    def _prepare(self, client_id: str, round_num: int) -> str:
        client_dir = os.path.join(self._state_dir, client_id)
        os.makedirs(client_dir, exist_ok=True)
        target = _version_file(client_dir, round_num)
        earlier = [v for v in _versions(client_dir) if v < round_num]
        if earlier:
            temporary = f'{target}.tmp'
            with open(_version_file(client_dir, earlier[-1]), 'rb') as src, open(temporary, 'wb') as dst:
                dst.write(src.read())
            os.replace(temporary, target)
        elif os.path.exists(target):
            os.remove(target)
        for version in earlier[: max(0, len(earlier) - (self._keep - 1))]:
            os.remove(_version_file(client_dir, version))
        return target

    def select(self, k: int | None = None) -> list[str]:
        """The next round's clients' state files, prepared.

        Args:
          k: how many clients (None: all of them).

        Returns:
          `k` state file paths `<state_dir>/<client_id>/<round>.state`, in
          the partition's order.

        Raises:
          ValueError: `k` is not between 1 and the number of clients, or a
            fresh run (round 0, not restored) finds states in `state_dir`.
        """
        if not self._ready:
            self._start()
        round_num = self._round
        return [self._prepare(c, round_num) for c in super().select(k)]


class DeviceStatesDataSource(ClientIdsDataSource):
    """The clients of a partition as the paths of their state files under `state_dir`."""

    def __init__(self, client_ids: Sequence[str], state_dir: str, seed: int = 0, keep: int = 3):
        """A source of these clients.

        Args:
          client_ids: the partition's ids (`spec.client_ids`).
          state_dir: the devices' directory: `<state_dir>/<client_id>/` holds
            a client's state versions. Every worker of the run must see it at
            this path.
          seed: fixes every round's sample (the same as `ClientIdsDataSource`'s).
          keep: state versions each client keeps (at least 2: a resumed run
            reads the latest from before the round it resumes at).

        Raises:
          ValueError: no client ids, an id that is not a plain file name
            (a path separator, `.`/`..`, or a glob character `*?[]\\`), or
            `keep` below 2.
        """
        super().__init__(client_ids, seed)
        for client_id in self._client_ids:
            if client_id in ('', '.', '..') or os.sep in client_id or set(client_id) & set('*?[]\\'):
                raise ValueError(f'client_ids: {client_id!r} cannot name a device directory')
        if int(keep) < 2:
            raise ValueError(f'keep must be at least 2 (a resumed run reads an earlier version), got {keep}')
        self._state_dir, self._keep = str(state_dir), int(keep)

    def iterator(self) -> DeviceStatesIterator:
        """A fresh iterator.

        Returns:
          A `DeviceStatesIterator` at round 0, which refuses a `state_dir`
          holding states.
        """
        return DeviceStatesIterator(self._client_ids, self._seed, self._state_dir, keep=self._keep, restored=False)

    def latest(self, client_ids: Sequence[str] | None = None) -> list[collections.OrderedDict]:
        """The device inputs of clients' latest states (a client that never took part: its initial state).

        Args:
          client_ids: which clients; None: all of them.

        Returns:
          One device input per client, in `client_ids` order.

        Raises:
          ValueError: an id that is not the source's.
        """
        ids = self._client_ids if client_ids is None else [str(c) for c in client_ids]
        unknown = sorted(set(ids) - set(self._client_ids))
        if unknown:
            raise ValueError(f'client_ids: not clients of this source: {", ".join(unknown[:5])}')
        devices = []
        for client_id in ids:
            client_dir = os.path.join(self._state_dir, client_id)
            versions = _versions(client_dir)
            path = _version_file(client_dir, versions[-1]) if versions else os.path.join(client_dir, 'initial.state')
            devices.append(collections.OrderedDict(client_id=client_id, state_file=path))
        return devices


def evaluate_clients(
    process: template.PersonalizedProcess,
    state,
    source: DeviceStatesDataSource,
    client_ids: Sequence[str] | None = None,
) -> dict:
    """The device form's evaluation of clients' latest states (run it in a synchronous context).

    Args:
      process: the process `learning_process` was given (it has a device form).
      state: the device form's server state (e.g. the last one the program
        state manager saved).
      source: the run's `DeviceStatesDataSource`.
      client_ids: which clients; None: all of the source's.

    Returns:
      Client id -> its evaluation result, in `client_ids` order.

    Raises:
      ValueError: the process has no device form, or an id is not the source's.
    """
    if process.device is None:
        raise ValueError("process: it has no device form, whose evaluation reads the clients' state files")
    devices = source.latest(client_ids)
    ids = [d['client_id'] for d in devices]
    return dict(zip(ids, device_state.in_client_order(process.device.evaluate(state, devices), ids)))


@contextlib.contextmanager
def native_context(local: runtime.LocalRuntime) -> Iterator[tff.program.NativeFederatedContext]:
    """`tff.program.NativeFederatedContext` on `local`'s worker, installed while the block runs.

    Args:
      local: an open `runtime.LocalRuntime`.

    Yields:
      The context (TFF's default context inside the block; `local`'s own
      synchronous context again after it).
    """
    context = tff.program.NativeFederatedContext(runtime.async_execution_context(local.stub))
    previous = tff.framework.get_context_stack().current
    tff.framework.set_default_context(context)
    try:
        yield context
    finally:
        tff.framework.set_default_context(previous)
