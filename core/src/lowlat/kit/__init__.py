"""The vendor kit: ``lowlat new-plugin NAME`` writes a plugin distribution that passes the contract suite.

``write_plugin`` renders the templates beside this file (``templates/*.tmpl``) for a plugin name.
"""

from lowlat.kit.scaffold import FILES, PluginNames, checkout_commit, lowlat_checkout, plugin_names, write_plugin

__all__ = ["FILES", "PluginNames", "checkout_commit", "lowlat_checkout", "plugin_names", "write_plugin"]
