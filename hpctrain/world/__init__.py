"""The world of this process: its life (init, shutdown, re-formings), its communicator and its hooks.

The world communicator is the one process-wide object (as ``MPI.COMM_WORLD``
is); sub-communicators from ``split`` are ordinary objects passed where they
are needed.  This package owns it:

* ``lifecycle.py``: :func:`init` (the backend chosen, settings agreed),
  :func:`shutdown` (at exit too, with the ``sys.exit`` status), :func:`world`,
  and the re-formed world put in place (elastic mode);
* ``exit_hooks.py``: what an uncaught exception, a Ctrl-C and the interpreter's
  exit do to the job, as the world's failure policy says
  (:mod:`hpctrain.comm.life.failure_policy`);
* ``generation.py``: how many times the world re-formed, and the callbacks
  that follow it (:func:`on_reform`).

The close, interrupt and re-form callbacks have one shape,
``(callback, owner=None) -> remove`` with the owner held weakly
(:class:`hpctrain.hooks.Hooks`): ``world().on_close``, ``world().on_interrupt``,
:func:`on_reform`.  The world imports neither the launcher nor
:mod:`hpctrain.elastic`: elastic mode subscribes to it.
"""
from .generation import generation, on_reform, on_reform_of
from .lifecycle import (BACKENDS, comm_or_world, exit_status, fail_this_rank, init, is_initialized, resolve_backend,
                        shutdown, world)

__all__ = ["init", "shutdown", "is_initialized", "world", "resolve_backend", "BACKENDS", "on_reform", "on_reform_of",
           "generation", "comm_or_world", "exit_status", "fail_this_rank"]
