"""Process groups destroyed while the interpreter is whole: at exit, before Python tears itself down.

Lightning destroys the process group at exit for NCCL only. A gloo group left to the interpreter's
finalisation still has worker threads and pending work (a PowerSGD hook's futures hold Python
callbacks and tensors); tearing those down after Python has begun to finalise aborts the process
now and then ("terminate called without an active exception") after a fit that succeeded. Our
strategies register :func:`destroy_process_groups_at_exit` once a group exists, whatever the backend.

Example::

    >>> import torch.distributed as dist
    >>> destroy_process_groups_at_exit()  # registered once, however often it is called
    >>> destroy_process_groups()  # no group here: nothing to do
    >>> dist.is_initialized()
    False
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

__all__ = ["destroy_process_groups", "destroy_process_groups_at_exit"]

_registered = False


def destroy_process_groups() -> None:
    """Destroy every process group of this process (the default one and all made by ``new_group``), if any."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_groups_at_exit() -> None:
    """Have :func:`destroy_process_groups` run at interpreter exit (once, however often this is called).

    ``atexit`` runs its handlers last-registered first, so a handler registered before the first fit
    still finds the groups gone.
    """
    global _registered
    if not _registered:
        atexit.register(destroy_process_groups)
        _registered = True
