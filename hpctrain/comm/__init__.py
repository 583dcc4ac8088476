"""Communicators: the interface (base) and its backends (mpi, horovod, local)."""
