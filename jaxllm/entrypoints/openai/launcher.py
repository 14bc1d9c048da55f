"""Running the server's app under uvicorn until it stops: on a signal, or because the engine died.

Owns the process's serving lifetime, as vLLM's launcher does:
  - SIGTERM / SIGINT: uvicorn stops accepting connections and lets the requests in flight
    finish for `shutdown_timeout` seconds (--shutdown-timeout; 0: none); then the engine
    aborts those still running, whose responses end with finish_reason "abort" (vLLM's), and
    get ABORT_GRACE_S more to be sent before uvicorn cuts any connection left. Then the
    app's lifespan shuts the engine down, and uvicorn re-raises the signal, so the exit
    status says why the process ended (-SIGTERM);
  - the engine dying (`app.state.engine_client.errored`, checked on each of uvicorn's 0.1 s
    ticks): every stream has already been ended with its error (AsyncLLM does that) and
    /health says 503; the server then shuts down the same way and the process exits with
    status 1 (ENGINE_DEAD_EXIT), so that a supervisor restarts it. vLLM's watchdog does the
    same (it checks every 5 s).
Never builds the app or touches a request itself (api_server.py does).
"""

from __future__ import annotations

import asyncio
import logging
import os

import uvicorn

logger = logging.getLogger("jaxllm.serve")

ENGINE_DEAD_EXIT = 1
STARTUP_FAILURE = 3  # uvicorn's own status when the app never started
ABORT_GRACE_S = 1.0  # for the aborted requests' last bytes, after the shutdown timeout


class _Server(uvicorn.Server):
    """uvicorn's server, which also stops once the app's engine has died, and aborts the
    engine's requests when the shutdown timeout is over."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if self.engine is not None and self.engine.errored and not self.engine_died:
            self.engine_died = True
            logger.error("the engine died (%s): the server shuts down",
                         self.engine.dead_error)
        stop = self.engine_died or await super().on_tick(counter)
        if stop and self.engine is not None:  # the last tick: the shutdown starts
            asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort)
        return stop

    def _abort(self) -> None:
        if self.server_state.tasks:
            logger.info("shutdown timeout (%s s) over: aborting the requests in flight",
                        self.shutdown_timeout)
        self.engine.abort_all()


def serve_http(app, *, timeout_graceful_shutdown: float = 30, **uvicorn_kwargs) -> int:
    """Serve `app` until it stops; -> the process's exit status (0, or ENGINE_DEAD_EXIT, or
    STARTUP_FAILURE). timeout_graceful_shutdown: --shutdown-timeout. A signal that stopped
    the server is raised again on the way out (uvicorn's way), so the process then ends by
    that signal. The engine watched is `app.state.engine_client` (vLLM's name), when the app
    has one with `errored`; without one, connections are cut at the timeout."""
    engine = getattr(app.state, "engine_client", None)
    engine = engine if hasattr(engine, "errored") else None
    grace = ABORT_GRACE_S if engine is not None else 0.0
    config = uvicorn.Config(app, timeout_graceful_shutdown=timeout_graceful_shutdown + grace,
                            **uvicorn_kwargs)
    server = _Server(config, engine, timeout_graceful_shutdown)
    try:
        server.run()
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if not server.started:
        return STARTUP_FAILURE
    return ENGINE_DEAD_EXIT if server.engine_died else 0
