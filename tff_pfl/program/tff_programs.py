"""Our processes under TFF's own program loop (`tff.learning.programs.train_model`).

TFF runs production training with `train_model`: a `tff.learning.templates.LearningProcess`,
a `tff.program.FederatedDataSource` that picks each round's clients, a program state manager
that saves every round and resumes a killed run from the last one, and release managers
(CSV, TensorBoard, ...) for the metrics and the final model. This module gives it what it
takes:

- `learning_process(process)`: a `PersonalizedProcess` with one global model whose clients
  keep nothing between rounds but their participation record (FedAvg; not FedBN, whose server
  holds only the shared layers) as a `LearningProcess` whose `next` takes the round's client ids at
  CLIENTS; each client builds its state from its id (`initial_client_state`) inside the round,
  so nothing but ids comes in and the same aggregates as `process.next` go out.
- `ClientIdsDataSource`: the partition's ids, sampled per round without replacement by a
  seeded generator; its iterator is serializable, so the state manager resumes the sampling.
- `native_context(runtime)`: the asynchronous context `train_model` needs
  (`tff.program.NativeFederatedContext`) on a `runtime.LocalRuntime`'s worker.

docs/own_code.md ("TFF's program loop") has the example; tests/test_tff_programs.py kills a
run after some rounds and resumes it to the same model as an uninterrupted one.
"""

import collections
import contextlib
import json
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow_federated as tff

from tff_pfl import runtime
from tff_pfl.computations import template

# A client state that holds only these fields carries nothing a later round needs.
_PARTICIPATION = ('client_id', 'num_participations', 'last_round')


def learning_process(process: template.PersonalizedProcess) -> tff.learning.templates.LearningProcess:
    """`process` as a `tff.learning.templates.LearningProcess` over client ids.

    Args:
      process: a `PersonalizedProcess` with a global model
        (`process.has_global_model`) whose client state is only the
        participation record (`client_id, num_participations, last_round`).

    Returns:
      A `LearningProcess`: `initialize` and `get_model_weights` /
      `set_model_weights` are the process's; `next: (S@SERVER,
      {string}@CLIENTS) -> LearningProcessOutput(S@SERVER, M@SERVER)` runs
      `process.next` on the clients' initial states, its metrics under
      `client_work/train` as in TFF's composed processes (where
      `train_model` reads them).

    Raises:
      TypeError: `process` is not a `PersonalizedProcess`.
      ValueError: one line, if it has no global model, or its clients keep
        state between rounds (which `train_model`'s loop cannot give back to
        them: run it with `tff_pfl.program.training_loop.run`).
    """
    if not isinstance(process, template.PersonalizedProcess):
        raise TypeError(
            f'process must be a PersonalizedProcess (a build_*_process result), got {type(process).__name__}'
        )
    if not process.has_global_model:
        process.get_model_weights  # raises the one-line reason  # noqa: B018
    fields = [name for name, _ in tff.structure.iter_elements(process.client_state_type)]
    kept = [name for name in fields if name not in _PARTICIPATION]
    if kept:
        raise ValueError(
            f'process: its clients keep {", ".join(kept)} between rounds, which tff.learning.programs.train_model '
            'cannot give back to them; run it with tff_pfl.program.training_loop.run'
        )
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
