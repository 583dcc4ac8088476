"""The backends: the buffer primitives one library implements (MPI, Horovod, a world of one)."""
