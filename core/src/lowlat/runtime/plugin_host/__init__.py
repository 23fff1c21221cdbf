"""The plugin host: discovery, the guard, selection and PluginHost (host-side; plugins never import it)."""
