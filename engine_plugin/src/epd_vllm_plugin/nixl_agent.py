"""A NIXL agent for a CPU engine, for any EC connector of the kit (no vLLM import here).

Two settings matter on CPU (issue 54; nixl 1.5.1's Python API, `nixl/_api.py`):

- **No progress thread.** `nixl_agent_config(enable_prog_thread=True)` is the default and the
  Python API sets the thread's delay to 0 (`agent_config.pthrDelay = 0`); NIXL's UCX backend
  waits in `poll()` with that delay rounded up to whole milliseconds, 0
  (ai-dynamo/nixl `src/plugins/ucx/ucx_backend.cpp` nixlUcxSharedThread), so the thread spins a
  core on an idle engine. Without it, UCX progresses inside the agent's own calls
  (`check_xfer_state`, `get_new_notifs`, which runs `progressLoop`, `ucx_backend.cpp` getNotifs),
  which the connector makes only while a transfer is open.
- **UCX's TCP transport on the engine's own interface.** UCX_TLS=tcp comes from the plan
  (otherwise UCX takes `cma` between processes of one kernel, network namespaces or not);
  UCX_NET_DEVICES is the interface holding the engine's address, found here on the host
  (the plan knows addresses, not interface names), unless the environment names one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Iterable
from typing import Any

INSTALL = "pip install nixl-cu13==1.5.1 and nixl==1.5.1 --no-deps"


def interface_of(address: str) -> str:
    """The network interface holding `address` (psutil, a vLLM requirement)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    raise ValueError(f"no interface of this host has the address {address} (ucx_address)")


def set_ucx_device(address: str | None) -> None:
    """UCX_NET_DEVICES := the interface of `address`, unless the environment names one. UCX reads
    it when NIXL creates its UCX backend (the agent), so call this before `nixl_agent`."""
    if address and "UCX_NET_DEVICES" not in os.environ:
        os.environ["UCX_NET_DEVICES"] = interface_of(address)


def nixl_agent(name: str, backends: Iterable[str], who: str = "the kit's NIXL EC connector") -> Any:
    """A NIXL agent with `backends`, without its progress thread, thread-safe (STRICT: a
    side-channel thread may progress it while the engine's thread uses it)."""
    try:
        from nixl._api import nixl_agent as agent_class
        from nixl._api import nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise ImportError(f"{who} needs the nixl package ({INSTALL}): {exc}") from exc
    backends = list(backends)
    config = nixl_agent_config(
        enable_prog_thread=False, backends=backends, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = agent_class(name, config)
    # `kill -USR2 <the engine process>` prints every thread's Python stack to its log (stderr): where
    # a side channel or a read waits when it stops answering (issue 54's restarted VE). vLLM 0.24-0.32
    # register no SIGUSR2 handler (grep of their wheels). chain=False: the previous handler is the
    # default, which ends the process (a chained dump killed a VE worker in the three-host run)
    with contextlib.suppress(RuntimeError, OSError, ValueError):  # no file descriptor 2 (faulthandler's error)
        faulthandler.register(signal.SIGUSR2, file=2, all_threads=True, chain=False)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise RuntimeError(f"{who}: NIXL has no {missing} backend here (plugins: {agent.get_plugin_list()})")
    return agent
