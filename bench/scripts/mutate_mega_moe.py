"""Mutation pass of nvidia_mega's MoE one-row forms, the down kernel's I chunks and the routing's NaN rule
(kernels/moe_row1.py, kernels/moe_experts.py, kernels/moe_route.py, MoEStages, MoEKernelConfig and default_config
in kernels/moe.py, its parser kernels/env_config.py, the build's check of LOWLAT_MEGA_MOE_CONFIG):
the routing grid's one program per (router block, row), its selection over next_pow2(T) rows and its top-k
on int32 keys (``route_keys``);
break the code in one place, run the MoE tests, expect a failure.

    PYTHONPATH=core/src:vendors/nvidia_mega/src .venv/bin/python bench/scripts/mutate_mega_moe.py   # from the root

Each mutation is applied to the source, vendors/nvidia_mega/tests/test_kernels_moe.py, test_kernels_moe_edges.py and
test_kernels_moe_keys.py run under TRITON_INTERPRET=1, and the source is restored. Prints CAUGHT (with the first
failing test) or MISSED per mutation; exits 1 if any was missed. PDL, the 16-byte loads and the K-side padding to 16
(``k_chunk(..., 16)``) are not visible on CPU: test_compile_sm90_moe.py checks the compiled PTX. Nor is a routing
ticket that counts one row's programs only (``ticket == tl.num_programs(0) - 1``): the interpreter runs the programs
one after another, so the selection runs again at every multiple and the last run sees every row; on a GPU it races
with the other rows' logits (test_kernels_moe.py's 8-row cases on CUDA).
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

K = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels")
R, X, S, P, E = K / "moe_row1.py", K / "moe_experts.py", K / "moe.py", K / "moe_route.py", K / "env_config.py"
M = [  # (name, file, original text, mutated text)
    ("one-row gate/up reads gate rows as up", R, "up_rows = gate_rows + INTER * H", "up_rows = gate_rows"),
    ("one-row gate/up without SiLU", R, "a = rnd(g * tl.sigmoid(g), dtype) * rnd(acc_u, dtype)",
     "a = rnd(g, dtype) * rnd(acc_u, dtype)"),
    ("one-row gate/up stops a K chunk early", R, "for k0 in range(0, H, BLOCK_K):",
     "for k0 in range(0, H - BLOCK_K, BLOCK_K):"),
    ("one-row gate/up stores row 1", R, "tl.store(act_ptr + slot * ROWS_C * INTER + offs_n",
     "tl.store(act_ptr + (slot * ROWS_C + 1) * INTER + offs_n"),
    ("one-row gate/up reads another expert", R, "gate_rows = w13_ptr + e * (2 * INTER * H)",
     "gate_rows = w13_ptr + (e + 1) % 2 * (2 * INTER * H)"),
    ("one-row down skips the further I chunks", X,
     "for i0 in range(BLOCK_I, INTER, BLOCK_I):  # further I chunks\n",
     "for i0 in range(BLOCK_I, BLOCK_I, BLOCK_I):  # further I chunks\n"),
    ("one-row down re-reads the first weight chunk", X,
     "wi = tl.load(w_rows + oi[None, :], mask=nmask[:, None] & (oi < INTER)[None, :], other=0.0)",
     "wi = tl.load(w_rows + offs_i[None, :], mask=nmask[:, None] & (oi < INTER)[None, :], other=0.0)"),
    ("one-row down reads act row 1", X, "a_row = act_ptr + slot * ROWS_C * INTER",
     "a_row = act_ptr + (slot * ROWS_C + 1) * INTER"),
    ("one-row down ignores its chunk's act mask", X, "ai = tl.load(a_row + oi, mask=oi < INTER, other=0.0)",
     "ai = tl.load(a_row + oi)"),
    ("tl.dot down skips the further I chunks", X,
     "for i0 in range(BLOCK_I, INTER, BLOCK_I):  # further I chunks, software-pipelined",
     "for i0 in range(BLOCK_I, BLOCK_I, BLOCK_I):  # further I chunks, software-pipelined"),
    ("tl.dot down re-reads the first act chunk", X, "a_ti = tl.load(a_rows + oi[:, None]",
     "a_ti = tl.load(a_rows + offs_i[:, None]"),
    ("tl.dot down's chunk ignores the I mask", X, "                im = oi < INTER\n",
     "                im = oi < INTER + BLOCK_I\n"),
    ("row1 never chosen", S, "return self.x.shape[0] == 1 and self.cfg.row1", "return False"),
    ("row1 at more rows", S, "return self.x.shape[0] == 1 and self.cfg.row1",
     "return self.x.shape[0] <= 3 and self.cfg.row1"),
    ("row1 switch ignored", S, "return self.x.shape[0] == 1 and self.cfg.row1", "return self.x.shape[0] == 1"),
    ("down I chunk ignored", S, "BLOCK_I=k_chunk(cfg.down_block_i, ws.inter, 16),",
     "BLOCK_I=k_chunk(1 << 30, ws.inter, 16),"),
    ("one-row gate/up grid one tile short", S, "_moe_gate_up_row1_kernel[(triton.cdiv(ws.inter, cfg.row1_block_n),",
     "_moe_gate_up_row1_kernel[(max(1, ws.inter // cfg.row1_block_n - 1),"),
    ("NaN probabilities not ranked first", P, "work = tl.where(valid, tl.where(p != p, 2.0, p), -1.0)",
     "work = tl.where(valid, p, -1.0)"),
    ("a NaN row's renormalization spreads NaN to its other slots", P,
     "sel_w = tl.where(sel > 0, sel_w / denom[:, None], 0.0)", "sel_w = sel_w / denom[:, None]"),
    ("a NaN row's weight kept at the 2.0 stand-in", P,
     'tl.where(best > 1.0, float("nan"), best)[:, None]', "best[:, None]"),
    ("routing grid one row", S, 'moe_route_kernel[(rp["grid"], t)](', 'moe_route_kernel[(rp["grid"], 1)]('),
    ("routing selection over one row", S,
     "return max(triton.next_power_of_2(self.x.shape[0]), self.cfg.route_min_rows)", "return 1"),
    ("routing selection over all 8 rows again", S,
     "return max(triton.next_power_of_2(self.x.shape[0]), self.cfg.route_min_rows)", "return ROWS"),
    ("routing selection tile of 8 with SEL_ROWS rows", P, "rows = tl.arange(0, SEL_ROWS)",
     "rows = tl.arange(0, ROWS_C)"),
    ("route_gather ignored by the launch", S, "GATHER=cfg.route_gather", "GATHER=False"),
    ("route_gather off by default", S, "route_gather: bool = True", "route_gather: bool = False"),
    # the selection tile's fewest rows (route_min_rows)
    ("route_min_rows ignored by the launch", S,
     "return max(triton.next_power_of_2(self.x.shape[0]), self.cfg.route_min_rows)",
     "return triton.next_power_of_2(self.x.shape[0])"),
    ("route_min_rows above 8 accepted", S, "if self.route_min_rows > ROWS:", "if self.route_min_rows > 2 * ROWS:"),
    ("route_min_rows 1 by default", S, "route_min_rows: int = 4", "route_min_rows: int = 1"),
    # the top-k on int32 keys (route_keys, moe_route._top_k_by_keys)
    ("route_keys ignored by the launch", S, "KEYS=cfg.route_keys and x.element_size() == 2",
     "KEYS=False"),
    ("route_keys on float32 too", S, "KEYS=cfg.route_keys and x.element_size() == 2", "KEYS=cfg.route_keys"),
    ("route_keys off by default", S, "route_keys: bool = True", "route_keys: bool = False"),
    ("keys: -0 ranks below +0", P, "bits = tl.where(bits == -32768, 0, bits)  # -0 ranks as +0", "bits = bits"),
    ("keys: NaN not ranked first", P, "order = tl.where(lg != lg, 32767, tl.where(",
     "order = tl.where(lg != lg, 0, tl.where("),
    ("keys: negatives in bit order", P, "tl.where(bits >= 0, bits, bits ^ 0x7FFF))", "bits)"),
    ("keys: ties to the higher index", P, "(order << 16) | (0xFFFF - ee[None, :])", "(order << 16) | ee[None, :]"),
    ("keys: the decoded logit keeps the index bits", P, "    o = best >> 16\n", "    o = best\n"),
    ("keys: a non-finite max row picked by key", P, "idx = tl.where(bad, k, 0xFFFF - (best & 0xFFFF))",
     "idx = 0xFFFF - (best & 0xFFFF)"),
    ("keys: a picked expert stays in the search", P, "keys = tl.where(hit, -2147483648, keys)", "keys = keys"),
    ("keys: padded k columns in the weights", P,
     "wts = tl.where((kk < TOP_K)[None, :], tl.gather(p, ids, axis=1), 0.0)", "wts = tl.gather(p, ids, axis=1)"),
    ("keys: the weights of the first expert", P, "tl.gather(p, ids, axis=1), 0.0)",
     "tl.gather(p, ids * 0, axis=1), 0.0)"),
    ("the gather reads the expert ids, not the slot table", P,
     "tl.gather(tl.broadcast_to(slot_of[None, :], [SEL_ROWS, E_PAD]), ids, axis=1)",
     "tl.gather(tl.broadcast_to(ee[None, :], [SEL_ROWS, E_PAD]), ids, axis=1)"),
    ("routing h stored by every program of row 0 only", P, "        tl.store(h_ptr + r * H + offs_h, h, mask=mask_h)",
     "        tl.store(h_ptr + offs_h, h, mask=mask_h & (r == 0))"),
    ("K sides below 16 accepted", S, 'for name in ("gate_up_block_k", "down_block_i"):', "for name in ():"),
    ("stages not checked at the config", S, 'if f.name == "route_programs" or f.name.endswith("_stages"):',
     'if f.name == "route_programs":'),
    ("warps above 32 accepted", S, 'if f.name.endswith("_warps") and v > 32:', "if False:"),
    # LOWLAT_MEGA_MOE_CONFIG (default_config) and its check at build
    ("the config env ignored", E, "        return cls(**changes)", "        return cls()"),
    ("the config env takes any bool", E, "        if flag and value not in (\"0\", \"1\"):", "        if False:"),
    ("the config env may repeat a field", E, "        if name in changes:\n", "        if False:\n"),
    ("the config env read from the LM head's variable", S, "return config_from_env(MoEKernelConfig, CONFIG_ENV)",
     'return config_from_env(MoEKernelConfig, "LOWLAT_MEGA_LM_HEAD_CONFIG")'),
    ("the config env not checked at build", pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/build.py"),
     "tp_reduce_mode, default_config,\n", "tp_reduce_mode,\n"),
]

if __name__ == "__main__":
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.exit(mutation_runner.run(M, "vendors/nvidia_mega/tests/test_kernels_moe.py", env,
                                 pytest_args=("vendors/nvidia_mega/tests/test_kernels_moe_edges.py",
                                              "vendors/nvidia_mega/tests/test_kernels_moe_keys.py",
                                              "vendors/nvidia_mega/tests/test_forward.py", "-k",
                                              "not test_forward.py or names_the_problem")))
