"""Code that runs on the engines.

Everything in this package executes inside ipyparallel engines (one per rank) and is
imported there by reference, never pickled by value. Functions here return small
dataclasses or plain values, never live tensors the notebook did not ask for. The
notebook side (``fsdp_nb.session`` and friends) only calls these functions through
``fsdp_nb.runtime.dispatch``.
"""
