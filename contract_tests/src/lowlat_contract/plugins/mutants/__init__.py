"""The mutation campaign: single-defect plugins derived from the reference, each a realistic kernel bug.

Every mutant is ``HookedReference`` (the reference's forward cut at its seams, ``_base.py``) with a few lines
changed, and an entry of ``MUTANTS`` (``registry.py``): its kind, the defect, the trigger (the shape that
shows it; ``lowlat_contract.mutation_probe`` runs it and proves the defect real: logits, K/V or state differ
from the general path there), the contract(s) expected to catch it, and whether suite 0.2 misses it.

``contract_tests/tests/test_mutants.py`` runs the suite on each and asserts it fails in an expected contract;
``contract_tests/tests/mutants/ESCAPES.md`` lists the mutants suite 0.2 misses and the condition that catches
each. None is an installed entry point: ``install_mutant_plugins(site_dir)`` writes one dist-info exposing all
of them (entry point name = mutant name), so discovery, the guard and ``build`` run as for a vendor.

All mutants share one build function, ``build``: it looks the mutant up by ``binding.plugin`` (the entry point
name the runtime loaded it under).
"""

from __future__ import annotations

from typing import Any

from lowlat_contract.plugins.mutants.registry import MUTANTS, Mutant, Trigger, install_mutant_plugins

BUILD = "lowlat_contract.plugins.mutants:build"


def build(binding: Any) -> Any:
    """The spec's ``build`` for every mutant: ``MUTANTS[binding.plugin].cls(binding)``.

    Raises:
        KeyError: ``binding.plugin`` is not a mutant's name.
    """
    return MUTANTS[binding.plugin].cls(binding)


def __getattr__(name: str) -> Any:
    """``hooks_<mutant>``: the pluggy object of a mutant's entry point (its specs, build path BUILD)."""
    if name.startswith("hooks_") and name[6:] in MUTANTS:
        return MUTANTS[name[6:]].hooks(BUILD)
    raise AttributeError(name)


__all__ = ["BUILD", "MUTANTS", "Mutant", "Trigger", "build", "install_mutant_plugins"]
