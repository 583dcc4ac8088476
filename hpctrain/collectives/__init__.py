"""Collective algorithms on flat numpy buffers, independent of any backend."""
