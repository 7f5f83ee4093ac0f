"""The one shape every personalized algorithm of the project takes.

A `PersonalizedProcess` is a `tff.templates.IterativeProcess` with:

* `initialize: () -> S@SERVER`
* `next: (S@SERVER, {C}@CLIENTS) -> <state=S@SERVER, client_states={C}@CLIENTS,
  metrics=M@SERVER>`, one training round over the sampled clients' states;
* `initial_client_state: tf.string -> C`, a client's state before its first
  round (every state carries its `client_id`);
* `evaluate: (S@SERVER, {C}@CLIENTS) -> {E}@CLIENTS`, each client's metrics on
  its own test split, of the global model and, where the algorithm has one,
  of its personalized model;
* `personalize` (optional): a clients-only stage that yields personalized
  models into the client states, e.g. PersFL's distillation;
* `get_model_weights: S -> tff.learning.models.ModelWeights` and
  `set_model_weights: (S, ModelWeights) -> S`, as on TFF's `LearningProcess`,
  where the server state holds one global model (`has_global_model`).

Client states are pass-in/pass-out (TFF's stateful-clients pattern): the
driver keeps them in a store keyed by client id, passes the sampled clients'
states into `next` and writes the returned ones back.
"""

import collections
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

RoundOutput = collections.namedtuple('RoundOutput', ['state', 'client_states', 'metrics'])

# The process with its client states kept on the devices
# (`tff_pfl.computations.device_state`): D is `<client_id, state_file>`.
#   initialize: () -> S@SERVER (the process's own, or with room for what a
#     phase hands to the next);
#   phases: name -> (S_in@SERVER, {D}@CLIENTS) -> <state=S_out@SERVER,
#     metrics=M@SERVER>, the shape TFF's production forms and mergeable
#     context take, each from S to S; a round runs them in order
#     (`device_state.run_round`).
#     Most algorithms have one phase, `next`: one broadcast and one
#     aggregation. KT-pFL has two (`share`, then `distill`);
#   evaluate: (S@SERVER, {D}@CLIENTS) -> {<client_id, result=E>}@CLIENTS
#     (`device_state.in_client_order` puts the results in client order);
#   personalize: (S@SERVER, {D}@CLIENTS) -> {bool}@CLIENTS, or None;
#   client_computations: name -> the client-local `tff.tensorflow.computation`s
#     a device runs (its work, evaluation, personalization), for export.
DeviceProcess = collections.namedtuple(
    'DeviceProcess', ['initialize', 'phases', 'evaluate', 'personalize', 'client_computations']
)


def client_metrics(stats, extra_sums=None) -> collections.OrderedDict:
    """Per-client means from `local_training.Stats` sums (TF code).

    Args:
      stats: a `local_training.Stats` of the summed `loss_sum`, `num_correct`
        and `num_examples` of one client.
      extra_sums: optional; name -> the sum of a user's metric over the same
        examples (`local_training.metric_sums`).

    Returns:
      An `OrderedDict` of `loss` and `accuracy` (means over the examples; 0 for
      a client without examples), `num_examples`, then the extra metrics'
      means.
    """
    denominator = tf.maximum(stats.num_examples, 1.0)
    result = collections.OrderedDict(
        loss=stats.loss_sum / denominator,
        accuracy=stats.num_correct / denominator,
        num_examples=stats.num_examples,
    )
    for name, total in (extra_sums or {}).items():
        result[name] = total / denominator
    return result


def _ids_range(ids: Sequence[str]) -> str:
    """'a', 'b', 'c' or 'a' ... 'z' (n ids), for errors."""
    ids = list(ids)
    if len(ids) <= 3:
        return ', '.join(repr(i) for i in ids)
    return f'{ids[0]!r} ... {ids[-1]!r} ({len(ids)} ids)'


class PersonalizedProcess(tff.templates.IterativeProcess):
    """An `IterativeProcess` with per-client state, evaluation and personalization."""

    def __init__(
        self,
        initialize_fn: tff.Computation,
        next_fn: tff.Computation,
        *,
        initial_client_state: tff.Computation,
        evaluate: tff.Computation,
        personalize: tff.Computation | None = None,
        device: DeviceProcess | None = None,
        extras: Mapping[str, Any] | None = None,
        global_model: str | None = None,
        no_global_model: str = 'its server holds no global model',
        non_trainable: Sequence[np.ndarray] = (),
    ):
        """Builds the process; see the module docstring for the signatures.

        Args:
          initialize_fn: `() -> S@SERVER`.
          next_fn: `(S@SERVER, {C}@CLIENTS) -> <S@SERVER, {C}@CLIENTS, M@SERVER>`.
          initial_client_state: `tf.string -> C`.
          evaluate: `(S@SERVER, {C}@CLIENTS) -> {E}@CLIENTS`.
          personalize: optional clients-only stage.
          device: optional; the same algorithm with device-held client
            states (`DeviceProcess`), whose round is one or more phases
            of the shape `(S@SERVER, D@CLIENTS) -> <S@SERVER, M@SERVER>`.
          extras: what the algorithm's own report hooks read from the
            process, by name (declared by the algorithm, e.g. PersFL's
            `grid_candidates`, KT-pFL's `architectures` and `communication`).
          global_model: the field of the server state that holds the global
            model's trainable weights, in the order of the model's
            `trainable_weights` (`get_model_weights`); None: the algorithm
            has no such model.
          no_global_model: why not, when `global_model` is None (completes
            "<process> has no global model: ...").
          non_trainable: the global model's non-trainable weights, a fresh
            model's (BatchNormalization's initial statistics, as TFF's FedAvg
            server keeps them); `get_model_weights` returns them.

        Raises:
          TypeError: if the client state types of the computations disagree,
            or `global_model` is not a field of the server state.
        """
        super().__init__(initialize_fn, next_fn, next_is_multi_arg=True)
        client_state_type = initial_client_state.type_signature.result
        states_in = next_fn.type_signature.parameter[1].member
        states_out = next_fn.type_signature.result[1].member
        if not (states_in.is_equivalent_to(client_state_type) and states_out.is_equivalent_to(client_state_type)):
            raise TypeError(
                f'client state types disagree: initial {client_state_type}, '
                f'next takes {states_in} and returns {states_out}'
            )
        self._initial_client_state = initial_client_state
        self._initial_client_states = None
        self._client_ids = None  # the partition's ids (`bind_client_ids`); None: not checked
        self._source_ids = {}
        self._evaluate = evaluate
        self._personalize = personalize
        self._device = device
        self._client_state_type = client_state_type
        self._extras = types.MappingProxyType(dict(extras or {}))
        self._global_model = global_model
        self._no_global_model = no_global_model
        self._model_weights_fns = None
        self._non_trainable = [np.asarray(w) for w in non_trainable]
        self._several_rounds = {}
        if global_model is not None:
            server_state_type = initialize_fn.type_signature.result.member
            names = [name for name, _ in tff.structure.iter_elements(server_state_type)]
            if global_model not in names:
                raise TypeError(f'global_model {global_model!r} is not a field of the server state (fields {names})')

    @property
    def client_state_type(self) -> tff.Type:
        """The `tff.Type` C of one client's state."""
        return self._client_state_type

    @property
    def initial_client_state(self) -> tff.Computation:
        """The `tf.string -> C` computation of a client's first state."""
        return self._initial_client_state

    def bind_client_ids(self, client_ids: Sequence[str], source_ids: Sequence[str] | None = None) -> None:
        """Tells the process its partition's ids, for `initial_client_states` to check.

        The builders call it (`builder_inputs.checked`) with the spec's
        `client_ids` and `source_ids`.

        Args:
          client_ids: the positional ids the computations read data by.
          source_ids: optional; the user's own id of each, in the same order.
        """
        self._client_ids = tuple(client_ids)
        self._source_ids = dict(zip(source_ids, self._client_ids)) if source_ids is not None else {}

    def client_ids_of(self, client_ids: Sequence[str]) -> list[str]:
        """The positional ids of `client_ids`, each a positional id or the user's own.

        A positional id (`client_00003`) is taken as it is; the user's own id
        (`spec.source_ids`, e.g. `'store_3'`) becomes its positional id.

        Args:
          client_ids: ids of the partition the process was built for.

        Returns:
          The positional ids, in order.

        Raises:
          TypeError: `client_ids` is a string, or an id is not one.
          ValueError: no ids, or an id the partition does not have.
        """
        if isinstance(client_ids, (str, bytes)):
            raise TypeError(
                f'client_ids must be a sequence of ids, got the string {client_ids!r}; pass [{client_ids!r}]'
            )
        client_ids = list(client_ids)
        if not client_ids:
            raise ValueError('client_ids must name at least one client')
        for client_id in client_ids:
            if not isinstance(client_id, str):
                raise TypeError(f'client_ids must be strings, got {client_id!r} ({type(client_id).__name__})')
        if self._client_ids is None:
            return client_ids
        known = set(self._client_ids)
        resolved = []
        for client_id in client_ids:
            if client_id in known:
                resolved.append(client_id)
            elif client_id in self._source_ids:
                resolved.append(self._source_ids[client_id])
            else:
                yours = f', or your own ids {_ids_range(list(self._source_ids))}' if self._source_ids else ''
                raise ValueError(
                    f'client_ids: {client_id!r} is not a client of the partition the process was built for (its ids: '
                    f'{_ids_range(self._client_ids)}{yours})'
                )
        return resolved

    def initial_client_states(self, client_ids: Sequence[str]) -> list:
        """The first states of `client_ids`, made in one TFF call.

        Equal to `initial_client_state` called per client: the call maps it
        over `{tf.string}@CLIENTS` (built at the first use), so a run that
        creates the states of a round's new clients pays one call per round,
        not one per client.

        Args:
          client_ids: the clients, at least one: the partition's positional
            ids or the user's own (`client_ids_of`).

        Returns:
          One client state per id, in `client_ids` order; each holds its
          positional id.

        Raises:
          TypeError, ValueError: an id the process cannot take (`client_ids_of`).
        """
        client_ids = self.client_ids_of(client_ids)
        if self._initial_client_states is None:
            initial = self._initial_client_state

            @tff.federated_computation(tff.FederatedType(np.str_, tff.CLIENTS))
            def initial_client_states(ids):
                return tff.federated_map(initial, ids)

            self._initial_client_states = initial_client_states
        return list(self._initial_client_states(client_ids))

    def several_rounds(self, count: int) -> tff.Computation:
        """`count` rounds of `next` over the same clients, in one TFF call.

        Each round takes the state and client states the one before returned,
        so the numbers are those of `count` calls of `next`; what the call
        saves is TFF's fixed cost of a call (the state serialized to and from
        the runtime, the call's set-up on the driver and the worker;
        docs/runtime.md, "Several rounds a call"). Built at the first use of
        each `count`.

        Args:
          count: the rounds, at least 1.

        Returns:
          `(S@SERVER, {C}@CLIENTS) -> RoundOutput(state=S@SERVER,
          client_states={C}@CLIENTS, metrics=<M@SERVER, ...>)`, one metrics
          value per round, in order; for `count` 1, a call of `next` itself
          with its metrics in a one-element struct.

        Raises:
          ValueError: if `count` is below 1.
        """
        if count < 1:
            raise ValueError(f'count must be >= 1, got {count}')
        if count not in self._several_rounds:
            next_fn = self.next
            state_type, client_states_type = next_fn.type_signature.parameter

            @tff.federated_computation(state_type, client_states_type)
            def several_rounds(state, client_states):
                every_metrics = []
                for _ in range(count):
                    output = next_fn(state, client_states)
                    state, client_states = output[0], output[1]
                    every_metrics.append(output[2])
                return RoundOutput(state, client_states, every_metrics)

            self._several_rounds[count] = several_rounds
        return self._several_rounds[count]

    @property
    def evaluate(self) -> tff.Computation:
        """The `(S@SERVER, {C}@CLIENTS) -> {E}@CLIENTS` evaluation."""
        return self._evaluate

    @property
    def personalize(self) -> tff.Computation | None:
        """The clients-only personalization stage, or None."""
        return self._personalize

    @property
    def device(self) -> DeviceProcess | None:
        """The same algorithm with device-held client states, or None."""
        return self._device

    @property
    def extras(self) -> Mapping[str, Any]:
        """What the algorithm's own report hooks read, by name (read-only; empty for most)."""
        return self._extras

    @property
    def has_global_model(self) -> bool:
        """Whether the server state holds one global model (`get_model_weights`)."""
        return self._global_model is not None

    def _model_weights_computations(self):
        if self._global_model is None:
            raise ValueError(f'{type(self).__name__} has no global model: {self._no_global_model}')
        if self._model_weights_fns is None:
            field = self._global_model
            state_type = self.initialize.type_signature.result.member
            trainable_type = state_type[field]
            constants = self._non_trainable
            non_trainable_type = tff.StructWithPythonType([tff.TensorType(w.dtype, w.shape) for w in constants], list)
            weights_type = tff.StructWithPythonType(
                [('trainable', trainable_type), ('non_trainable', non_trainable_type)],
                tff.learning.models.ModelWeights,
            )

            @tff.tensorflow.computation(state_type)
            def get_model_weights(state):
                return tff.learning.models.ModelWeights(
                    trainable=state[field], non_trainable=[tf.constant(w) for w in constants]
                )

            @tff.tensorflow.computation(state_type, weights_type)
            def set_model_weights(state, weights):
                updated = collections.OrderedDict((name, state[name]) for name in state)
                updated[field] = weights.trainable
                return updated

            self._model_weights_fns = get_model_weights, set_model_weights
        return self._model_weights_fns

    @property
    def get_model_weights(self) -> tff.Computation:
        """`S -> tff.learning.models.ModelWeights`: the global model of a server state.

        As `tff.learning.templates.LearningProcess.get_model_weights`: the
        weights go to TFF's evaluation (`tff.learning.algorithms.build_fed_eval`),
        checkpoint and program tools. `trainable` is the list of the model's
        trainable weights in Keras order; `non_trainable` a fresh model's
        non-trainable weights (empty for most models; BatchNormalization's
        initial statistics, which is what TFF's FedAvg server holds).

        Raises:
          ValueError: if the algorithm has no global model (one line, why).
        """
        return self._model_weights_computations()[0]

    @property
    def set_model_weights(self) -> tff.Computation:
        """`(S, ModelWeights) -> S`: the server state with its global model replaced.

        E.g. to start from weights trained elsewhere (a `tff.learning`
        process's `get_model_weights`, or a Keras model's
        `ModelWeights.from_model`); every other part of the state is kept.

        Raises:
          ValueError: if the algorithm has no global model (one line, why).
        """
        return self._model_weights_computations()[1]


class ServerlessProcess(PersonalizedProcess):
    """A `PersonalizedProcess` without a server, run by its own loop (KD-PDFL).

    `next` is one exchange at a star node (SERVER stands for the star); the
    loop (`tff_pfl.program.decentralized`) also needs each client's local
    work between exchanges, the exchange mode, the largest neighbourhood and
    how a star's neighbours are drawn.
    """

    def __init__(
        self,
        initialize_fn: tff.Computation,
        next_fn: tff.Computation,
        *,
        local_work: tff.Computation,
        mode: str,
        max_neighbours: int,
        draw_neighbours: Callable[..., list[int]],
        **kwargs,
    ):
        """Builds the process.

        Args:
          initialize_fn: `() -> S@SERVER`.
          next_fn: one exchange, as for `PersonalizedProcess`.
          local_work: `({C}@CLIENTS, {slots: int32}@CLIENTS, slot_num@SERVER)
            -> <{C}@CLIENTS, M@SERVER>`, each client's training for its slots.
          mode: 'kdpdfl', 'fedavg' or 'local' (no exchange).
          max_neighbours: the most neighbours a star gathers (slots of `next`).
          draw_neighbours: `(rng, num_clients, star, *, mean_reachable,
            max_neighbours) -> sorted client indices`, the star's neighbours
            in one exchange (driver side, from the loop's NumPy generator).
          **kwargs: the other `PersonalizedProcess` arguments.
        """
        super().__init__(initialize_fn, next_fn, **kwargs)
        self._local_work = local_work
        self._mode = mode
        self._max_neighbours = int(max_neighbours)
        self._draw_neighbours = draw_neighbours

    @property
    def local_work(self) -> tff.Computation:
        """Each client's local training for its number of slots."""
        return self._local_work

    @property
    def mode(self) -> str:
        """'kdpdfl', 'fedavg' or 'local'."""
        return self._mode

    @property
    def max_neighbours(self) -> int:
        """The most neighbours one exchange gathers."""
        return self._max_neighbours

    def draw_neighbours(self, rng, num_clients: int, star: int, *, mean_reachable: float) -> list[int]:
        """The star's neighbours in one exchange, at most `max_neighbours`.

        Args:
          rng: the loop's NumPy generator.
          num_clients: the number of clients.
          star: the star's client index.
          mean_reachable: the expected number of reachable peers.

        Returns:
          Sorted client indices, possibly empty (the `draw_neighbours` given
          at construction).
        """
        return self._draw_neighbours(
            rng, num_clients, star, mean_reachable=mean_reachable, max_neighbours=self._max_neighbours
        )
