"""A node of a multi-node instance that lost its group starts over in place.

torch.distributed cannot take a rank out of a group or put one back, and a rank caught in a
collective with a lost peer may never return from it (gloo waits out its timeout; an NCCL
communicator is unusable after a peer failure). So the instance re-forms from scratch: each
node's process that is still alive replaces itself with a fresh one (exec: same pid, command
line and log, so a supervisor or container sees it still running), which loads the weights and
waits for the group again, up to --dist-timeout, as at a first start (a new rendezvous: a new
TCP store on node 0, new ranks everywhere). Only a node whose process is gone has to be
restarted. Meanwhile node 0's gRPC says why it is not serving (common.service.gate).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

logger = logging.getLogger(__name__)

_LOST = "PDFLASH_REFORMING_AFTER"  # why the process before the exec started over


def not_serving_why(nodes) -> str:
    """What a starting process of an instance is waiting for, and after what, for its health."""
    waiting = f"loading the model, waiting for nodes 1-{nodes.nnodes - 1} to join" if nodes.multi else "loading the model"
    lost = os.environ.get(_LOST)
    return f"re-forming after: {lost}; {waiting}" if lost else f"starting: {waiting}"


def restart_in_place(why: str) -> NoReturn:
    """Exec this process's own command line. The caller has stopped its ranks (child processes)."""
    logger.critical("%s; this process starts over in place and waits for the instance's nodes again", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing of this process may outlive the exec: a listening socket inherited by the new image
    # (the TCP store's, Mooncake's) would hold its port, and a pipe would keep the forkserver alive.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the listing's own descriptor, closed by now
                pass
    os.environ[_LOST] = why
    os.execv(sys.executable, sys.orig_argv)
