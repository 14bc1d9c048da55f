"""jaxllm/kernels/csrc/thread_pool.h on its own: every item of every job runs exactly once,
whichever thread takes it, with workers that sleep between jobs (spin 0) and that poll for
the next one (spin 200 us), over many jobs of different sizes back to back (a worker that
wakes late must not take an item of a job it did not read: the job's fields change under it).

The header is compiled here into a small driver with the system's C++ compiler, as setup.py
builds the kernel libraries; without one the libraries are not built either."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

CSRC = os.path.join(os.path.dirname(__file__), "..", "..", "jaxllm", "kernels", "csrc")
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool uses Linux APIs"),
    pytest.mark.skipif(CXX is None, reason="no C++ compiler: the kernel libraries are not built"),
]

DRIVER = r"""
#include "thread_pool.h"
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <vector>
int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]), spin_us = std::atoi(argv[2]), jobs = std::atoi(argv[3]);
  // Leaked, as the libraries' pools are: the workers never exit.
  jaxllm::ThreadPool& pool = *new jaxllm::ThreadPool(threads, spin_us);
  std::vector<std::atomic<int>> runs(160);
  long wrong = 0;
  for (int j = 0; j < jobs; ++j) {
    const int n = 1 + (j * 7919) % 150;
    for (auto& r : runs) r.store(0);
    pool.Run(n, [&](int i) {
      volatile int sink = 0;
      for (int k = 0; k < (i % 5) * 40; ++k) sink = sink + k;  // items of unequal length
      runs[i].fetch_add(1);
    });
    for (int i = 0; i < 160; ++i) wrong += runs[i].load() != (i < n ? 1 : 0);
  }
  std::printf("%ld\n", wrong);
  std::fflush(stdout);
  _exit(0);
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = tmp_path_factory.mktemp("thread_pool")
    src, exe = d / "driver.cc", d / "driver"
    src.write_text(DRIVER)
    subprocess.run([CXX, "-std=c++17", "-O2", "-pthread", "-I", CSRC, str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


@pytest.mark.parametrize("threads,spin_us", [(2, 0), (2, 200), (4, 0), (4, 200)])
def test_every_item_runs_exactly_once(driver, threads, spin_us):
    out = subprocess.run([str(driver), str(threads), str(spin_us), "20000"], check=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0"
