"""Client state kept on the device: read and written inside the client's work.

TFF's production forms (MapReduceForm, DistributeAggregateForm) and its
mergeable multi-worker context take rounds of the shape
`(S@SERVER, D@CLIENTS) -> <S@SERVER, M@SERVER>`: nothing CLIENTS-placed comes
out. A personalized algorithm's client state therefore cannot be a federated
value of the exported round. Here it is the device's own: `D` is
`<client_id, state_file>`, and the client's work reads its state from
`state_file` (or builds the initial one when the file does not exist yet),
runs the algorithm's client step and writes the new state back before it
returns what goes up for aggregation.

The file holds the state's tensors, flattened in the order of the client
state's TFF type, as one serialized `tf.string` tensor of serialized tensors
(`tf.io.serialize_tensor`). `load` reads it back in Python.
"""

import collections
import os
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

# What a device holds and the exported round takes at CLIENTS.
DEVICE_INPUT_TYPE = tff.StructWithPythonType([('client_id', np.str_), ('state_file', np.str_)], collections.OrderedDict)

_GLOB_CHARACTERS = frozenset('*?[]\\')


def device_input(client_id: str, state_dir: str) -> collections.OrderedDict:
    """The device input of `client_id` whose state lives in `state_dir`.

    Args:
      client_id: the client's id.
      state_dir: the directory of the device's state file.

    Returns:
      A `DEVICE_INPUT_TYPE` value, `<client_id, state_file>` with
      `state_file = state_dir/<client_id>.state`.

    Raises:
      ValueError: if the path has a glob character (`*?[]\\`): the device's
        existence check is a `tf.io.matching_files` pattern.
    """
    state_file = os.path.join(state_dir, f'{client_id}.state')
    bad = sorted(_GLOB_CHARACTERS.intersection(state_file))
    if bad:
        raise ValueError(
            f'client state path {state_file!r} contains {"".join(bad)!r}; '
            'device state paths may not contain * ? [ ] or \\'
        )
    return collections.OrderedDict(client_id=client_id, state_file=state_file)


def flatten(value) -> list:
    """The leaves of a (nested) client or server state, in TFF's structure order.

    Args:
      value: a nest of mappings, lists, tuples and `tff.structure.Struct`s,
        or a single leaf.

    Returns:
      The list of leaves (`[value]` for a leaf).
    """
    if isinstance(value, (Mapping, list, tuple, tff.structure.Struct)):
        return tff.structure.flatten(tff.structure.from_container(value, recursive=True))
    return [value]


def fill(template, leaves):
    """`template`'s containers (Python) with the next values of the iterator `leaves`; inverse of `flatten`.

    Args:
      template: a nest of mappings, lists, tuples and namedtuples, or a
        single leaf.
      leaves: an iterator over the new leaves, consumed in `flatten` order.

    Returns:
      `template`'s structure (mappings as `OrderedDict`s) holding the leaves.
    """
    if isinstance(template, Mapping):
        return collections.OrderedDict((k, fill(v, leaves)) for k, v in template.items())
    if isinstance(template, tuple) and hasattr(template, '_fields'):  # a namedtuple (e.g. DP aggregator states)
        return type(template)(*(fill(v, leaves) for v in template))
    if isinstance(template, (list, tuple)):
        return type(template)(fill(v, leaves) for v in template)
    return next(leaves)


def _pack(template, flat):
    return tff.structure.pack_sequence_as(tff.structure.from_container(template, recursive=True), flat)


def _serialize(state) -> tf.Tensor:
    """TF code: the state's tensors as one scalar string."""
    leaves = [tf.io.serialize_tensor(tf.convert_to_tensor(t)) for t in flatten(state)]
    return tf.io.serialize_tensor(tf.stack(leaves))


def _parse(blob, template):
    """TF code: inverse of `_serialize`, typed and shaped like `template`."""
    serialized = tf.io.parse_tensor(blob, tf.string)
    leaves = []
    for i, like in enumerate(flatten(template)):
        like = tf.convert_to_tensor(like)
        leaf = tf.io.parse_tensor(serialized[i], like.dtype)
        leaf.set_shape(like.shape)
        leaves.append(leaf)
    return _pack(template, leaves)


def read(device, initial_client_state: tff.Computation):
    """TF code: the device's client state, or the initial one if it has none yet.

    Args:
      device: `DEVICE_INPUT_TYPE` value.
      initial_client_state: `tf.string -> C`.

    Returns:
      `C`, as a `tff.structure.Struct`.
    """
    initial = initial_client_state(device['client_id'])
    exists = tf.size(tf.io.matching_files(device['state_file'])) > 0
    flat_initial = flatten(initial)
    flat = tf.cond(
        exists,
        lambda: flatten(_parse(tf.io.read_file(device['state_file']), initial)),
        lambda: [tf.identity(t) for t in flat_initial],
    )
    return _pack(initial, flat)


def write(device, client_state) -> tf.Operation:
    """TF code: the op that writes `client_state` to the device's state file.

    Args:
      device: `DEVICE_INPUT_TYPE` value.
      client_state: the client state `C` to write.

    Returns:
      The `tf.io.write_file` op.
    """
    return tf.io.write_file(device['state_file'], _serialize(client_state))


def after(op: tf.Operation, value):
    """TF code: `value` (any structure of tensors), computed only after `op` ran.

    Args:
      op: the op to wait for.
      value: a structure of tensors.

    Returns:
      `value`'s tensors, behind a control dependency on `op`, as a
      `tff.structure.Struct`.
    """
    flat = flatten(value)
    with tf.control_dependencies([op]):
        flat = [tf.identity(t) for t in flat]
    return _pack(value, flat)


def stateful(step: tff.Computation, initial_client_state: tff.Computation, leading_types: Sequence[tff.Type]):
    """Wraps a client step so that the client state is read from and written to the device.

    Args:
      step: `(*leading, client_state) -> <..., client_state=C, ...>`, a
        `tff.tensorflow.computation`.
      initial_client_state: `tf.string -> C`.
      leading_types: the types of `step`'s arguments before the client state
        (e.g. the broadcast value).

    Returns:
      `(*leading, D) -> <the other fields of step's result>`, a
      `tff.tensorflow.computation` that writes the new state to
      `D.state_file` before returning.
    """

    def body(leading, device):
        result = step(*leading, read(device, initial_client_state))
        written = write(device, result['client_state'])
        rest = collections.OrderedDict((k, result[k]) for k in _names(result) if k != 'client_state')
        return after(written, rest)

    return _with_device_arg(body, leading_types)


def stateful_update(update: tff.Computation, initial_client_state: tff.Computation, leading_types: Sequence[tff.Type]):
    """Like `stateful` for a step that returns only the new client state.

    Args:
      update: `(*leading, client_state) -> C`, a `tff.tensorflow.computation`.
      initial_client_state: `tf.string -> C`.
      leading_types: the types of `update`'s arguments before the client
        state.

    Returns:
      `(*leading, D) -> tf.bool` (True once the state is written).
    """

    def body(leading, device):
        written = write(device, update(*leading, read(device, initial_client_state)))
        with tf.control_dependencies([written]):
            return tf.constant(True)

    return _with_device_arg(body, leading_types)


def reading(fn: tff.Computation, initial_client_state: tff.Computation, leading_types: Sequence[tff.Type]):
    """`(*leading, D) -> <client_id, result=fn(*leading, the device's client state)>`, read-only.

    The result names its client: TFF 0.87's mergeable context concatenates
    the workers' CLIENTS-placed results in the order the workers finish, not
    in the order of the clients, so the driver puts them back in order by id
    (`in_client_order`).

    Args:
      fn: `(*leading, client_state) -> E`, a `tff.tensorflow.computation`; the
        state it reads is not written back.
      initial_client_state: `tf.string -> C`.
      leading_types: the types of `fn`'s arguments before the client state.

    Returns:
      A `tff.tensorflow.computation` `(*leading, D) -> <client_id, result=E>`.
    """

    def body(leading, device):
        return collections.OrderedDict(
            client_id=device['client_id'], result=fn(*leading, read(device, initial_client_state))
        )

    return _with_device_arg(body, leading_types)


def in_client_order(results: Sequence, client_ids: Sequence[str]) -> list:
    """The `result`s of a `reading` computation, in the order of `client_ids`.

    Args:
      results: the computation's per-client `<client_id, result>` values, in
        any order.
      client_ids: the clients, in the order wanted.

    Returns:
      The list of the `result`s, one per client of `client_ids`.

    Raises:
      RuntimeError: if the results do not name exactly `client_ids`.
    """
    by_id = {}
    for item in results:
        client_id = item['client_id']
        by_id[client_id.decode() if isinstance(client_id, bytes) else str(client_id)] = item['result']
    if sorted(by_id) != sorted(client_ids) or len(results) != len(client_ids):
        raise RuntimeError(f'device results name {sorted(by_id)}, expected {sorted(client_ids)}')
    return [by_id[c] for c in client_ids]


def _with_device_arg(body, leading_types):
    """`body(leading_args, device)` as a `tff.tensorflow.computation` of `(*leading_types, D)`."""
    if len(leading_types) == 1:

        @tff.tensorflow.computation(*leading_types, DEVICE_INPUT_TYPE)
        def one(a, device):
            return body([a], device)

        return one
    if len(leading_types) == 2:

        @tff.tensorflow.computation(*leading_types, DEVICE_INPUT_TYPE)
        def two(a, b, device):
            return body([a, b], device)

        return two
    raise ValueError(f'one or two arguments before the device input, got {len(leading_types)}')


# One aggregation stage of a round, of which both the device form
# (`build_device_process`) and the in-process `next` (`next_from_phases`) are made:
#   name: e.g. 'next' (the whole round) or 'share' / 'distill';
#   broadcast: `S_in -> B`, what the phase sends to every client;
#   client_step: `(B, C) -> <..., client_state=C>`, one client's work;
#   finish: `(state, outputs) -> (new_state, metrics)`, federated code: the
#     aggregation and server step from the SERVER-placed `S_in` and the
#     CLIENTS-placed outputs of `client_step` (on devices without
#     `client_state`, which the device writes to its file).
Phase = collections.namedtuple('Phase', ['name', 'broadcast', 'client_step', 'finish'])


def build_device_process(
    initialize: tff.Computation,
    initial_client_state: tff.Computation,
    *,
    phases: Sequence[Phase],
    evaluate_input: tff.Computation,
    evaluate_client: tff.Computation,
    personalize_input: tff.Computation | None = None,
    personalize_client: tff.Computation | None = None,
):
    """An algorithm's `template.DeviceProcess`, from the pieces of its round.

    Args:
      initialize: `() -> S@SERVER`, the device form's initial server state.
      initial_client_state: `tf.string -> C`.
      phases: the round's aggregation stages, in order (`Phase`); one for
        most algorithms. Each maps `S` to `S` (a MapReduceForm's `update`
        returns the state type its `prepare` takes).
      evaluate_input: `S -> V`, what evaluation sends to every client.
      evaluate_client: `(V, C) -> E`.
      personalize_input: optional, `S -> P`, what personalization sends to
        every client.
      personalize_client: optional, `(P, C) -> C`, the clients-only
        personalization stage (requires `personalize_input`).

    Returns:
      A `template.DeviceProcess`. Its client computations are, per phase,
      the device's work (`client_work`, or `client_work_<phase>` for several
      phases: `(B, D) -> outputs`), and `client_evaluate` and, with
      personalization, `client_personalize`.

    Raises:
      TypeError: if a phase does not return the server state's type.
    """
    from tff_pfl.computations import template  # template documents this module's types

    server_state_type = initialize.type_signature.result
    devices_type = tff.FederatedType(DEVICE_INPUT_TYPE, tff.CLIENTS)
    client_computations = collections.OrderedDict()
    built = collections.OrderedDict()
    for phase in phases:
        work = stateful(phase.client_step, initial_client_state, [phase.broadcast.type_signature.result])
        client_computations['client_work' if len(phases) == 1 else f'client_work_{phase.name}'] = work
        built[phase.name] = _device_phase(server_state_type, devices_type, phase, work)
        returned = built[phase.name].type_signature.result['state']
        if not returned.is_equivalent_to(server_state_type):
            raise TypeError(f'phase {phase.name} returns {returned}, not the server state {server_state_type}')
    evaluate_work = reading(evaluate_client, initial_client_state, [evaluate_input.type_signature.result])
    client_computations['client_evaluate'] = evaluate_work

    @tff.federated_computation(server_state_type, devices_type)
    def device_evaluate(state, devices):
        value = tff.federated_broadcast(tff.federated_map(evaluate_input, state))
        return tff.federated_map(evaluate_work, (value, devices))

    device_personalize = None
    if personalize_client is not None:
        personalize_work = stateful_update(
            personalize_client, initial_client_state, [personalize_input.type_signature.result]
        )

        @tff.federated_computation(server_state_type, devices_type)
        def device_personalize(state, devices):
            value = tff.federated_broadcast(tff.federated_map(personalize_input, state))
            return tff.federated_map(personalize_work, (value, devices))

        client_computations['client_personalize'] = personalize_work
    return template.DeviceProcess(initialize, built, device_evaluate, device_personalize, client_computations)


def next_from_phases(server_state_type: tff.Type, client_state_type: tff.Type, phases: Sequence[Phase]):
    """The in-process `next` of the round the `phases` describe: one round written once, in two forms.

    The same phases give `build_device_process` its device form; here the
    client states are federated values, passed in and out. For each phase,
    in order: its `broadcast` of the SERVER state goes to every client, its
    `client_step` maps over `(that value, client state)`, and its `finish`
    makes the new server state and the phase's metrics from the state and
    the clients' outputs; the outputs' `client_state` is the clients' state
    from then on.

    Args:
      server_state_type: `S`, the server state type, placed at SERVER (the
        result of `initialize`) or not placed.
      client_state_type: `C`, one client's state (not placed).
      phases: the round's aggregation stages, in order (`Phase`), each from
        `S` to `S`.

    Returns:
      A `tff.federated_computation` `(S@SERVER, {C}@CLIENTS) ->
      template.RoundOutput(state=S@SERVER, client_states={C}@CLIENTS,
      metrics=M@SERVER)`. With one phase, `M` is that phase's metrics; with
      several, one struct of every phase's metric fields, a later phase's
      field replacing an earlier one of the same name (as
      `run_round` merges them).

    Raises:
      ValueError: if `phases` is empty.
    """
    from tff_pfl.computations import template  # template documents this module's types

    if not phases:
        raise ValueError('next_from_phases needs at least one phase')
    if not isinstance(server_state_type, tff.FederatedType):
        server_state_type = tff.FederatedType(server_state_type, tff.SERVER)

    @tff.federated_computation(server_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def next_fn(state, client_states):
        every_metrics = []
        for phase in phases:
            value = tff.federated_broadcast(tff.federated_map(phase.broadcast, state))
            outputs = tff.federated_map(phase.client_step, (value, client_states))
            state, metrics = phase.finish(state, outputs)
            client_states = outputs.client_state
            every_metrics.append(metrics)
        if len(every_metrics) == 1:
            return template.RoundOutput(state, client_states, every_metrics[0])
        merged = collections.OrderedDict()
        for metrics in every_metrics:
            for name, _ in tff.structure.iter_elements(metrics.type_signature.member):
                merged[name] = metrics[name]
        return template.RoundOutput(state, client_states, tff.federated_zip(merged))

    return next_fn


def _device_phase(state_type, devices_type, phase, work):
    """`(S_in@SERVER, {D}@CLIENTS) -> <state, metrics>@SERVER` of one phase."""

    @tff.federated_computation(state_type, devices_type)
    def device_phase(state, devices):
        value = tff.federated_broadcast(tff.federated_map(phase.broadcast, state))
        outputs = tff.federated_map(work, (value, devices))
        new_state, metrics = phase.finish(state, outputs)
        return collections.OrderedDict(state=new_state, metrics=metrics)

    return device_phase


def field_and_round(server_state_type: tff.Type, field: str, fn: tff.Computation, client_state_type: tff.Type):
    """A phase's broadcast of one server-state field with the round number, and the client side.

    Args:
      server_state_type: `S` (not placed), with `field` and `round_num`.
      field: the field to send, e.g. `model`.
      fn: `(field value, round_num, C) -> R`, the client's computation.
      client_state_type: `C`.

    Returns:
      `(S -> <field, round_num>, (<field, round_num>, C) -> R)`, both
      `tff.tensorflow.computation`s.
    """

    @tff.tensorflow.computation(server_state_type)
    def select(state):
        return collections.OrderedDict([(field, state[field]), ('round_num', state['round_num'])])

    @tff.tensorflow.computation(select.type_signature.result, client_state_type)
    def apply(value, client_state):
        return fn(value[field], value['round_num'], client_state)

    return select, apply


def run_round(device_process, state, devices: Sequence):
    """One round of a `template.DeviceProcess`: its phases in order.

    Args:
      device_process: the `template.DeviceProcess`.
      state: the server state `S` before the round.
      devices: the participating clients' device inputs (`device_input`).

    Returns:
      `(new server state, metrics)`, the metrics of every phase in one
      `OrderedDict`.
    """
    metrics = collections.OrderedDict()
    for phase in device_process.phases.values():
        output = phase(state, list(devices))
        state = output['state']
        metrics.update(output['metrics'])
    return state, metrics


def _names(result) -> list:
    if isinstance(result, tff.structure.Struct):
        return [name for name, _ in tff.structure.iter_elements(result)]
    return list(result)


def load(state_file: str, template):
    """The client state in `state_file`, structured like `template` (Python).

    Args:
      state_file: a file written by a device's work.
      template: a client state of the same algorithm (e.g. the process's
        `initial_client_state(client_id)`), whose structure and dtypes the
        result takes.

    Returns:
      The state as numpy values in `template`'s containers.
    """
    with open(state_file, 'rb') as f:
        blob = f.read()
    serialized = list(tf.io.parse_tensor(blob, tf.string).numpy())
    like = [np.asarray(leaf) for leaf in flatten(template)]
    if len(serialized) != len(like):
        raise ValueError(f'{state_file}: {len(serialized)} tensors, expected {len(like)}')
    leaves = [
        tf.io.parse_tensor(b, tf.string if t.dtype.kind in 'SUO' else tf.as_dtype(t.dtype)).numpy()
        for b, t in zip(serialized, like)
    ]
    return fill(template, iter(leaves))


def save(state_file: str, state) -> None:
    """Writes `state` to `state_file` in the devices' format (Python; e.g. to restore a checkpoint).

    The file is written under a temporary name and then renamed into place.

    Args:
      state_file: the path to write.
      state: a client state (a nest of tensors or numpy values).
    """
    leaves = [tf.io.serialize_tensor(tf.convert_to_tensor(leaf)) for leaf in flatten(state)]
    blob = tf.io.serialize_tensor(tf.stack(leaves)).numpy()
    temporary = f'{state_file}.tmp'
    with open(temporary, 'wb') as f:
        f.write(blob)
    os.replace(temporary, state_file)
