"""Reads a tff-pfl-export directory back and runs it, piece by piece.

`Export(path)` checks every file against the manifest's SHA-256, checks that
the TFF version matches the one that wrote it, deserializes the computations
and rebuilds `tff.backends.mapreduce.MapReduceForm` and
`DistributeAggregateForm` from their pieces (whose constructors check that the
pieces fit together).

`run_round_map_reduce` runs one round the way a federated system runs a
MapReduceForm, for each phase of the round in turn: `prepare` on the server,
`work` on each device (which reads and writes the device's client state
file), `zero`/`accumulate`/`merge`/`report` to aggregate, and `update` on the
server. `run_round_distribute_aggregate` does the same with the
DistributeAggregateForm's five stages.

`stage_clients_dir` is the device side of an export made from your own
per-client files (`--dataset=clients:DIR`, docs/data.md): it prepares, from
each device's own `<id>.npz` in the same layout, the files the client
computations read, at the path baked into them.

Command line (runs rounds over every client of the export):

    python -m deploy.loader --export_dir=DIR --state_dir=DIR [--rounds=N]
        [--form=map_reduce|distribute_aggregate] [--workers=host:port]
        [--worker_tls_ca=ca.pem --worker_tls_cert=driver.pem --worker_tls_key=driver.key]
        [--clients_dir=DIR]
"""

import collections
import filecmp
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.proto.v0 import computation_pb2

from tff_pfl.computations import device_state
from tff_pfl.data import client_data, client_data_writer, natural, pipeline, sources

MANIFEST = 'manifest.json'
SUPPORTED_FORMAT_VERSIONS = (1,)


class ExportError(ValueError):
    """The export directory is missing, incomplete, altered or from another TFF."""


class Export:
    """A tff-pfl-export directory, loaded."""

    def __init__(self, export_dir: str):
        """Loads and checks `export_dir`.

        Raises:
          ExportError: if the manifest is missing or unreadable, a file is
            missing or its hash differs, or the export was written by
            another TFF version.
        """
        self.export_dir = export_dir
        try:
            with open(os.path.join(export_dir, MANIFEST)) as f:
                self.manifest = json.load(f)
        except FileNotFoundError:
            raise ExportError(f'{export_dir}: no {MANIFEST}; not a tff-pfl-export directory') from None
        except json.JSONDecodeError as e:
            raise ExportError(f'{export_dir}/{MANIFEST}: not valid JSON ({e})') from None
        if self.manifest.get('format_version') not in SUPPORTED_FORMAT_VERSIONS:
            raise ExportError(f'{export_dir}: format_version {self.manifest.get("format_version")!r} is not supported')
        written_by = self.manifest['versions'].get('tensorflow-federated')
        if written_by != tff.__version__:
            raise ExportError(f'{export_dir} was written by TFF {written_by}; this is TFF {tff.__version__}')
        self.computations = collections.OrderedDict(
            (name, self._load(entry)) for name, entry in self.manifest['computations'].items()
        )
        # phase -> form; empty where the round does not fit.
        self.map_reduce_forms = self._forms('map_reduce_form', tff.backends.mapreduce.MapReduceForm)
        self.distribute_aggregate_forms = self._forms(
            'distribute_aggregate_form', tff.backends.mapreduce.DistributeAggregateForm
        )
        self._distribute_and_work = {
            phase: _distribute_and_work(form) for phase, form in self.distribute_aggregate_forms.items()
        }

    @property
    def algorithm(self) -> str:
        """The exported algorithm's registry name (e.g. `fedavg`)."""
        return self.manifest['algorithm']

    @property
    def client_ids(self) -> list:
        """Every client id of the export, in partition order."""
        return list(self.manifest['client_ids'])

    def _load(self, entry) -> tff.Computation:
        path = os.path.join(self.export_dir, entry['file'])
        try:
            with open(path, 'rb') as f:
                blob = f.read()
        except FileNotFoundError:
            raise ExportError(f'{path}: missing') from None
        if hashlib.sha256(blob).hexdigest() != entry['sha256']:
            raise ExportError(f'{path}: SHA-256 differs from the manifest')
        proto = computation_pb2.Computation()
        proto.ParseFromString(blob)
        comp = tff.framework.deserialize_computation(proto)
        if str(comp.type_signature) != entry['type_signature']:
            raise ExportError(f"{path}: type {comp.type_signature} differs from the manifest's")
        return comp

    @property
    def phases(self) -> list:
        """The round's phases, in order (`next`, or e.g. `share`, `distill`)."""
        return list(self.manifest['phases'])

    def _forms(self, name, form_class) -> collections.OrderedDict:
        entry = self.manifest['forms'].get(name, {})
        forms = collections.OrderedDict()
        for phase, pieces in entry.get('phases', {}).items() if entry.get('exported') else ():
            loaded = collections.OrderedDict((piece, self._load(e)) for piece, e in pieces.items())
            forms[phase] = form_class(self.computations[phase].type_signature, **loaded)
        return forms

    def __getattr__(self, name):
        # initialize(), next(...), evaluate(...), client_work(...), ...
        computations = self.__dict__.get('computations', {})
        if name in computations:
            return computations[name]
        raise AttributeError(name)

    def device_inputs(self, state_dir: str, client_ids: Sequence[str] | None = None) -> list:
        """`<client_id, state_file>` of each client (default: all of the export's).

        Args:
          state_dir: the directory that holds the devices' state files.
          client_ids: the clients; None or empty: all of the export's.

        Returns:
          One `device_state.device_input` per client, in order.
        """
        return [device_state.device_input(c, state_dir) for c in (client_ids or self.client_ids)]

    def load_client_state(self, device) -> object:
        """The client state in a device's state file (the initial one if it has none yet).

        Args:
          device: one of `device_inputs`.

        Returns:
          The client state, structured like the export's
          `initial_client_state`.
        """
        initial = self.computations['initial_client_state'](device['client_id'])
        if not os.path.exists(device['state_file']):
            return initial
        return device_state.load(device['state_file'], initial)

    def stage_clients_dir(self, clients_dir: str, log=print) -> str:
        """Prepares the client computations' files from per-client files in the `clients:DIR` layout.

        The export must have been made from a `clients:` source. Each of
        its clients is looked up in `clients_dir` by its source id, split
        into train, validation and test exactly as the run that made the
        export split it (`pipeline.natural_client_splits`: the seed and the
        client's own id decide, not the other clients), and written in the
        project's per-client layout at the export's `client_data_root`,
        the path baked into the computations. Where that directory exists
        already (the export's own machine), it is compared file by file
        instead and left as it is.

        Args:
          clients_dir: a directory with `manifest.json` and one `<id>.npz`
            per client (docs/data.md, "Your own per-client files").
          log: receives one progress line.

        Returns:
          The client data root.

        Raises:
          ExportError: the export was not made from a `clients:` source, a
            client is missing from `clients_dir` or unreadable, or its data
            differ from those the export was made with.
        """
        config = self.manifest['config']
        expected = self.manifest.get('client_data')
        if not str(config.get('dataset', '')).startswith('clients:') or not expected:
            raise ExportError(
                f'--clients_dir: the export was made from {config.get("dataset")!r}, not from a clients:DIR source'
            )
        if expected.get('public_size'):
            raise ExportError('--clients_dir: the export reads public examples, which a clients:DIR does not hold')
        root = self.manifest['client_data_root']
        try:
            source = natural.load_clients_dir(clients_dir)
            missing = sorted(set(expected['source_ids']) - set(source.client_ids))
            if missing:
                raise ExportError(f'--clients_dir: {clients_dir} has no client {missing[0]!r} ({len(missing)} missing)')
            parent = os.path.dirname(os.path.abspath(root))
            os.makedirs(parent, exist_ok=True)
            scratch = tempfile.mkdtemp(prefix='.staged.', dir=parent)
            staged = os.path.join(scratch, 'client_data')
            try:
                with client_data_writer.ClientDataWriter(
                    staged,
                    feature_shape=expected['feature_shape'],
                    encoding=expected['feature_encoding'],
                    label_shape=expected.get('label_shape', ()),
                    # an export made by an earlier version reads the per-client layout
                    layout=expected.get('layout', client_data.PER_CLIENT),
                ) as writer:
                    for source_id in expected['source_ids']:
                        splits = pipeline.natural_client_splits(
                            source, source_id, seed=config['seed'], split_fractions=config['split_fractions']
                        )
                        writer.add_client(splits, source_id=source_id)
                    writer.finish(expected['num_classes'])
                if client_data.load_client_data_manifest(staged) != expected:
                    raise ExportError(
                        f'--clients_dir: {clients_dir} gives other clients, shapes or split sizes than the export '
                        'was made with'
                    )
                if os.path.exists(root):
                    _compare_client_data(staged, root, expected, clients_dir)
                else:
                    os.rename(staged, root)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        except (sources.DataError, ValueError, OSError) as e:
            raise ExportError(f'--clients_dir: {e}') from None
        log(f'client data of {len(expected["source_ids"])} devices from {clients_dir}: {root}')
        return root

    def _require(self, forms, name):
        if not forms:
            reason = self.manifest['forms'].get(name, {}).get('reason', 'not exported')
            raise ExportError(f'{self.algorithm} has no {name}: {reason}')
        return forms

    def run_round_map_reduce(self, state, devices: Sequence):
        """One round through the MapReduceForms' pieces, phase after phase.

        Args:
          state: the server state (from `initialize()` or a previous round).
          devices: the round's `device_inputs`.

        Returns:
          `(new server state, round metrics)`, the metrics of every phase in
          one `OrderedDict`.
        """
        metrics = collections.OrderedDict()
        for form in self._require(self.map_reduce_forms, 'map_reduce_form').values():
            state, phase_metrics = self.run_phase_map_reduce(form, state, devices)
            metrics.update(phase_metrics)
        return state, metrics

    def run_phase_map_reduce(self, form, state, devices: Sequence):
        """One phase through one MapReduceForm: prepare, work, zero/accumulate/merge/report, update.

        Args:
          form: the phase's `MapReduceForm` (from `map_reduce_forms`).
          state: the server state before the phase.
          devices: the round's `device_inputs`.

        Returns:
          `(new server state, phase metrics)`.

        The secure-aggregation parts of `work` (`secure_sum_bitwidth`,
        `secure_sum_max_input`, `secure_modular_sum`) are summed here as a
        secure-aggregation service would: integer sums of every device's
        values, each checked against its bit width or maximum input, modular
        sums reduced by their modulus; only the sums reach `update`.

        Raises:
          ExportError: a device's secure-sum input outside its declared range.
        """
        broadcast = form.prepare(state)
        accumulator = form.zero()
        secure = [
            _SecureSum('secure_sum_bitwidth', form.secure_sum_bitwidth(), lambda b: 2**b - 1),
            _SecureSum('secure_sum_max_input', form.secure_sum_max_input(), lambda m: m),
            _SecureSum('secure_modular_sum', form.secure_modular_sum_modulus(), lambda m: m - 1, modular=True),
        ]
        for device in devices:
            work = form.work(device, broadcast)
            accumulator = form.accumulate(accumulator, work[0])
            for part, values in zip(secure, work[1:]):
                part.add(values)
        report = form.report(form.merge(form.zero(), accumulator))
        result = form.update(state, (report, *(part.result() for part in secure)))
        return _state_and_metrics(result)

    def run_round_distribute_aggregate(self, state, devices: Sequence):
        """One round through the DistributeAggregateForms' five stages; see `run_round_map_reduce`.

        Args:
          state: the server state (from `initialize()` or a previous round).
          devices: the round's `device_inputs`.

        Returns:
          `(new server state, round metrics)`, the metrics of every phase in
          one `OrderedDict`.

        Raises:
          ExportError: if the export has no DistributeAggregateForm.
        """
        metrics = collections.OrderedDict()
        for phase, form in self._require(self.distribute_aggregate_forms, 'distribute_aggregate_form').items():
            broadcast_input, intermediate = _parts(form.server_prepare(state))
            client_outputs = self._distribute_and_work[phase](list(devices), broadcast_input)
            aggregated = form.client_to_server_aggregation(intermediate, client_outputs)
            state, phase_metrics = _state_and_metrics(form.server_result(intermediate, aggregated))
            metrics.update(phase_metrics)
        return state, metrics


class _SecureSum:
    """What a secure-aggregation service releases for one kind of MapReduceForm secure sum: only the sum.

    Each device's values must lie in [0, `bound(parameter)`] (the bit width's
    or the maximum input's range, or below the modulus); a modular sum is
    reduced by its modulus.
    """

    def __init__(self, name: str, parameters, bound, *, modular: bool = False):
        self._name = name
        self._parameters = tf.nest.flatten(parameters)
        self._bounds = [int(bound(int(p))) for p in self._parameters]
        self._modular = modular
        self._template = None
        self._sums = None

    def add(self, values) -> None:
        flat = tf.nest.flatten(values)
        if self._template is None:
            self._template = values
            self._sums = [np.zeros(np.shape(v), np.int64) for v in flat]
        for i, (value, bound) in enumerate(zip(flat, self._bounds)):
            value = np.asarray(value).astype(np.int64)
            if value.size and (value.min() < 0 or value.max() > bound):
                raise ExportError(f'a device sent {self._name} input outside [0, {bound}]')
            self._sums[i] = self._sums[i] + value
            if self._modular:
                self._sums[i] %= int(self._parameters[i])

    def result(self):
        if self._template is None:  # no secure part of this kind (or no device)
            return ()
        dtypes = [np.asarray(v).dtype for v in tf.nest.flatten(self._template)]
        return tf.nest.pack_sequence_as(self._template, [s.astype(d) for s, d in zip(self._sums, dtypes)])


def _compare_client_data(staged: str, root: str, expected: dict, clients_dir: str) -> None:
    """Raises ExportError where `root`'s client files differ from `staged`'s (either layout), naming the client."""
    if expected.get('layout', client_data.PER_CLIENT) == client_data.SHARDED:
        index = client_data.client_index_table(expected['split_sizes'])
        for row, split in enumerate(client_data.SPLITS):
            for suffix in ('x.bin', 'y.i32'):
                name = f'{split}_{suffix}'
                here, there = os.path.join(staged, name), os.path.join(root, name)
                if os.path.exists(there) and filecmp.cmp(here, there, shallow=False):
                    continue
                if not os.path.exists(there) or os.path.getsize(there) != os.path.getsize(here):
                    raise ExportError(
                        f'--clients_dir: the clients of {clients_dir} differ from the data the export was made '
                        f'with ({there})'
                    )
                a, b = np.fromfile(here, np.uint8), np.fromfile(there, np.uint8)
                width = a.size // max(int(index[row, -1]), 1)  # bytes of one example
                for k, source_id in enumerate(expected['source_ids']):
                    start, stop = int(index[row, k]) * width, int(index[row, k + 1]) * width
                    if not np.array_equal(a[start:stop], b[start:stop]):
                        raise ExportError(
                            f'--clients_dir: client {source_id!r} of {clients_dir} differs from the data the '
                            f'export was made with ({there})'
                        )
        return
    for client_id, source_id in zip(expected['client_ids'], expected['source_ids']):
        for split in client_data.SPLITS:
            for suffix in ('x.bin', 'y.i32'):
                name = os.path.join(client_id, f'{split}_{suffix}')
                there = os.path.join(root, name)
                if not os.path.exists(there) or not filecmp.cmp(os.path.join(staged, name), there, shallow=False):
                    raise ExportError(
                        f'--clients_dir: client {source_id!r} of {clients_dir} differs from the data the export '
                        f'was made with ({there})'
                    )


def _distribute_and_work(form):
    """`server_to_client_broadcast` then `client_work`, in one invocation.

    On its own the broadcast has no CLIENTS-placed argument to say how many
    clients it reaches.
    """

    @tff.federated_computation(
        form.client_work.type_signature.parameter[0], form.server_to_client_broadcast.type_signature.parameter
    )
    def distribute_and_work(devices, broadcast_input):
        return form.client_work(devices, form.server_to_client_broadcast(broadcast_input))

    return distribute_and_work


def _parts(value) -> list:
    """The elements of a returned structure, in order (named or not)."""
    if isinstance(value, collections.abc.Mapping):
        return list(value.values())
    return list(value)


def _state_and_metrics(result):
    if isinstance(result, collections.abc.Mapping):
        return result['state'], result['metrics']
    return result[0], result[1]


def main(argv=None) -> int:
    """The command line; returns the exit code.

    Without `--workers`, the process first re-executes itself in a private
    network namespace where the kernel allows it (`runtime.isolate_network`).

    Args:
      argv: the arguments, without the program name; None: `sys.argv[1:]`.

    Returns:
      0 on success, 2 if the export cannot be loaded or run.
    """
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(prog='deploy.loader', description=__doc__.splitlines()[0])
    parser.add_argument('--export_dir', required=True)
    parser.add_argument('--state_dir', required=True, help='where the devices keep their client states')
    parser.add_argument('--rounds', type=int, default=1)
    parser.add_argument('--form', choices=('map_reduce', 'distribute_aggregate'), default='map_reduce')
    parser.add_argument('--workers', default='', help='host:port of a TFF worker; default: a local one')
    for part, what in (('ca', 'the CA certificate'), ('cert', "the driver's client certificate"), ('key', 'its key')):
        parser.add_argument(
            f'--worker_tls_{part}', default='', help=f"mutual TLS to the workers' TLS fronts: {what} (PEM)"
        )
    parser.add_argument(
        '--clients_dir',
        default='',
        help='per-client files in the clients:DIR layout to prepare the client data from (exports of clients: sources)',
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f'--rounds must be >= 1, got {args.rounds}')

    from tff_pfl import runtime

    runtime.refuse_implicit_runtime()
    workers = tuple(w for w in args.workers.split(',') if w)
    tls_files = (args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    if any(tls_files) and not all(tls_files):
        parser.error('--worker_tls_ca, --worker_tls_cert and --worker_tls_key go together: give all three or none')
    if any(tls_files) and not workers:
        parser.error('--worker_tls_ca, --worker_tls_cert, --worker_tls_key: TLS is for remote workers; give --workers')
    tls = None
    if all(tls_files):
        try:
            tls = runtime.TlsCredentials.from_files(*tls_files)
        except runtime.TlsFileError as e:
            print(f'deploy.loader: error: --worker_tls_{e.which}: {e}', file=sys.stderr)
            return 2
    if not workers:  # a local worker: keep its port out of reach (docs/runtime.md#security)
        runtime.isolate_network('deploy.loader', ['-m', 'deploy.loader', *(sys.argv[1:] if argv is None else argv)])
    try:
        export = Export(args.export_dir)
        if args.clients_dir:
            export.stage_clients_dir(args.clients_dir)
    except ExportError as e:
        print(f'deploy.loader: error: {e}', file=sys.stderr)
        return 2
    run_round = export.run_round_map_reduce if args.form == 'map_reduce' else export.run_round_distribute_aggregate
    for address in workers:  # before anything is written: a worker that is down or refuses the driver
        try:
            runtime.check_worker(address, tls=tls)
        except runtime.RuntimeStartError as e:
            print(f'deploy.loader: error: --workers: {e}', file=sys.stderr)
            return 2
    os.makedirs(args.state_dir, exist_ok=True)
    with runtime.runtime_for(workers, tls=tls):
        try:
            devices = export.device_inputs(args.state_dir)
            state = export.initialize()
            for round_num in range(1, args.rounds + 1):
                started = time.monotonic()
                state, metrics = run_round(state, devices)
                shown = '  '.join(f'{k} {float(v):.4f}' for k, v in metrics.items() if not isinstance(v, dict))
                print(f'round {round_num}/{args.rounds}  {shown}  {time.monotonic() - started:.2f}s', flush=True)
        except ExportError as e:
            print(f'deploy.loader: error: {e}', file=sys.stderr)
            return 2
    return 0


if __name__ == '__main__':
    from tff_pfl import runtime as _runtime

    _runtime.refuse_implicit_runtime()  # first: a refusal exits with its one line alone (tff_pfl/cli/common.py)
    if os.environ.get('BUILD_WORKING_DIRECTORY'):  # `bazel run`: paths relative to the user's directory
        os.chdir(os.environ['BUILD_WORKING_DIRECTORY'])
    raise SystemExit(main())
