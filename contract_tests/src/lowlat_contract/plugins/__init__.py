"""Plugins of the contract suite itself: the plain-torch reference and deliberately broken variants.

None of them is registered as an entry point of an installed distribution (so ``--plugin auto`` never
picks them); ``lowlat_contract.fixtures.install_fixture_plugins(site_dir)`` exposes them in a site dir.
"""
