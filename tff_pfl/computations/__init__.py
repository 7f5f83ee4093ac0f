"""Typed TFF building blocks shared by every algorithm."""
