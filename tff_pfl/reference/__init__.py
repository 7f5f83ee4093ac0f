"""Small numpy re-implementations of algorithms, for tests and benchmarks."""
