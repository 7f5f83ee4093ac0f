"""The KT-pFL family's shared parts: one round in two forms, its server state and local DP.

KT-pFL (`processes.ktpfl`, soft predictions on public data) and its
homogeneous variant (`processes.ktpfl_homo`, parameters) share the server's
knowledge-coefficient matrix c (its settings and math, mixing weights,
Eq. 4's regulariser, the clipped gradient step on the present clients'
block: `processes.ktpfl_coefficients`), their clients' local DP, and the
shape of a round: every client of the round uploads one value with its
index, its size and its presence; the server mixes the present clients'
values with c and sends each its mix; every client works towards its row;
the server updates c. `Stages` describes a round by those computations,
and `process_from_stages` derives from it both the in-process
`PersonalizedProcess` (one `federated_aggregate` gathering the round's rows)
and its device form (`_device_process`: two phases of one aggregation each,
client states on the devices), so a round is written once.

Only the uploaded values cross from the clients to the server, as K rows
(`_gather`, K = the round's most clients) and two [N] sums of each client's
example count and presence.
"""

import collections
import dataclasses
import os
import typing

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, client_plots, reports
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    building_blocks,
    device_state,
    privacy,
    template,
)

_setting = settings_lib.setting


# Inherited local-training fields whose defaults the paper restates keep their help line.
LOCAL_HELP = {f.name: settings_lib.help_of(f) for f in dataclasses.fields(settings_lib.LocalTraining)}


# When a client distils (ktpfl) or transfers (ktpfl_homo); one field of both variants' settings.
SCHEDULES = ('after_training', 'every_epoch')


SCHEDULE_HELP = (
    'When each client distils (transfers, ktpfl_homo): after_training (R passes after its E epochs, towards this '
    "round's mix) or every_epoch (R passes after each epoch, towards the mix of its previous round: Algorithm 1/2 "
    'read literally).'
)


def schedule_checks(settings) -> list[tuple[bool, str]]:
    """The checks of `kt_distill_schedule`, shared by both variants' settings.

    Args:
      settings: settings with `kt_distill_schedule` and `local_steps`.

    Returns:
      `(ok, one-line problem)` pairs, as `Settings._checks` returns them.
    """
    schedule = settings.kt_distill_schedule
    return [
        (schedule in SCHEDULES, f'kt_distill_schedule must be one of {", ".join(SCHEDULES)}, got {schedule!r}'),
        (
            schedule != 'every_epoch' or settings.local_steps == 0,
            'kt_distill_schedule=every_epoch distils after each local epoch: give local_epochs, not local_steps',
        ),
    ]


def presence(ids: tf.Tensor, num_clients: int) -> tf.Tensor:
    """`[N]`: 1 for the clients in `ids` and 0 for the others (-1 in `ids`: an empty row, ignored).

    Args:
      ids: client indices, `int32[K]`, each in `[0, N)` or -1.
      num_clients: N.

    Returns:
      The presence vector, float32 `[N]`.
    """
    valid = ids >= 0
    rows = tf.boolean_mask(ids, valid)[:, tf.newaxis]
    return tf.scatter_nd(rows, tf.ones_like(rows[:, 0], tf.float32), [num_clients])


def rows_by_client(ids: tf.Tensor, values: tf.Tensor, num_clients: int) -> tf.Tensor:
    """`[K, ...]` rows of the clients `ids` -> `[N, ...]`, row n client n's (zero for clients not in `ids`).

    Args:
      ids: client indices, `int32[K]`, each in `[0, N)` or -1 (an empty row,
        dropped); no index twice.
      values: `[K, ...]`, row k client `ids[k]`'s.
      num_clients: N.

    Returns:
      `[N, ...]`.
    """
    valid = ids >= 0
    shape = tf.concat([[num_clients], tf.shape(values)[1:]], axis=0)
    return tf.scatter_nd(tf.boolean_mask(ids, valid)[:, tf.newaxis], tf.boolean_mask(values, valid), shape)


def compact(present: tf.Tensor, values: tf.Tensor, capacity: int) -> tuple[tf.Tensor, tf.Tensor]:
    """`[N, ...]` rows and presence -> the present clients' ids `[K]` and rows `[K, ...]` (`rows_by_client`'s inverse).

    Args:
      present: `[N]`, 1 for the present clients.
      values: `[N, ...]`, row n client n's.
      capacity: K, at least the number of present clients.

    Returns:
      `(ids, rows)`: the present clients' indices in increasing order, -1
      after them, and their rows, zero after them.
    """
    ids = tf.cast(tf.where(present > 0)[:, 0], tf.int32)
    count = tf.shape(ids)[0]
    fits = tf.debugging.assert_less_equal(count, capacity, message='more clients in the round than its capacity')
    with tf.control_dependencies([fits]):
        padding = capacity - count
    ids = tf.concat([ids, tf.fill([padding], -1)], axis=0)
    rows = tf.gather(values, tf.maximum(ids, 0)) * tf.reshape(
        tf.cast(ids >= 0, values.dtype), [-1] + [1] * (values.shape.rank - 1)
    )
    return tf.ensure_shape(ids, [capacity]), tf.ensure_shape(rows, [capacity, *values.shape[1:]])


def build_server_init(num_clients: int) -> tff.Computation:
    """The server's initial state `<coefficients=1/N, round_num=0>` (either variant).

    Args:
      num_clients: N.

    Returns:
      A no-arg `tff.tensorflow.computation`.
    """

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            coefficients=tf.fill([num_clients, num_clients], 1.0 / num_clients),  # c_0 = 1/N
            round_num=tf.constant(0, tf.int32),
        )

    return server_init


# Why the KT-pFL family's local DP takes a fixed clip and no secure aggregation (one line each).
LOCAL_DP_ADAPTIVE = (
    "the KT-pFL family's DP is local (each client noises its own upload): give --dp_clip, not --dp_target_quantile "
    '(an adaptive clip would need the server to see the norms)'
)


LOCAL_DP_SECURE = (
    "--secure_aggregation: the server needs each KT-pFL client's upload on its own (a row of its own), which a secure "
    'sum does not hide (docs/privacy.md); protect it with --dp_noise_multiplier and --dp_clip (local DP)'
)


# Why the KT-pFL builders take no server optimizer or model aggregator (`building_blocks.refuse_unused`).
UNUSED = dict(
    server_optimizer=(
        "KT-pFL's server learns its knowledge-coefficient matrix by its own gradient step (Zhang et al., 2021, "
        'Eq. 7, kt_coefficient_learning_rate)'
    ),
    model_aggregator=(
        "KT-pFL mixes the clients' uploads per client by the coefficient matrix, not into one mean; pass dp= for "
        'its local DP'
    ),
)


def check_local_dp(dp) -> None:
    """Refuses adaptive clipping for the family's local DP (the server would need the norms).

    Args:
      dp: the builder's `privacy.DPConfig`, or None.

    Raises:
      ValueError: an adaptive clip.
    """
    if dp is not None and dp.adaptive:
        raise ValueError(
            "dp: the KT-pFL family's DP is local (each client noises its own upload): give it a fixed clip, not an "
            'adaptive one (that would need the server to see the norms)'
        )


def local_output(state, num_clients, params, stats, num_examples, /, dp=None, **upload) -> collections.OrderedDict:
    """A local stage's output: the client's upload with its index, its size, presence, metrics and new state (TF code).

    Args:
      state: the client state (with `client_index` and `params`).
      num_clients: N.
      params: the client's packed weights after local training.
      stats: the training's `local_training.Stats`.
      num_examples: the client's number of training examples, D_n.
      dp: local DP (`privacy.DPConfig` with a fixed clip): the upload is
        clipped and noised on the client (`privacy.local_gaussian`) and
        the size is sent as 1 (every client weighs the same); None: none.
      **upload: one entry, `name=value`: what the client uploads (soft
        predictions `[P, C]` or parameters `[D]`).

    Returns:
      `<name=<index, value>, num_examples=[N], present=[N], metric_sums,
      client_state>`: the upload and the client's index (the server keeps
      it as one of the round's rows, `_gather`); the size and a 1
      (`present`: who took part) in the client's slot of length-N vectors;
      the client state with `params` replaced (the second stage counts the
      participation).
    """
    ((name, value),) = upload.items()
    if dp is not None:
        value = privacy.local_gaussian(value, dp.clip, dp.noise_multiplier)
        num_examples = 1
    slot = tf.one_hot(state['client_index'], num_clients)
    new_state = collections.OrderedDict((k, state[k]) for k in state)
    new_state['params'] = params
    return collections.OrderedDict(
        [
            (name, collections.OrderedDict(index=state['client_index'], value=value)),
            ('num_examples', slot * tf.cast(num_examples, tf.float32)),
            ('present', slot),
            ('metric_sums', building_blocks.training_metric_sums(stats)),
            ('client_state', new_state),
        ]
    )


class Stages(typing.NamedTuple):
    """The computations that make a KT-pFL round (either variant).

    One round: every client of the round runs `local_stage` and uploads
    `upload` with its index, its size and its presence; the server mixes the
    uploads of the present clients with c (`mix`) and broadcasts the mix;
    every client of the round runs `second_stage` towards its row; the
    server updates c's block of present clients (`update_coefficients`) and
    reports the clients' mean of the second stage's scalar as `metric`.

    With `schedule='every_epoch'` the server mixes with the c it has just
    updated, and `second_stage` keeps the client's row for its next round's
    `local_stage`, which distils after every epoch (the device form's second
    phase is then `targets`, not `distill`).

    Attributes:
      server_init: no-arg computation, the server state `<coefficients,
        round_num>`.
      initial_client_state: `client_id -> client state`.
      local_stage: `(round_num, client_state) -> <upload, num_examples,
        present, metric_sums, client_state>` (`local_output`).
      upload: the name of the uploaded field of `local_stage`'s result.
      mix: `(server_state, rows, present) -> mixed`, from the round's rows
        `<ids=int32[K], values=[K, ...]>` (`_gather`); `mixed` holds every
        present client's target (heterogeneous: `[N, P, C]`, absent
        clients' rows zero; homogeneous: the K rows' u_n, `<ids, values>`).
      second_stage: `(mixed, round_num, client_state) -> (client_state,
        scalar)`.
      update_coefficients: `(server_state, rows, sizes, present) ->
        server_state`.
      metric: the name under which the scalar's client mean is reported.
      evaluate_client: `client_state -> metrics`.
      schedule: `kt_distill_schedule`, one of `SCHEDULES`.
    """

    server_init: tff.Computation
    initial_client_state: tff.Computation
    local_stage: tff.Computation
    upload: str
    mix: tff.Computation
    second_stage: tff.Computation
    update_coefficients: tff.Computation
    metric: str
    evaluate_client: tff.Computation
    schedule: str = 'after_training'

    @property
    def mixes_updated_coefficients(self) -> bool:
        """Whether the mix is made with the c updated this round (for the next round's distillation)."""
        return self.schedule == 'every_epoch'


def round_capacity(max_clients_per_round: int | None, num_clients: int) -> int:
    """K, the rows of the server's `[K, ...]` uploads: `max_clients_per_round`, or N.

    Args:
      max_clients_per_round: the most clients a round takes, or None.
      num_clients: N.

    Returns:
      K.

    Raises:
      ValueError: K outside [1, N].
    """
    if max_clients_per_round is None:
        return num_clients
    if not 1 <= max_clients_per_round <= num_clients:
        raise ValueError(f'max_clients_per_round must be in [1, {num_clients}], got {max_clients_per_round}')
    return max_clients_per_round


def gathered_rows_type(value_type: tff.TensorType, capacity: int) -> tff.StructType:
    """`<ids=int32[K], values=T[K, ...]>`: K clients' values, row k client `ids[k]`'s (-1: an empty row).

    Args:
      value_type: T, one client's upload.
      capacity: K.

    Returns:
      The struct type.
    """
    return tff.StructWithPythonType(
        [
            ('ids', tff.TensorType(np.int32, (capacity,))),
            ('values', tff.TensorType(value_type.dtype, (capacity, *value_type.shape))),
        ],
        collections.OrderedDict,
    )


def own_row(rows, client_index):
    """A client's row of `<ids, values>` (TF code); fails if the client has none.

    Args:
      rows: `<ids, values>` of a round.
      client_index: the client's index.

    Returns:
      Its row of `values`.
    """
    position = tf.argmax(tf.cast(tf.equal(rows['ids'], client_index), tf.int32), output_type=tf.int32)
    found = tf.debugging.assert_equal(rows['ids'][position], client_index, message='no row for this client')
    with tf.control_dependencies([found]):
        return tf.identity(rows['values'][position])


def _gather(uploads, capacity: int):
    """`{<index, value>}@CLIENTS` -> `<ids=int32[K], values=T[K, ...]>@SERVER` (federated code).

    The server receives each client's value with its index and keeps them
    as K rows, in increasing order of index (-1 and zeros after the last
    client): a `federated_aggregate` whose accumulator appends each upload.
    Its size is K x value, K = the round's most clients, not N x value: a
    federated sum of per-client `[N, ...]` slot tensors, or an accumulator
    of N rows, would hold N x value per client or per accumulation step in
    TFF's runtime (benchmarks/results/ktpfl_memory.md: homogeneous KT-pFL
    with the CNN, 40 clients, 10 per round: 9.3 GB with slot sums, 2.4 GB
    with K rows).

    Args:
      uploads: the clients' `<index=int32, value=T[...]>`; every index in
        `[0, N)`, no two clients with the same one, at most `capacity`
        clients (more fail at an assertion).
      capacity: K.

    Returns:
      The server's rows.
    """
    zero, accumulate, merge, report = gather_steps(uploads.type_signature.member['value'], capacity)
    return tff.federated_aggregate(uploads, zero(), accumulate, merge, report)


def gather_steps(value_type: tff.TensorType, capacity: int):
    """`_gather`'s `federated_aggregate` steps: `(zero, accumulate, merge, report)`.

    Args:
      value_type: the type of one client's value.
      capacity: K.

    Returns:
      `zero: () -> A`, `accumulate: (A, <index, value>) -> A` (appends),
      `merge: (A, A) -> A` (appends the second's rows to the first's) and
      `report: A -> <ids=int32[K], values=T[K, ...]>` (rows in increasing
      order of index, empty rows last), for an accumulator A.
    """
    member = tff.StructWithPythonType([('index', np.int32), ('value', value_type)], collections.OrderedDict)
    # One tensor per row, not one [K, ...] tensor: an accumulation step passes the K - 1 rows it
    # does not write through `tf.cond` untouched, so TFF's runtime, which keeps every step's
    # accumulator until the aggregate is done, does not hold K copies of all K rows.
    accumulator_type = tff.StructWithPythonType(
        [
            ('count', np.int32),
            ('ids', tff.TensorType(np.int32, (capacity,))),
            ('rows', tff.StructWithPythonType([value_type] * capacity, tuple)),
        ],
        collections.OrderedDict,
    )

    @tff.tensorflow.computation
    def zero():
        row = tf.zeros(value_type.shape, value_type.dtype)
        return collections.OrderedDict(count=tf.constant(0), ids=tf.fill([capacity], -1), rows=(row,) * capacity)

    def put(accumulator, index, value):
        count = accumulator['count']
        fits = tf.debugging.assert_less(count, capacity, message='more clients in the round than its capacity')
        with tf.control_dependencies([fits]):
            count = tf.identity(count)
        rows = tuple(
            tf.cond(tf.equal(count, k), lambda: tf.identity(value), lambda row=row: tf.identity(row))
            for k, row in enumerate(accumulator['rows'])
        )
        ids = tf.tensor_scatter_nd_update(accumulator['ids'], [[count]], [index])
        return collections.OrderedDict(count=count + 1, ids=ids, rows=rows)

    @tff.tensorflow.computation(accumulator_type, member)
    def accumulate(accumulator, upload):
        return put(accumulator, upload['index'], upload['value'])

    @tff.tensorflow.computation(accumulator_type, accumulator_type)
    def merge(a, b):
        # Only where several workers aggregate (TFF's single runtime does not call it): b's rows after a's.
        for k in range(capacity):
            a = tf.cond(
                k < b['count'],
                lambda k=k, a=a: put(a, b['ids'][k], b['rows'][k]),
                lambda a=a: collections.OrderedDict(a),
            )
        return a

    @tff.tensorflow.computation(accumulator_type)
    def report(accumulator):
        # Increasing index, empty rows last: the rows do not depend on the order the uploads arrived in.
        key = tf.where(accumulator['ids'] >= 0, accumulator['ids'], tf.int32.max)
        order = tf.argsort(key, stable=True)
        return collections.OrderedDict(
            ids=tf.gather(accumulator['ids'], order), values=tf.gather(tf.stack(accumulator['rows']), order)
        )

    return zero, accumulate, merge, report


def _uploads_sizes_presence(outputs, upload, capacity: int):
    """The server's `[K, ...]` rows of uploads (`_gather`), and the sums of the size and presence slots (federated)."""
    # The size and presence vectors are length N: each client writes into its own slot of them.
    return (
        _gather(outputs[upload], capacity),
        tff.federated_sum(outputs.num_examples),
        tff.federated_sum(outputs.present),
    )


def _client_mean(metric, values):
    """`<metric=mean of values>@SERVER` (federated code)."""
    return tff.federated_zip(collections.OrderedDict([(metric, tff.federated_mean(values))]))


def process_from_stages(stages: Stages, capacity: int, **declared) -> template.PersonalizedProcess:
    """KT-pFL's process from its stages, in process and on devices (`_device_process`).

    Args:
      stages: the round's computations.
      capacity: K, the most clients of a round (the rows of `_gather`).
      **declared: the process's `extras` (its `architectures` and `communication`).

    Returns:
      The `template.PersonalizedProcess`.
    """
    server_init, initial_client_state, local_stage, upload, mix, second_stage, update_coefficients, metric = stages[:8]
    initialize = building_blocks.server_initialize(server_init)
    server_state_type = initialize.type_signature.result
    client_states_type = tff.FederatedType(initial_client_state.type_signature.result, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def next_fn(state, client_states):
        round_num = tff.federated_broadcast(state.round_num)
        local = tff.federated_map(local_stage, (round_num, client_states))
        uploads, sizes, present = _uploads_sizes_presence(local, upload, capacity)
        new_state = tff.federated_map(update_coefficients, (state, uploads, sizes, present))
        mixed_with = new_state if stages.mixes_updated_coefficients else state
        mixed = tff.federated_broadcast(tff.federated_map(mix, (mixed_with, uploads, present)))
        second = tff.federated_map(second_stage, (mixed, round_num, local.client_state))
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        means = _client_mean(metric, second[1])
        return template.RoundOutput(new_state, second[0], building_blocks.with_server_metrics(metrics, means))

    return template.PersonalizedProcess(
        initialize,
        next_fn,
        initial_client_state=initial_client_state,
        evaluate=building_blocks.build_client_states_evaluation(server_state_type, stages.evaluate_client),
        device=_device_process(stages, capacity),
        no_global_model=(
            "KT-pFL's server holds the knowledge-coefficient matrix; each client keeps its own model "
            '(the personalized model is the client state)'
        ),
        **declared,
    )


def _zeros(type_spec):
    """Zeros of a tensor or struct type (TF code)."""
    if isinstance(type_spec, tff.TensorType):
        return tf.zeros(type_spec.shape, type_spec.dtype)
    return collections.OrderedDict((name, _zeros(member)) for name, member in tff.structure.iter_elements(type_spec))


def _device_process(stages: Stages, capacity: int):
    """KT-pFL's round with device-held client states, as two phases of one aggregation each.

    In process, one round aggregates every client's upload (soft predictions,
    or parameters), has the server mix them with the coefficient matrix, and
    broadcasts the mix back for a second client stage: two aggregation
    stages. Here they are two phases:

    * `share`: broadcast the round number; each device runs `local_stage`
      and sends its upload in its own slot of an `[N, ...]` tensor, its size
      and presence (federated sums); the server takes the present clients'
      rows (`compact`, the rows `_gather` gives in process), updates the
      coefficients and keeps the mixed targets in its state;
    * `distill`: broadcast the targets (the whole matrix; each device takes its
      own row) and the round's number; each device runs `second_stage`; the
      server keeps the mean of its scalar (`metric`). With
      `kt_distill_schedule=every_epoch` this phase is `targets`: the targets
      are mixed with the updated c and each device keeps its row for its next
      round (`Stages`).

    A MapReduceForm returns the state type it takes, so the device form's
    server state is `<coefficients, round_num, targets>` throughout (targets
    zero before the first round).

    Why slots here and `_gather` in process: TFF 0.87's
    DistributeAggregateForm conversion fails on any `federated_aggregate`
    (`form_utils.get_distribute_aggregate_form_for_computation` tries to
    place its accumulate function at the server), while federated sums
    convert to both forms. A slot costs N x the upload on a device and in
    the sum (docs/export.md).

    Both phases read and write the same state files, so a round of the two
    equals one in-process round (tests/test_export.py).

    Args:
      stages: the round's computations.
      capacity: K, the rows of the uploads the server mixes (`_gather`).

    Returns:
      The `device_state.build_device_process` of the two phases.
    """
    server_init, initial_client_state, local_stage, upload, mix, second_stage, update_coefficients, metric = stages[:8]
    sizes_type = local_stage.type_signature.result['num_examples']
    present_type = local_stage.type_signature.result['present']
    num_clients = present_type.shape[0]
    upload_type = local_stage.type_signature.result[upload]  # <index, value>
    slots_type = tff.TensorType(upload_type['value'].dtype, (num_clients, *upload_type['value'].shape))
    targets_type = mix.type_signature.result

    @tff.tensorflow.computation(upload_type)
    def to_slot(value):
        # The client's value in row `index` of an [N, ...] tensor of zeros.
        return rows_by_client(value['index'][tf.newaxis], value['value'][tf.newaxis], num_clients)

    @tff.tensorflow.computation
    def device_server_init():
        state = server_init()
        return collections.OrderedDict(
            coefficients=state['coefficients'], round_num=state['round_num'], targets=_zeros(targets_type)
        )

    device_initialize = building_blocks.server_initialize(device_server_init)
    state_type = device_server_init.type_signature.result
    round_of = building_blocks.build_round_number(state_type)

    @tff.tensorflow.computation(state_type, slots_type, sizes_type, present_type)
    def share_update(state, slots, sizes, present):
        kept = collections.OrderedDict(coefficients=state['coefficients'], round_num=state['round_num'])
        ids, values = compact(present, slots, capacity)
        uploads = collections.OrderedDict(ids=ids, values=values)
        updated = update_coefficients(kept, uploads, sizes, present)
        targets = mix(updated if stages.mixes_updated_coefficients else kept, uploads, present)
        return collections.OrderedDict(
            coefficients=updated['coefficients'], round_num=updated['round_num'], targets=targets
        )

    def share_finish(state, outputs):
        slots = tff.federated_sum(tff.federated_map(to_slot, outputs[upload]))
        sizes, present = tff.federated_sum(outputs.num_examples), tff.federated_sum(outputs.present)
        return (
            tff.federated_map(share_update, (state, slots, sizes, present)),
            building_blocks.aggregate_training_metrics(outputs.metric_sums),
        )

    @tff.tensorflow.computation(state_type)
    def distill_broadcast(state):
        return collections.OrderedDict(targets=state['targets'], round_num=state['round_num'] - 1)

    @tff.tensorflow.computation(distill_broadcast.type_signature.result, initial_client_state.type_signature.result)
    def distill_step(value, client_state):
        new_state, scalar = second_stage(value['targets'], value['round_num'], client_state)
        return collections.OrderedDict([(metric, scalar), ('client_state', new_state)])

    def distill_finish(state, outputs):
        return state, _client_mean(metric, outputs[metric])

    return device_state.build_device_process(
        device_initialize,
        initial_client_state,
        phases=[
            device_state.Phase('share', round_of, local_stage, share_finish),
            device_state.Phase(
                'targets' if stages.mixes_updated_coefficients else 'distill',
                distill_broadcast,
                distill_step,
                distill_finish,
            ),
        ],
        evaluate_input=round_of,
        evaluate_client=building_blocks.build_evaluation_at(stages.evaluate_client),
    )


def plots(out, result, process):
    """The family's report plots: the coefficient matrix (heatmap and CSV), and `communication.csv`.

    Args:
      out: the run's directory.
      result: the finished run (its server state holds `coefficients`).
      process: its process (`extras`: `communication`, and `architectures` for KT-pFL).

    Returns:
      `[(title, file)]` of the plots.
    """
    client_ids = list(result.client_states)
    architectures = process.extras.get('architectures') or [''] * len(client_ids)
    labels = [f'{s} {a}'.strip() for s, a in zip(client_plots.short_ids(client_ids), architectures)]
    client_plots.plot_client_matrix(
        out,
        'knowledge_coefficients',
        "Knowledge coefficients c[n, m] (row n: client n's mix)",
        np.asarray(result.state['coefficients']),
        client_ids,
        row_labels=labels,
    )
    reports.write_csv(os.path.join(out, 'communication.csv'), [dict(process.extras['communication'])])
    return [('Knowledge coefficients', 'knowledge_coefficients.png')]


def local_dp_privacy(uploads, dp_uploads=None):
    """The family's privacy modes: local DP with a fixed clip, no secure sums.

    Args:
      uploads: what DP clips and noises (the report's wording).
      dp_uploads: optional; the noised means of a round (`algorithm.Privacy.dp_uploads`).

    Returns:
      An `algorithm.Privacy`.
    """
    return algorithm.Privacy(
        uploads,
        local=True,
        fixed_clip_only=LOCAL_DP_ADAPTIVE,
        no_secure=LOCAL_DP_SECURE,
        dp_uploads=dp_uploads,
    )
