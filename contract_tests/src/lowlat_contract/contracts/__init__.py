"""The contract modules, one per contract (DESIGN.md §7); collected by ``pytest --pyargs lowlat_contract``."""
