"""The launcher's side: what runs in the user's shell and in mpirun's parent process, never in a rank.

``cli`` (the ``hpctrain`` command), ``launch`` (mpirun's command, its signals,
an elastic launch's relay of its output), ``elastic_driver`` (the discovery
script's hosts, restarts after a lost node or onto more hosts), ``mpirun_output``
(what an elastic launch relays), ``check``, ``info``, ``tune``.  It talks to
the ranks only through :mod:`hpctrain.launcher_protocol`.
"""
