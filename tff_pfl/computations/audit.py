"""What a federated computation moves from CLIENTS to SERVER.

Reads the computation's building blocks: every intrinsic call whose argument
holds a CLIENTS-placed value and whose result is placed at SERVER is a point
where client data reach the server. Tests use this to prove that only
aggregates (sums, means, aggregations) cross.
"""

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
      A list of `(uri, argument_type)`.
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
                found.append((building_block.function.uri, argument.type_signature))
        for child in building_block.children():
            visit(child)

    visit(comp.to_building_block())
    return found


def clients_to_server_intrinsics(comp: tff.Computation) -> set[str]:
    """URIs of the intrinsics that take CLIENTS values and return SERVER values.

    Args:
      comp: a federated `tff.Computation`.

    Returns:
      The set of intrinsic URIs (e.g. {'federated_mean', 'federated_sum'}).
    """
    return {uri for uri, _ in clients_to_server_values(comp)}
