"""Client data at scale: the sharded layout against the per-client layout, side by side.

Synthetic(1,1) (FedProx's generator, `--dataset=synthetic`, natural
partition: the path `tff-pfl-train` takes, `pipeline.prepare`) with 1,000,
10,000 and 100,000 clients. For each size, in one process:

- generation and splitting alone (no files), to separate the data's cost
  from the files';
- `pipeline.prepare` writing the per-client layout of earlier versions
  (`layout=PER_CLIENT`), then the sharded layout (the default), each after
  an `os.sync()`: seconds until the call returns (the kernel may still be
  writing pages back then) and until a following `os.sync()` returns,
  files, apparent bytes and allocated bytes, and the seconds to delete it;
- the read of one client's training split inside the TFF worker: a
  `tff.tensorflow.computation` taking the client id that reads the split
  (`client_data.read_split`) and sums its features, called for the same
  random clients in both layouts, alternating (warm page cache: the files
  were just written); median and 90th percentile of the call, and of the
  same graph as a plain `tf.function` (no TFF), which isolates the read;
- what embedding the index as constants of the computation (instead of
  memory-mapping `index.i64`) would cost: the serialized computation's size
  and its tracing time.

    uv run --locked python benchmarks/client_data_shards.py
"""

import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from absl import app, flags

from tff_pfl import runtime
from tff_pfl.data import client_data, partition, pipeline, sources

_SIZES = flags.DEFINE_list('num_clients', ['1000', '10000', '100000'], 'Numbers of Synthetic(1,1) clients.')
_READS = flags.DEFINE_integer('reads', 200, 'Clients read per layout (timed calls).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the partitions are written (default: a new temporary dir).')
_RENDER = flags.DEFINE_bool('render_only', False, 'Only rewrite the .md from the .json of an earlier run.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/client_data_shards', 'Result path prefix (.json, .md).')

COMMAND = 'uv run --locked python benchmarks/client_data_shards.py'


def _disk(root):
    """(files, apparent bytes, allocated bytes) under root, directories not counted as files."""
    files, apparent, allocated = 0, 0, 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                allocated += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    files += 1
                    apparent += st.st_size
    return files, apparent, allocated


def _generate_only(num_clients):
    """Seconds to generate and split the clients, without writing; and the number of examples."""
    t = time.perf_counter()
    examples = 0
    for k, (x, y) in enumerate(sources.synthetic_fedprox_clients(1.0, 1.0, num_clients=num_clients, seed=0)):
        parts = partition.split_client(np.arange(len(y)), y, (0.6, 0.2, 0.2), seed=k)
        _ = {split: (x[i], y[i]) for split, i in parts.items()}
        examples += len(y)
    return time.perf_counter() - t, examples


def _readers(spec):
    """A TFF computation and a tf.function, each: client id -> (sum of its train features, its examples)."""

    def body(client_id):
        data = client_data.read_split(spec, client_id, 'train')
        return tf.reduce_sum(data.decode(data.features)), data.num_examples

    t = time.perf_counter()
    comp = tff.tensorflow.computation(body, tf.string)
    trace = time.perf_counter() - t
    return comp, tf.function(body, input_signature=[tf.TensorSpec([], tf.string)]), trace


def _index_as_constants(spec):
    """Tracing seconds and serialized bytes of a reader with the index as constants, and of the mmap reader."""

    def constant_body(client_id):
        row = tf.constant(client_data.client_index_table(spec.split_sizes)[0])
        k = client_data.client_index(client_id)
        return row[k], row[k + 1]

    def mapped_body(client_id):
        data = client_data.read_split(spec, client_id, 'train')
        return tf.reduce_sum(data.decode(data.features)), data.num_examples

    out = {}
    for name, body in (('index_as_constants', constant_body), ('index_memory_mapped', mapped_body)):
        t = time.perf_counter()
        comp = tff.tensorflow.computation(body, tf.string)
        trace = time.perf_counter() - t
        size = tff.framework.serialize_computation(comp).ByteSize()
        out[name] = {'trace_seconds': trace, 'serialized_bytes': size}
    return out


def _time_calls(fn, ids):
    times = []
    for c in ids:
        t = time.perf_counter()
        total, n = fn(c)
        _ = float(total), int(n)
        times.append(time.perf_counter() - t)
    return times


def _summary(times):
    times = sorted(times)
    return {'median_ms': 1e3 * statistics.median(times), 'p90_ms': 1e3 * times[int(0.9 * (len(times) - 1))]}


def measure(num_clients, workdir):
    row = {'num_clients': num_clients}
    row['generate_and_split_seconds'], row['examples'] = _generate_only(num_clients)
    print(f'{num_clients}: generate+split {row["generate_and_split_seconds"]:.1f}s', flush=True)
    specs = {}
    for layout in (client_data.PER_CLIENT, client_data.SHARDED):
        root = os.path.join(workdir, f'{layout}_{num_clients}')
        os.sync()  # start with no dirty pages (of the other layout) to write back
        t = time.perf_counter()
        prepared = pipeline.prepare(
            root, dataset='synthetic', partition_name='natural', num_clients=num_clients, seed=0, layout=layout
        )
        seconds = time.perf_counter() - t
        os.sync()
        synced = time.perf_counter() - t
        files, apparent, allocated = _disk(root)
        specs[layout] = prepared.spec
        row[layout] = {
            'prepare_seconds': seconds,
            'prepare_and_sync_seconds': synced,
            'files': files,
            'bytes': apparent,
            'allocated_bytes': allocated,
        }
        print(f'{num_clients} {layout}: {row[layout]}', flush=True)
    assert specs[client_data.PER_CLIENT].split_sizes == specs[client_data.SHARDED].split_sizes
    ids = np.random.default_rng(num_clients).choice(num_clients, size=_READS.value)
    ids = [tf.constant(client_data.client_id_for(int(k))) for k in ids]
    readers = {layout: _readers(spec) for layout, spec in specs.items()}
    for comp, fn, _ in readers.values():  # warm up: first calls compile
        _time_calls(comp, ids[:3])
        _time_calls(fn, ids[:3])
    times = {layout: {'tff': [], 'tf_function': []} for layout in readers}
    for c in ids:  # alternate the layouts, client by client
        for layout, (comp, fn, _) in readers.items():
            times[layout]['tff'] += _time_calls(comp, [c])
            times[layout]['tf_function'] += _time_calls(fn, [c])
    for layout, (_, _, trace) in readers.items():
        row[layout]['read_in_tff_worker'] = _summary(times[layout]['tff'])
        row[layout]['read_tf_function'] = _summary(times[layout]['tf_function'])
        row[layout]['trace_seconds'] = trace
    for c in ids[:20]:  # the same values from both layouts
        old = readers[client_data.PER_CLIENT][0](c)
        new = readers[client_data.SHARDED][0](c)
        assert np.asarray(old[0]).tobytes() == np.asarray(new[0]).tobytes() and int(old[1]) == int(new[1])
    row['index'] = _index_as_constants(specs[client_data.SHARDED])
    print(f'{num_clients} reads: { {k: v.get("read_in_tff_worker") for k, v in row.items() if isinstance(v, dict)} }')
    for layout, spec in specs.items():
        t = time.perf_counter()
        shutil.rmtree(spec.root)
        row[layout]['delete_seconds'] = time.perf_counter() - t
    return row


def _mb(n):
    return f'{n / 1e6:,.1f}'


def write_markdown(result, path):
    old, new = client_data.PER_CLIENT, client_data.SHARDED
    lines = [
        '# Client data at scale: sharded files with an index vs one directory per client',
        '',
        f'`{COMMAND}` ({result["machine"]}; load average at the start {result["load_average"]}; the machine is',
        'shared with other benchmarks, so times vary by tens of percent).',
        '',
        'Synthetic(1,1), natural partition, seed 0, split 0.6/0.2/0.2: `pipeline.prepare`, the path the training',
        'binary takes for `--dataset=synthetic` (generated and split client by client, each client written as it',
        'comes). Each layout starts after an `os.sync()`; "prepare": wall clock until `prepare` returns (written',
        'pages may still be in the page cache); "+ sync": until a following `os.sync()` returns (on disk). "MB":',
        'apparent size of the files; "MB allocated": blocks on disk (directories included).',
        '',
        '## Setup (partition + client files)',
        '',
        '| clients | examples | generate + split only (s) | per-client: prepare (s) | + sync (s) | files | MB '
        '| MB allocated | sharded: prepare (s) | + sync (s) | files | MB | MB allocated '
        '| delete per-client / sharded (s) |',
        '|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for r in result['rows']:
        lines.append(
            f'| {r["num_clients"]:,} | {r["examples"]:,} | {r["generate_and_split_seconds"]:.1f} '
            f'| {r[old]["prepare_seconds"]:.1f} | {r[old]["prepare_and_sync_seconds"]:.1f} | {r[old]["files"]:,} '
            f'| {_mb(r[old]["bytes"])} | {_mb(r[old]["allocated_bytes"])} '
            f'| {r[new]["prepare_seconds"]:.1f} | {r[new]["prepare_and_sync_seconds"]:.1f} | {r[new]["files"]:,} '
            f'| {_mb(r[new]["bytes"])} | {_mb(r[new]["allocated_bytes"])} '
            f'| {r[old]["delete_seconds"]:.1f} / {r[new]["delete_seconds"]:.1f} |'
        )
    lines += [
        '',
        "## Reading one client's training split by its id",
        '',
        f'{result["reads"]} random clients per size, the same for both layouts, alternating; warm page cache.',
        '"TFF": a `tff.tensorflow.computation(tf.string)` that reads the split (`client_data.read_split`) and sums',
        'its features, called from Python through the TFF worker (includes TFF\'s per-call cost); "TF": the same',
        'graph as a `tf.function`. Milliseconds per call, median (90th percentile).',
        '',
        '| clients | per-client, TFF | sharded, TFF | per-client, TF | sharded, TF |',
        '|---:|---:|---:|---:|---:|',
    ]

    def cell(d):
        return f'{d["median_ms"]:.2f} ({d["p90_ms"]:.2f})'

    for r in result['rows']:
        lines.append(
            f'| {r["num_clients"]:,} | {cell(r[old]["read_in_tff_worker"])} | {cell(r[new]["read_in_tff_worker"])} '
            f'| {cell(r[old]["read_tf_function"])} | {cell(r[new]["read_tf_function"])} |'
        )
    lines += [
        '',
        '## The index in the graph: memory-mapped file vs constants',
        '',
        "A computation reading one client's split with the index memory-mapped from `index.i64` (what",
        '`read_split` does), against one that only looks the client up in the index embedded as a constant',
        '(the train row: `num_clients + 1` int64).',
        '',
        '| clients | memory-mapped: trace (s) | serialized bytes | constants: trace (s) | serialized bytes |',
        '|---:|---:|---:|---:|---:|',
    ]
    for r in result['rows']:
        m, c = r['index']['index_memory_mapped'], r['index']['index_as_constants']
        lines.append(
            f'| {r["num_clients"]:,} | {m["trace_seconds"]:.2f} | {m["serialized_bytes"]:,} '
            f'| {c["trace_seconds"]:.2f} | {c["serialized_bytes"]:,} |'
        )
    lines.append('')
    with open(path, 'w') as f:
        f.write('\n'.join(lines))


def main(argv):
    del argv
    if _RENDER.value:
        with open(_OUT.value + '.json') as f:
            write_markdown(json.load(f), _OUT.value + '.md')
        return
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='client_data_shards.')
    os.makedirs(workdir, exist_ok=True)
    result = {
        'command': COMMAND,
        'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores',
        'load_average': ' '.join(f'{v:.1f}' for v in os.getloadavg()),
        'reads': _READS.value,
        'rows': [],
    }
    try:
        with runtime.local_runtime():
            for n in _SIZES.value:
                result['rows'].append(measure(int(n), workdir))
    finally:
        if not _WORKDIR.value:
            shutil.rmtree(workdir, ignore_errors=True)
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1)
    write_markdown(result, _OUT.value + '.md')
    print(open(_OUT.value + '.md').read())


if __name__ == '__main__':
    app.run(main)
