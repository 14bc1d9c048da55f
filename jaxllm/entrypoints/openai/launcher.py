"""Running the server's app under uvicorn until it stops: on a signal, or because the engine died.

Owns the process's serving lifetime, as vLLM's launcher does:
  - SIGTERM / SIGINT: uvicorn stops accepting connections, lets in-flight responses finish
    for `timeout_graceful_shutdown` seconds (--shutdown-timeout; 0 cuts them at once), then
    the app's lifespan shuts the engine down, and uvicorn re-raises the signal, so the exit
    status says why the process ended (-SIGTERM);
  - the engine dying (`app.state.engine_client.errored`, checked on each of uvicorn's 0.1 s
    ticks): every stream has already been ended with its error (AsyncLLM does that) and
    /health says 503; the server then shuts down the same graceful way and the process
    exits with status 1 (ENGINE_DEAD_EXIT), so that a supervisor restarts it. vLLM's
    watchdog does the same (it checks every 5 s).
Never builds the app or touches requests (api_server.py does).
"""

from __future__ import annotations

import logging
import os

import uvicorn

logger = logging.getLogger("jaxllm.serve")

ENGINE_DEAD_EXIT = 1
STARTUP_FAILURE = 3  # uvicorn's own status when the app never started


class _Server(uvicorn.Server):
    """uvicorn's server, which also stops once the app's engine has died."""

    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self.engine = engine
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if self.engine is not None and self.engine.errored and not self.engine_died:
            self.engine_died = True
            logger.error("the engine died (%s): the server shuts down",
                         self.engine.dead_error)
        return self.engine_died or await super().on_tick(counter)


def serve_http(app, **uvicorn_kwargs) -> int:
    """Serve `app` until it stops; -> the process's exit status (0, or ENGINE_DEAD_EXIT, or
    STARTUP_FAILURE). A signal that stopped it is raised again on the way out (uvicorn's
    way), so the process then ends by that signal. The engine watched is
    `app.state.engine_client` (vLLM's name), when the app has one with `errored`."""
    engine = getattr(app.state, "engine_client", None)
    config = uvicorn.Config(app, **uvicorn_kwargs)
    server = _Server(config, engine if hasattr(engine, "errored") else None)
    try:
        server.run()
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if not server.started:
        return STARTUP_FAILURE
    return ENGINE_DEAD_EXIT if server.engine_died else 0
