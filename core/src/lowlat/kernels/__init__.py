"""Core Triton kernels (one kernel family per module, each with a checking launcher beside it)."""
