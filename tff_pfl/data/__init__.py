"""Data sources, client partitioning and per-client splits."""
