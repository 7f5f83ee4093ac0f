"""The device-side client-state store: each client's state a file that its device reads and writes.

`DeviceStateStore` is the `client_states.ClientStates` of a run whose
process runs as its device form (`PersonalizedProcess.device`): the states
stay on the devices, as files, so a round can be split over several workers
(`training_loop.run(device_state_dir=...)`). The driver-side store is
`client_states.ClientStateStore`.
"""

import collections
import os
from collections.abc import Sequence

from tff_pfl.computations import device_state, template
from tff_pfl.program import checkpoints as checkpoints_lib


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
