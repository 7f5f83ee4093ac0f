"""What a federated computation moves between CLIENTS and SERVER.

Reads the computation's building blocks: every intrinsic call whose argument
holds a CLIENTS-placed value and whose result is placed at SERVER is a point
where client data reach the server. Tests use this to prove that only
aggregates (sums, means, aggregations) cross, and the benchmark harness uses
`communication_bytes` to count what a round sends down to and up from each
client.
"""

import collections

import numpy as np
import tensorflow_federated as tff


def _placements(type_spec) -> set:
    found = set()

    def visit(t):
        if isinstance(t, tff.FederatedType):
            found.add(t.placement)
        elif isinstance(t, tff.StructType):
            for element in t:
                visit(element)

    visit(type_spec)
    return found


def clients_to_server_values(comp: tff.Computation) -> list:
    """Every CLIENTS -> SERVER intrinsic call with the type of what it takes.

    Args:
      comp: a federated `tff.Computation`.

    Returns:
      A list of `(uri, argument_type)`; for `federated_aggregate`, whose
      argument is `<value, zero, accumulate, merge, report>`, the type of
      `value`, what the clients send.
    """
    found = []

    def visit(building_block):
        if isinstance(building_block, tff.framework.Call) and isinstance(
            building_block.function, tff.framework.Intrinsic
        ):
            argument = building_block.argument
            if (
                argument is not None
                and tff.CLIENTS in _placements(argument.type_signature)
                and tff.SERVER in _placements(building_block.type_signature)
            ):
                uri, sent = building_block.function.uri, argument.type_signature
                if uri == 'federated_aggregate':
                    sent = sent[0]
                found.append((uri, sent))
        for child in building_block.children():
            visit(child)

    visit(comp.to_building_block())
    return found


def clients_tensorflow_ops(comp: tff.Computation) -> set[str]:
    """The TensorFlow op types of every computation `comp` maps over CLIENTS.

    What runs on the clients, read from the graphs themselves (with their
    function libraries): e.g. whether a client draws noise
    (`RandomStandardNormal`) before it uploads.

    Args:
      comp: a federated `tff.Computation`.

    Returns:
      The set of op type names.
    """
    import tensorflow as tf

    ops = set()

    def graph_ops(building_block):
        if not isinstance(building_block, tff.framework.CompiledComputation):
            for child in building_block.children():
                graph_ops(child)
            return
        graph = tf.compat.v1.GraphDef()
        building_block.proto.tensorflow.graph_def.Unpack(graph)
        ops.update(node.op for node in graph.node)
        for function in graph.library.function:
            ops.update(node.op for node in function.node_def)

    def visit(building_block):
        if (
            isinstance(building_block, tff.framework.Call)
            and isinstance(building_block.function, tff.framework.Intrinsic)
            and building_block.function.uri == 'federated_map'
            and _placements(building_block.type_signature) == {tff.CLIENTS}
        ):
            graph_ops(building_block.argument)
        for child in building_block.children():
            visit(child)

    visit(comp.to_building_block())
    return ops


def clients_to_server_intrinsics(comp: tff.Computation) -> set[str]:
    """URIs of the intrinsics that take CLIENTS values and return SERVER values.

    Args:
      comp: a federated `tff.Computation`.

    Returns:
      The set of intrinsic URIs (e.g. {'federated_mean', 'federated_sum'}).
    """
    return {uri for uri, _ in clients_to_server_values(comp)}


def type_bytes(type_spec) -> int:
    """Bytes of one value of `type_spec`: every tensor's elements times its item size.

    Placements are looked through (a `T@CLIENTS` counts as one `T`, the value
    one client holds), structures are summed, and functions count 0. A
    `tf.string` tensor counts 0: its size is not in the type (client ids are
    the only strings the project's rounds carry).

    Args:
      type_spec: a `tff.Type` (tensor, structure or federated type).

    Returns:
      The size in bytes.

    Raises:
      ValueError: for a tensor whose shape is not fully known, or a sequence,
        whose size the type does not fix.
    """
    if isinstance(type_spec, tff.FederatedType):
        return type_bytes(type_spec.member)
    if isinstance(type_spec, tff.StructType):
        return sum(type_bytes(element) for element in type_spec)
    if isinstance(type_spec, tff.TensorType):
        dtype = np.dtype(type_spec.dtype)
        if dtype.kind in ('S', 'U', 'O'):
            return 0
        shape = type_spec.shape
        if shape is None or any(d is None for d in shape):
            raise ValueError(f'tensor type {type_spec} has no fixed size')
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if isinstance(type_spec, tff.FunctionType):
        return 0
    raise ValueError(f'type {type_spec} has no fixed size')


def _placed_bytes(type_spec, placement) -> int:
    """Bytes of the `placement`-placed members inside `type_spec`."""
    if isinstance(type_spec, tff.FederatedType):
        return type_bytes(type_spec.member) if type_spec.placement is placement else 0
    if isinstance(type_spec, tff.StructType):
        return sum(_placed_bytes(element, placement) for element in type_spec)
    return 0


def _intrinsic_calls(comp: tff.Computation, uri: str) -> list:
    """Argument types of every call of the intrinsic `uri` in `comp`."""
    found = []

    def visit(building_block):
        if (
            isinstance(building_block, tff.framework.Call)
            and isinstance(building_block.function, tff.framework.Intrinsic)
            and building_block.function.uri == uri
        ):
            found.append(building_block.argument.type_signature)
        for child in building_block.children():
            visit(child)

    visit(comp.to_building_block())
    return found


def communication_bytes(comp: tff.Computation) -> collections.OrderedDict:
    """What one call of a federated computation sends to and from each client.

    Read from the type signatures of the computation's intrinsic calls, not
    measured on the wire (no serialization overhead or compression):

    * down: for every `federated_broadcast`, the size of the SERVER value
      that each client receives;
    * up: for every CLIENTS -> SERVER intrinsic call (see
      `clients_to_server_values`), the size of the CLIENTS-placed part of its
      argument, i.e. what each client contributes to the aggregate.

    Sizes are `type_bytes`: elements times item size, `tf.string` tensors 0.

    Args:
      comp: a federated `tff.Computation`, e.g. a process's `next`.

    Returns:
      `OrderedDict(bytes_down_per_client=..., bytes_up_per_client=...)`, ints.
    """
    down = sum(type_bytes(t) for t in _intrinsic_calls(comp, 'federated_broadcast'))
    up = sum(_placed_bytes(t, tff.CLIENTS) for _, t in clients_to_server_values(comp))
    return collections.OrderedDict(bytes_down_per_client=int(down), bytes_up_per_client=int(up))
