"""The names of ``horovod.common`` that Horovod users' code and Horovod's own tests import."""
