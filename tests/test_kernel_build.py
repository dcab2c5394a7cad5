"""The native kernels' build never waits on a dead builder, and two installs never share (and rebuild) a folder."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import time

from sieve.kernels import KERNEL_SOURCES, build_key, build_lock

HOLD = """
import fcntl, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write(str(os.getpid())); f.flush()
print("held", flush=True)
time.sleep(600)
"""


def test_a_builder_killed_midway_blocks_no_later_build(tmp_path, caplog):
    """torch's loader leaves its `lock` file when its build is killed, and every later load waited on it forever,
    printing nothing. A builder holding the flock removes that file; one waiting on a live builder logs its pid, and
    takes over as soon as that process is gone (killed, not released)."""
    (tmp_path / "lock").write_text("")  # what a killed torch build leaves
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "sieve-build.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        got = threading.Event()

        def build():
            with build_lock(tmp_path, log_every_s=0.1):
                got.set()

        with caplog.at_level(logging.WARNING, logger="sieve"):
            waiter = threading.Thread(target=build, daemon=True)
            waiter.start()
            time.sleep(0.5)
            assert not got.is_set()  # a live builder is waited for...
            assert f"waiting for process {holder.pid}" in caplog.text  # ...saying whom
            holder.kill()
            assert got.wait(10)  # gone: taken over at once
    finally:
        holder.kill()
        holder.wait()


def test_two_installs_build_in_folders_of_their_own(tmp_path):
    copy = shutil.copytree(KERNEL_SOURCES, tmp_path / "kernels")
    assert build_key("avx2", copy) != build_key("avx2", KERNEL_SOURCES)
    assert build_key("avx2", copy).split("-")[0] == build_key("avx2", KERNEL_SOURCES).split("-")[0]  # the same sources
