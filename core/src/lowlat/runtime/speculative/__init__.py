"""Speculative decoding: drafters propose k tokens per request, one VERIFY step scores k + 1 rows, the accepted
tokens are appended and the KV of rejected rows is rolled back.

- ``drafter``: the Drafter interface; ``factory``: ``make_drafter`` (``EngineConfig.speculative_method``);
- ``ngram`` (prompt lookup), ``draft_model`` (a smaller checkpoint on its own ModelRunner), ``simulated``
  (benchmarks only: random acceptance of a configured mean, not the model's text);
- ``verify``: greedy acceptance and rejection sampling (Leviathan et al. 2023; Chen et al. 2023);
- ``controller``: the adaptive off-switch; ``speculator``: the engine step; ``stats``: SpecStats.
"""

from lowlat.runtime.speculative.drafter import Drafter, Drafts
from lowlat.runtime.speculative.factory import make_drafter
from lowlat.runtime.speculative.speculator import Speculator
from lowlat.runtime.speculative.stats import SpecStats

__all__ = ["Drafter", "Drafts", "SpecStats", "Speculator", "make_drafter"]
