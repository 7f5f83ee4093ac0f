"""Running a binary, driver and local TFF worker, in a private network namespace.

TFF's `worker_binary` listens without authentication on all interfaces; a
local simulation needs no network, so the binaries re-execute themselves in
a network namespace of their own that holds only a loopback interface
(`isolate_network`).
"""

import os
import shutil
import subprocess
import sys

# Set in the environment of a process re-executed in its own network namespace.
_ISOLATED_ENV = 'TFF_PFL_NETWORK_NAMESPACE'


def network_isolated() -> bool:
    """True in a process that `isolate_network` re-executed in a private network namespace.

    Returns:
        Whether `TFF_PFL_NETWORK_NAMESPACE` is `1` in the environment.
    """
    return os.environ.get(_ISOLATED_ENV) == '1'


def namespaces_allowed() -> bool:
    """Whether this kernel lets an unprivileged process make a network namespace (`unshare` is tried).

    Returns:
        True if `unshare --net --map-root-user true` succeeds.
    """
    unshare = shutil.which('unshare')
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, '--net', '--map-root-user', 'true'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
    )
    return probe.returncode == 0


def _bring_loopback_up() -> None:
    """Sets the namespace's `lo` up (it starts down), so the worker and the driver can talk."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack('16sH22x', b'lo', 0)
        flags = struct.unpack('16sH22x', fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack('16sH22x', b'lo', flags | iff_up))


def isolate_network(prog: str, argv: list, log=None) -> None:
    """Re-executes this binary in a private network namespace, or warns that it cannot.

    TFF's `worker_binary` listens without authentication on all interfaces,
    and whoever reaches its port can run TensorFlow graphs (which read and
    write files) as this user. A local simulation needs no network, so the
    whole process, driver and worker, moves into a new network namespace of
    its own (`unshare --net --map-root-user`, an unprivileged user namespace
    where the kernel allows them) that holds only a loopback interface: no
    other process on the machine, let alone on the network, can reach the
    worker's port. The process keeps its PID (`exec`), its files and its
    user outside the namespace.

    Where the kernel does not allow it, the run goes on with a one-line
    warning on stderr that names the port and where docs/runtime.md shows a
    firewall rule.

    Args:
      prog: the binary's name, for messages.
      argv: the full command line to run again (`sys.argv`).
      log: optional; receives the warning line (default: stderr).
    """
    if network_isolated():
        _bring_loopback_up()
        return
    if not namespaces_allowed():
        message = (
            f'{prog}: warning: cannot run in a private network namespace (unshare --net --map-root-user '
            'failed); the local TFF worker will accept unauthenticated connections on all interfaces; '
            'see docs/runtime.md#security'
        )
        (log or (lambda line: print(line, file=sys.stderr)))(message)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, **{_ISOLATED_ENV: '1'})
    os.execvpe('unshare', ['unshare', '--net', '--map-root-user', sys.executable, *argv], env)
