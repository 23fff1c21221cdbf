"""Building blocks of the general forward: RMSNorm, RoPE, TP linears, paged attention, MoE, embedding, logits.

Import from the submodules (``lowlat.layers.norm`` etc.); nothing is re-exported here to keep imports light.
"""
