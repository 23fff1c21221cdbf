"""Fault injection under tensor parallelism on CPU (spawned gloo ranks), issue 16. One behaviour per test.

Each test bounds its waits with LOWLAT_TP_TIMEOUT (start-up) and step_timeout_s (steps) of seconds, and checks
that no worker process is left behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _procs import wait_no_children
from fault_fakes import fault_source
from lowlat import Engine, EngineConfig, SamplingParams
from lowlat.errors import LowlatPluginError
from lowlat.runtime.deadline import StepDeadlineExceeded
from plugin_dists import activate, make_plugin_dist

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
KW = dict(model="tiny-qwen3", device="cpu", dtype="float32", max_batch_size=2, max_context_len=32, page_size=4)


@pytest.fixture
def install(tmp_path, monkeypatch):
    site = tmp_path / "site"
    activate(site, monkeypatch)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("LOWLAT_TP_TIMEOUT", "40")

    def _install(name: str, fault: str = "") -> str:
        make_plugin_dist(site, name, fault_source(fault))
        monkeypatch.setenv("LOWLAT_PLUGINS", name)
        return name

    yield _install
    assert not wait_no_children(15), "a TP worker was left behind"


def greedy(e: Engine, n: int = 3) -> list[list[int]]:
    return [c.token_ids for c in e.generate(PROMPTS, SamplingParams(max_new_tokens=n))]


def test_auto_with_import_failing_on_one_rank_falls_back_together(install):
    install("flaky", "import_fails_on_rank1")
    with Engine(EngineConfig(plugin="none", **KW)) as e:
        want = greedy(e)
    with Engine(EngineConfig(plugin="auto", tp_size=2, **KW)) as e:
        host = e.runner.plugin_host
        assert host.selection is None
        assert any(r.startswith("flaky: not usable on every rank (not on rank(s) 1") and "libvendor.so" in r
                   for r in host.rejections), host.rejections
        assert greedy(e) == want


def test_explicit_plugin_failing_to_import_on_one_rank_fails_on_every_rank(install):
    install("flaky", "import_fails_on_rank1")
    t0 = time.monotonic()
    with pytest.raises(LowlatPluginError, match=r"rank 0: ok; rank 1: PluginLoadError.*libvendor.so"):
        Engine(EngineConfig(plugin="flaky", tp_size=2, **KW))
    assert time.monotonic() - t0 < 40


def test_explicit_plugin_failing_to_build_on_one_rank_fails_on_every_rank(install):
    install("flaky", "build_fails_on_rank1")
    with pytest.raises(LowlatPluginError, match=r"'flaky' failed to build on 1 of 2 ranks.*rank 1: PluginBuildError"):
        Engine(EngineConfig(plugin="flaky", tp_size=2, **KW))


def test_auto_at_tp4_with_build_failing_on_rank2_falls_back_together(install):
    install("flaky", "build_fails_on_rank2")
    with Engine(EngineConfig(plugin="auto", tp_size=4, **KW)) as e:
        host = e.runner.plugin_host
        assert host.selection is None and host.dispatcher is None
        assert any("flaky: its guard passed but build failed on 1 of 4 ranks" in r and "rank 2: PluginBuildError" in r
                   for r in host.rejections), host.rejections
        greedy(e, 2)
        assert set(e.stats.paths_as_dict()) == {"general"}


def test_stopped_worker_misses_the_step_deadline_naming_the_rank(install, monkeypatch):
    monkeypatch.setenv("LOWLAT_STEP_TIMEOUT", "3")
    e = Engine(EngineConfig(plugin="none", tp_size=2, **KW))
    try:
        greedy(e, 2)
        worker = e._workers.procs[0]
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        stuck = r"rank 0 of 2: step \d+ .*rank\(s\) 1 did not.*3 s.*step_timeout_s"
        with pytest.raises(StepDeadlineExceeded, match=stuck):
            greedy(e, 2)
        assert time.monotonic() - t0 < 20
        worker.join(10)
        assert not worker.is_alive(), "the stopped worker was stopped for good"
        with pytest.raises(RuntimeError, match="failed in an earlier step"):
            greedy(e, 2)
    finally:
        e.close()


def test_spawned_ranks_listen_on_loopback_only(install):
    def listening_inodes() -> dict[str, str]:
        out = {}
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    out[cols[9]] = cols[1].split(":")[0]
        return out

    def socket_inodes(pid: int) -> set[str]:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        return inodes

    with Engine(EngineConfig(plugin="none", tp_size=2, **KW)) as e:
        pids = [os.getpid(), *(p.pid for p in e._workers.procs)]
        ours = set().union(*(socket_inodes(p) for p in pids))
        addrs = {ino: a for ino, a in listening_inodes().items() if ino in ours}
        assert addrs, "the rendezvous store listens somewhere"
        loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
        assert set(addrs.values()) <= loopback, addrs
