"""Mutation pass of the peer all-reduce: break it in one place, run its test file, expect a failure.

    python3 bench/scripts/mutate_peer_allreduce.py      # from the repository root (or a worktree's)
    python3 bench/scripts/mutate_peer_allreduce.py device_tag   # only the groups whose test file names match

Each mutation is applied to the source, its group's test file (core/tests/test_peer_allreduce.py for the kernel's
protocol and memory order, test_peer_device_tag.py for the device tag, test_peer_xproc.py for the exchange and
the address tables across processes, test_peer_tp.py for the general path's choice) runs under
TRITON_INTERPRET=1 with this checkout's core/src first on the path (a hang counts as caught after 300 s), and the
source is restored.
Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed. The memory-order
mutations (no barrier, release before the data, weaker order or scope) change nothing the interpreter computes (it
runs one program at a time): test_every_flag_release_follows_its_data_and_a_barrier catches them by watching the
interpreted operations, which checks the program as written, not the GPU's behaviour (that is the 2-GPU run's).
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

K = pathlib.Path("core/src/lowlat/kernels/peer_allreduce.py")
H = pathlib.Path("core/src/lowlat/runtime/peer_buffers.py")
_LOADS = ("                for s in tl.static_range(WORLD):\n"
          "                    v = tl.load(own_data + (parity * WORLD + s).to(tl.int64) * cap + offs, mask=mask, "
          "other=0.0)\n                    acc += v.to(tl.float32)\n")
_LOADS_EARLY = "".join(line[4:] + "\n" for line in _LOADS.splitlines())  # the same loads, one level out
_WAIT = ("            ready = wait_tiles(own_flags + (parity * cap_tiles + t) * WORLD, tag, ctl_ptr, deadline, rank, "
         "t, site, 1,\n                               WORLD, WPAD, TIMER, 1)\n")
_PUSH_DATA = ("    for p in tl.static_range(WORLD):\n"
              "        peer_data = tl.load(data_ptrs + p).to(tl.pointer_type(v.dtype))\n"
              "        tl.store(peer_data + (parity * WORLD + rank).to(tl.int64) * cap + offs, v, mask=mask)\n")
_PUSH_FLAGS = ("    for p in tl.static_range(WORLD):\n"
               "        peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))\n"
               "        tl.atomic_xchg(peer_flags + (parity * cap_tiles + tile) * WORLD + rank, tag, mask=live, "
               "sem=\"release\",\n                       scope=\"sys\")\n")
_BARRIER = "    tl.debug_barrier()  # every thread's stores of this tile happen before the release below\n"
M = [  # (name, file, original text, mutated text)
    ("wrong rank order (sum W-1 .. 0)", K, "(parity * WORLD + s).to(tl.int64)",
     "(parity * WORLD + (WORLD - 1 - s)).to(tl.int64)"),
    ("reduce before acquire (data loaded before the wait)", K,
     _WAIT + "            if ready:\n                acc = tl.zeros([BLOCK], tl.float32)\n" + _LOADS,
     "            acc = tl.zeros([BLOCK], tl.float32)\n" + _LOADS_EARLY + _WAIT + "            if ready:\n"),
    ("tag compare off by one (the previous tag counts)", K, "live & (seen != tag)", "live & (seen < tag - 1)"),
    ("tag compare: any published tag counts (stale flags)", K, "live & (seen != tag)", "live & (seen == 0)"),
    ("no parity (one slot for every step): push", K, "    parity = tag & 1\n    live =",
     "    parity = tag & 0\n    live ="),
    ("no parity (one slot for every step): reduce", K, "    parity = tag & 1\n    elem =",
     "    parity = tag & 0\n    elem ="),
    ("deadline ignored", K, "tl.where(zero + waited > deadline, 3, 0)", "tl.where(zero + waited < 0, 3, 0)"),
    ("deadline doubled", K, "tl.where(zero + waited > deadline, 3, 0)", "tl.where(zero + waited > 2 * deadline, 3, 0)"),
    ("error record not written", K, "first = timed_out & (prev == 0)", "first = timed_out & (prev == -7)"),
    ("record names this rank as the peer", K, "tl.store(ctl_ptr + CTL_PEER, peer.to(tl.int64), mask=first)",
     "tl.store(ctl_ptr + CTL_PEER, rank.to(tl.int64), mask=first)"),
    ("abort word not set", K,
     'prev = tl.atomic_xchg(ctl_ptr + CTL_ABORT, tag.to(tl.int64), mask=timed_out, sem="acq_rel", scope="gpu")',
     "prev = tl.load(ctl_ptr + CTL_ABORT)"),
    ("abort word not polled", K, "abort = tl.load(ctl_ptr + CTL_ABORT, volatile=True)",
     "abort = tl.full([], 0, tl.int64)"),
    ("an aborted wait counts as ready", K, "state = tl.where(peer >= WORLD, 1, sig)",
     "state = tl.where(peer >= WORLD, 1, tl.where(sig == 2, 1, sig))"),
    ("fault injection ignored (publish always)", K, "+ publish) != 0", "+ publish) != 2"),
    ("push only into this rank's own buffer", K, "peer_data = tl.load(data_ptrs + p)",
     "peer_data = tl.load(data_ptrs + rank)"),
    ("flag published into the wrong rank's slot", K, "* WORLD + rank, tag, mask=live", "* WORLD + p, tag, mask=live"),
    ("host check never raises", H, 'if rec["abort"] == 0:', 'if rec["abort"] != -12345:'),
    ("host message names the wrong peer", H, "{rec['peer']}'s push (step tag", "{rec['rank']}'s push (step tag"),
    ("host check on by default (a sync per call)", K,
     "out: torch.Tensor | None = None, site: int = 0,\n                check: bool = False",
     "out: torch.Tensor | None = None, site: int = 0,\n                check: bool = True"),
    ("memory order: no CTA barrier before the release", K, _BARRIER, ""),
    ("memory order: flags released before the data", K, _PUSH_DATA + _BARRIER + _PUSH_FLAGS,
     _PUSH_FLAGS + _BARRIER + _PUSH_DATA),
    ("memory order: relaxed flag store", K, 'mask=live, sem="release",', 'mask=live, sem="relaxed",'),
    ("memory order: release at gpu scope", K, 'sem="release",\n                       scope="sys")',
     'sem="release",\n                       scope="gpu")'),
    ("memory order: acquire at gpu scope", K, 'sem="acquire", scope="sys"', 'sem="acquire", scope="gpu"'),
    ("memory order: relaxed poll", K, 'sem="acquire", scope="sys"', 'sem="relaxed", scope="sys"'),
]
_BUMP = ("    tl.store(tag_ptr + TAG_LAST, tag, mask=last_program)\n"
         "    tl.store(tag_ptr + TAG_TICKET, 0, mask=last_program)\n")
_TAG = "    tag = device_tag(tag_ptr, host_tag)  # every program reads before any bump (below)"
M_TAG = [  # the device tag: run against core/tests/test_peer_device_tag.py
    ("device tag: every program bumps (no ticket)", K, "last_program = drawn == nprog - 1",
     "last_program = drawn >= 0"),
    ("device tag: the last program found off by one", K, "last_program = drawn == nprog - 1",
     "last_program = drawn == nprog"),
    ("device tag: never advances (the old tag stored back)", K, "tl.store(tag_ptr + TAG_LAST, tag, mask=last_program)",
     "tl.store(tag_ptr + TAG_LAST, tag - 1, mask=last_program)"),
    ("device tag: ticket never reset", K, _BUMP, "    tl.store(tag_ptr + TAG_LAST, tag, mask=last_program)\n"),
    ("device tag: bumped by program 0 as it starts (the race)", K, _TAG,
     _TAG + "\n    tl.store(tag_ptr + TAG_LAST, tag, mask=pid == 0)"),
    ("device tag: no wrap at TAG_CYCLE", K, "last % _TAG_CYCLE + 1", "last + 1"),
    ("device tag: the host tag ignored", K, "tl.where(host_tag > 0, host_tag,", "tl.where(host_tag < 0, host_tag,"),
    ("device tag: reset leaves it", H, "        self.flags.zero_()\n        self.tag_state.zero_()\n",
     "        self.flags.zero_()\n"),
    ("closed buffers still launch", K, "    if bufs.closed:\n", "    if bufs.closed and False:\n"),
]
M_TAG_ORDER = [  # the ticket's memory order: only the sm90 PTX check (core/tests/test_peer_allreduce.py) sees it
    ("device tag: relaxed ticket", K, 'drawn = tl.atomic_add(tag_ptr + TAG_TICKET, 1, sem="acq_rel", scope="gpu")',
     'drawn = tl.atomic_add(tag_ptr + TAG_TICKET, 1, sem="relaxed", scope="gpu")'),
]
X = pathlib.Path("core/src/lowlat/runtime/peer_exchange.py")
M_XPROC = [  # buffers across processes: run against core/tests/test_peer_xproc.py (spawned ranks)
    ("tables: this rank's own buffer in every slot", H, "[t.data_ptr() for t in ts]",
     "[ts[tp.rank].data_ptr() for t in ts]"),
    ("tables: ranks in reverse order", H, "[t.data_ptr() for t in ts]", "[t.data_ptr() for t in reversed(ts)]"),
    ("tables: the peers' mappings not kept alive", H, "timer=timer, keep=keep)", "timer=timer, keep=None)"),
    ("exchange: flags not zeroed after alloc", H, "for t in (own[\"flags\"], ctl, tag_state):",
     "for t in (ctl, tag_state):"),
    ("exchange: a peer's file mapped private", X,
     "t = torch.from_file(path, shared=True, size=nbytes // dtype.itemsize, dtype=dtype)",
     "t = torch.from_file(path, shared=False, size=nbytes // dtype.itemsize, dtype=dtype)"),
    ("exchange: this rank keeps its private buffer", X, '    return shared, ("file", path,',
     '    return t, ("file", path,'),
    ("exchange: disagreeing ranks not refused", X, "if any(v != values[0] for v in values):", "if False:"),
    ("exchange: files left in /dev/shm", X, "        keep.unlink()  # every rank has mapped", "        pass  #"),
    ("exchange: a failed collective not named", X, "except Exception as e:  # gloo", "except KeyError as e:  # gloo"),
    ("exchange: the TPInfo not checked against the group", X, "    _check_group(tp)\n", ""),
    ("exchange: an allocation failure kept from the peers", H, "except Exception as e:  # told to the other ranks",
     "except KeyError as e:  # told to the other ranks"),
]
R = pathlib.Path("core/src/lowlat/runtime/peer_reduce.py")
D = pathlib.Path("core/src/lowlat/distributed.py")
M_TP = [  # the general path's choice (EngineConfig.all_reduce): run against core/tests/test_peer_tp.py
    ("tp: the peer never takes a sum", R, "if b is None or not b.fits(x):", "if True:"),
    ("tp: every size to the peer (no NCCL beyond the buffers)", R, "if b is None or not b.fits(x):",
     "if b is None:"),
    ("tp: all_reduce ignores the group's peer", D, "if site is not None and tp.peer is not None:",
     "if False and tp.peer is not None:"),
    ("tp: calls without a site take the peer", D, "if site is not None and tp.peer is not None:",
     "if tp.peer is not None:"),
    ("tp: o_proj's site is the MLP's", pathlib.Path("core/src/lowlat/models/llama.py"),
     "device=device, site=2 * layer_id)", "device=device, site=2 * layer_id + 1)"),
    ("tp: the peer record not asked before NonFiniteLogits", pathlib.Path("core/src/lowlat/runtime/step_guard.py"),
     "        if cause is not None:\n            cause()\n", ""),
    ("tp: a CPU without the interpreter not refused at start", R,
     "        check_launchable(device, \"all_reduce='peer' (--all-reduce peer) on a CPU\")\n", ""),
    ("tp: the runner never opens the buffers", pathlib.Path("core/src/lowlat/runtime/model_runner.py"),
     "            self.open_peer()\n", ""),
]
GROUPS = [(M + M_TAG_ORDER, "core/tests/test_peer_allreduce.py"), (M_TAG, "core/tests/test_peer_device_tag.py"),
          (M_XPROC, "core/tests/test_peer_xproc.py"), (M_TP, "core/tests/test_peer_tp.py")]
if __name__ == "__main__":  # importing the lists (e.g. to check their anchors) runs nothing
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(["core/src", os.environ.get("PYTHONPATH", "")])}
    only = sys.argv[1:]  # optional: run only the groups whose test file names contain one of these words
    sys.exit(max(mutation_runner.run(ms, f, env) for ms, f in GROUPS if not only or any(w in f for w in only)))
