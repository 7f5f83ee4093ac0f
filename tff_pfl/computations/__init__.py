"""Typed TFF building blocks shared by every algorithm.

Importing this package imports `tff_pfl.runtime`, which replaces TFF's
lazily started (and never reaped) local worker by a context that asks for a
project-owned `runtime.local_runtime()`.
"""

from tff_pfl import runtime as _runtime  # noqa: F401  (installs NoRuntimeContext)
