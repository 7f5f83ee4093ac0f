"""Memory of a benchmark's driver process and of its TFF workers, for the scale benchmarks."""

import psutil


def driver_and_worker_mb() -> tuple[float, float, float]:
    """This process's RssAnon and RssFile, and its TFF workers' total RSS, in MB.

    Returns:
      `(driver RssAnon, driver RssFile, worker RSS)`; the worker's is NaN
      when no `worker_binary` runs under this process.
    """
    fields = {}
    with open('/proc/self/status') as f:
        for line in f:
            name, _, value = line.partition(':')
            if name in ('RssAnon', 'RssFile'):
                fields[name] = int(value.split()[0]) / 1024
    workers = [c for c in psutil.Process().children(recursive=True) if 'worker_binary' in ' '.join(c.cmdline())]
    worker = sum(w.memory_info().rss for w in workers) / 2**20 if workers else float('nan')
    return fields['RssAnon'], fields['RssFile'], worker
