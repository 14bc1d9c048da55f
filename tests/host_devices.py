"""Running a script on N host CPU devices, for the tests of tensor and data parallelism.

Owns: the subprocess that gives a script its own jax with
`--xla_force_host_platform_device_count=N` (the device count is fixed when jax starts, so it
cannot change inside the test process), and the failure message that shows the script's
output. Never interprets what the script prints.
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_on_host_devices(args: list[str], count: int, timeout: int = 900
                        ) -> subprocess.CompletedProcess:
    """`python *args` on `count` host CPU devices; fails the test (with the tail of its
    output) unless it exits 0."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={count}")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
