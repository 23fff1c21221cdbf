"""Triton kernels of lowlat-amd-mono: two persistent launches per decoder layer (K1, K2), the tag protocol
they synchronize with (``sync``), the residency rule (``residency``), tiling (``plan``) and the launcher
(``launch``). Importing a kernel module compiles nothing; Triton compiles on first launch."""
