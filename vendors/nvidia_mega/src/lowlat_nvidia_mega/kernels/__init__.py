"""Triton kernels of lowlat-nvidia-mega, one kernel family per module, each with a checking launcher.

- ``pdl``: programmatic-dependent-launch helpers (``gdc_wait`` / ``gdc_launch_dependents``, ``pdl_enabled``).
- ``gemm_plans``: the GEMMs' launch plans (``GemmPlan``, ``GemvPlan``) and their planners; host-side only.
- ``small_gemm``: <= 8-row GEMM, RMSNorm prologue, SwiGLU / residual epilogues, deterministic split-K.
- ``gemv``: the one-row GEMV on the FMA units (per tile, or a persistent weight stream), and the launcher that picks
  it or ``small_gemm`` per step.
- ``qkv_rope``: input norm + QKV GEMM + Qwen3 q/k norm + RoPE + KV-cache write in one kernel.
- ``attention``: paged split-KV decode attention for 1..8 rows per request, packed GQA, plus its merge.
- ``moe_route`` / ``moe``: Qwen3-MoE routing and experts; ``lm_head``: final norm + LM head.

Nothing is compiled at import; kernels compile on first launch.
"""
