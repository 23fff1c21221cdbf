"""lowlat-contract-tests: the suite every lowlat plugin must pass, and the compat matrix parser.

Importing this package is cheap (no torch); the suite's modules import the runtime when they run.
"""

__version__ = "0.3.3"
