"""Plugins that misbehave in one way each, for test_faults*.py (built on plugin_fakes.MIRROR).

``fault_source(fault)`` returns a module source; the faults:

* ``exit_at_import``: ``sys.exit(3)`` when imported.
* ``import_fails_on_rank1``: ImportError at import on TP rank 1 only.
* ``exit_in_build``: ``sys.exit(4)`` in build.
* ``build_fails_on_rank1`` / ``build_fails_on_rank2``: build raises on that TP rank only.
* ``edits_params``: build scales a parameter of the general model in place.
* ``stuck_forward``: forward blocks until ``RELEASE`` (a threading.Event in the module) is set, 120 s at most.
"""

from plugin_fakes import mirror_source

EXTRA = """
import sys, threading
import torch.distributed as _dist

FAULT2 = %(fault)r
RELEASE = threading.Event()

if FAULT2 == "exit_at_import":
    sys.exit(3)
if FAULT2 == "import_fails_on_rank1" and _dist.is_initialized() and _dist.get_rank() == 1:
    raise ImportError("libvendor.so: cannot open shared object file (rank 1 only)")

_mirror_build = build

def build(binding):
    if FAULT2 == "exit_in_build":
        sys.exit(4)
    if FAULT2.startswith("build_fails_on_rank") and binding.tp_rank == int(FAULT2[-1]):
        raise RuntimeError(f"no kernel for this GPU (rank {binding.tp_rank} only)")
    if FAULT2 == "edits_params":
        with torch.no_grad():
            binding.params["model.layers.0.mlp.down_proj.weight"].mul_(2.0)
    return _mirror_build(binding)

_mirror_forward = Mirror.forward

def _forward(self, batch):
    if FAULT2 == "stuck_forward":
        RELEASE.wait(120)
    return _mirror_forward(self, batch)

Mirror.forward = _forward
"""


def fault_source(fault: str = "") -> str:
    """A MIRROR plugin with ``fault`` (see the module docstring); "" is a correct plugin serving TP 1, 2 and 4."""
    src = mirror_source("").replace("tp_sizes=frozenset({1, 2})", "tp_sizes=frozenset({1, 2, 4})")
    return src + EXTRA.replace("%(fault)r", repr(fault))
