"""Poll GET /health until killed, printing one line per poll: latency in ms, then status.

Run in its own process (`python health_poller.py URL INTERVAL_S`), so that the load a test
generates in its own process never delays the measurement. A poll that fails counts with
status 0 and the time it took.
"""

from __future__ import annotations

import sys
import time

import httpx


def main(url: str, interval: float) -> None:
    with httpx.Client(timeout=10) as client:
        while True:
            t0 = time.perf_counter()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError:
                status = 0
            elapsed = time.perf_counter() - t0
            print(f"{elapsed * 1000:.3f} {status}", flush=True)
            time.sleep(max(0.0, interval - elapsed))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
