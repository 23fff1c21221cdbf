"""Host-side plan: the stages, how each GEMV is tiled into work items, and the per-step item counts.

A stage's work items are spread round-robin over the persistent grid (item ``i`` runs on program
``i mod nprog``); every program runs its items stage by stage, and a wait only ever targets an earlier stage,
so with all programs resident every wait is eventually satisfied. Tiles are picked to balance the heaviest
program: the cost of a tiling is (rounds of items per program) x (weight elements per item) plus a fixed
per-item overhead, minimized over tile widths ``BN`` and (for the QKV projection) split-K factors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowlat.plugin import ModelConfig

MAX_ROWS = 8  # rows (tokens) per step the buffers are sized for
BM = 16  # rows of every tl.dot (rows >= T are masked)

# Stage ids: the index of a stage's flags in flags[layer, stage, item] and the error record's stage field.
S_QKV, S_ROPE, S_ATTN, S_COMB, S_OPROJ, S_MLP1, S_MLP2, S_MLP3 = range(8)
# At tp_size > 1 (``kernels.k2_tp``, ``kernels.k2_moe_tp``): the reduce stages after the row-parallel o_proj and
# down (dense) or expert down (MoE).
S_RED_O, S_RED_D = 8, 9
NUM_STAGES = 10
STAGE_NAMES_DENSE = {
    S_QKV: "k1.qkv_proj", S_ROPE: "k1.qk_norm_rope_kv_write", S_ATTN: "k2.attention", S_COMB: "k2.attention_combine",
    S_OPROJ: "k2.o_proj_residual", S_MLP1: "k2.gate_up_silu", S_MLP2: "k2.down_residual",
    S_RED_O: "k2.o_proj_reduce", S_RED_D: "k2.down_reduce",
}
STAGE_NAMES_MOE = {**STAGE_NAMES_DENSE, S_MLP1: "k2.router", S_MLP2: "k2.expert_gate_up",
                   S_MLP3: "k2.expert_down_combine_residual", S_RED_D: "k2.moe_reduce"}
K1_STAGES = (S_QKV, S_ROPE)
K2_DENSE_STAGES = (S_ATTN, S_COMB, S_OPROJ, S_MLP1, S_MLP2)
K2_MOE_STAGES = (S_ATTN, S_COMB, S_OPROJ, S_MLP1, S_MLP2, S_MLP3)
K2_DENSE_TP_STAGES = (S_ATTN, S_COMB, S_OPROJ, S_RED_O, S_MLP1, S_MLP2, S_RED_D)  # in launch order
K2_MOE_TP_STAGES = (S_ATTN, S_COMB, S_OPROJ, S_RED_O, S_MLP1, S_MLP2, S_MLP3, S_RED_D)
ITEM_OVERHEAD = 8192  # fixed cost of one work item, in weight elements (a wait, a publish, a prologue)
# Float32 elements of a one-row FMA chunk (``bn * bk`` per weight) per warp before sm90 spills registers.
ROW1_ELEMS_PER_WARP = 4096


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Tile:
    """How one weight ``[N, K]`` is cut into work items: ``n_tiles`` column tiles of ``bn`` x ``ksplit``."""

    bn: int
    bk: int
    ksplit: int
    kchunk: int
    n_tiles: int

    @property
    def items(self) -> int:
        return self.n_tiles * self.ksplit

    def fit_row1(self, budget: int, weights: int = 1) -> Tile:
        """This tile with ``bk`` halved (down to 16) until the one-row FMA chunks of ``weights`` weights fit in
        ``budget`` float32 elements (``bn * bk * weights``); ``bn``, the split and so the items are unchanged."""
        bk = self.bk
        while bk > 16 and self.bn * bk * weights > budget:
            bk //= 2
        return replace(self, bk=bk)


def pick_tile(n: int, k: int, nprog: int, *, rows_per_item: int = 1, slots: int = 1, allow_split: bool = False,
              bn_choices: tuple[int, ...] = (16, 32, 64, 128), bk_max: int = 256,
              max_tile_elems: int = 16384) -> Tile:
    """Tile a GEMV over ``nprog`` programs (``slots`` copies of the item set, e.g. experts per step)."""
    best: tuple[tuple[int, int], Tile] | None = None
    for bn in bn_choices:
        n_tiles = cdiv(n, bn)
        for ks in (1, 2, 4, 8) if allow_split else (1,):
            if ks > 1 and k % ks:
                continue
            kchunk = k // ks if ks > 1 else k
            cap = max(16, min(bk_max, max_tile_elems // (bn * rows_per_item)))
            bk = _pick_bk(kchunk, cap, exact=ks > 1)
            if bk is None:
                continue
            items = n_tiles * ks * slots
            cost = cdiv(items, nprog) * (bn * rows_per_item * kchunk + ITEM_OVERHEAD)
            key = (cost, items)
            if best is None or key < best[0]:
                best = (key, Tile(bn=bn, bk=bk, ksplit=ks, kchunk=kchunk, n_tiles=n_tiles))
    assert best is not None
    return best[1]


def _pick_bk(kchunk: int, cap: int, exact: bool) -> int | None:
    """Largest power of two in [16, cap] dividing ``kchunk``; when none, a masked chunk unless ``exact``."""
    b = 16
    while b * 2 <= cap and kchunk % (b * 2) == 0:
        b *= 2
    if kchunk % b == 0:
        return b
    return None if exact else min(cap, max(16, next_pow2(kchunk)))


def _pick_gate_up(inter: int, hidden: int, nprog: int, interpret: bool, kw: dict) -> Tile:
    """The dense gate/up tile: 64 columns of each of W_gate and W_up per item whenever that still gives every
    second program an item, else ``pick_tile``'s choice.

    Measured on the H200 (bench/results/2026-12-01-h200-amd-gemv, ``bench_gemv.py``, 132 programs, 1 row): the
    stage streams faster with wider tiles even at more rounds per program, which ``pick_tile``'s cost model does
    not see: qwen3-8b 121.4 us with its pick (32 x 256) against 98.5 us at 64 x 128 (2 rounds for some programs);
    llama-3.2-1b 44.7 us at 32 x 128 against 32.1 us at 64 x 128 (its pick already)."""
    if not interpret and cdiv(inter, 64) * 2 >= nprog:
        return pick_tile(inter, hidden, nprog, rows_per_item=2, **{**kw, "bn_choices": (64,), "bk_max": 128})
    return pick_tile(inter, hidden, nprog, rows_per_item=2, **kw)


def default_bk_max(dims: Dims) -> int:
    """The most weight columns per pipelined GEMV load when none is set: 512 for a model without MoE layers, 256
    with them.

    Measured on an H100 (bench/results/2026-12-07-h100-amd-gemv-chain, calls 5-6; ``lowlat bench``, A/B/A/B): 512
    against 256 took llama-3.2-1b's DECODE step from 1.545 / 1.544 to 1.504 / 1.507 ms at batch 1 and 1.674 / 1.669 to
    1.625 / 1.633 at batch 8, and qwen3-8b's from 7.81 / 7.68 to 7.67 / 7.61 (b=1) and 8.28 / 8.22 to 7.97 / 8.09
    (b=8); it made qwen3-30b-a3b slower (6.71 / 6.75 -> 7.08 / 7.09 ms at b=1, 18.97 -> 19.56 at b=8)."""
    return 256 if dims.any_moe else 512


@dataclass(frozen=True)
class Dims:
    """Model shapes the kernels are specialized on, of one TP rank (``from_config(cfg, tp)``): at tp_size > 1 its
    query heads, KV heads, dense intermediate size, every expert's intermediate size (``moe_inter``) and vocabulary
    rows (``ceil(V / tp)``, the embedding / LM head shard); ``hidden``, ``experts`` and ``topk`` stay the model's."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    experts: int
    topk: int
    moe_inter: int
    vocab: int
    layers: int
    eps: float
    qk_norm: bool
    norm_topk: bool
    moe_layers: tuple[bool, ...]

    @classmethod
    def from_config(cls, cfg: ModelConfig, tp: int = 1) -> Dims:
        """The sizes of one rank of ``tp`` (the general model's shards: query heads, the dense intermediate size and
        every expert's intermediate size split, KV heads split or one replicated per rank, ``ceil(V / tp)``
        vocabulary rows; the router and the expert count replicated).

        Raises:
            ValueError: ``tp`` does not divide the heads, the intermediate size or (a MoE model) the
                moe_intermediate_size, or the KV heads and ``tp`` do not divide one another (the general model
                refuses these first)."""
        hkv = cfg.num_key_value_heads
        moe_i = cfg.moe_intermediate_size if cfg.num_experts > 0 else 0
        if (cfg.num_attention_heads % tp or cfg.intermediate_size % tp or moe_i % tp
                or (hkv % tp and tp % hkv)):
            raise ValueError(f"tp_size={tp} does not divide num_attention_heads={cfg.num_attention_heads}, "
                             f"intermediate_size={cfg.intermediate_size}, moe_intermediate_size={moe_i} and "
                             f"num_key_value_heads={hkv}")
        return cls(hidden=cfg.hidden_size, heads=cfg.num_attention_heads // tp,
                   kv_heads=hkv // tp if hkv % tp == 0 else 1,
                   head_dim=cfg.head_dim, inter=cfg.intermediate_size // tp, experts=cfg.num_experts,
                   topk=cfg.num_experts_per_tok, moe_inter=cfg.moe_intermediate_size // tp,
                   vocab=-(-cfg.vocab_size // tp), layers=cfg.num_hidden_layers, eps=cfg.rms_norm_eps,
                   qk_norm=cfg.has_qk_norm, norm_topk=cfg.norm_topk_prob,
                   moe_layers=tuple(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)))

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def any_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def any_dense(self) -> bool:
        return not all(self.moe_layers)


@dataclass(frozen=True)
class StepShape:
    """Per-step launch shape: ``rows`` tokens, ``tpr`` new tokens per request, attention splits."""

    rows: int
    tpr: int
    batch: int
    nsplit: int
    m_att: int


@dataclass(frozen=True)
class MonoPlan:
    """Tiles of every GEMV, attention blocking and workspace sizes for one model on one device."""

    dims: Dims
    nprog: int
    qkv: Tile
    o: Tile
    gu: Tile | None
    down: Tile | None
    router: Tile | None
    eup: Tile | None
    edown: Tile | None
    block_s: int
    nsplit_max: int
    head_bn: int
    head_bk: int

    @classmethod
    def build(cls, dims: Dims, nprog: int, *, interpret: bool = False, bk_max: int = 0,
              max_tile_elems: int = 16384) -> MonoPlan:
        """Tile every GEMV of ``dims`` for a persistent grid of ``nprog`` programs; a weight chunk (one pipelined
        load) holds at most ``bk_max`` columns (0: ``default_bk_max(dims)``) and ``max_tile_elems`` elements (per
        weight of a gate/up pair)."""
        bk_max = bk_max or default_bk_max(dims)
        kw: dict = (dict(bn_choices=(16, 32, 64), bk_max=128) if interpret
                    else dict(bk_max=bk_max, max_tile_elems=max_tile_elems))
        h, d = dims.hidden, dims.head_dim
        dense = dims.any_dense
        moe = dims.any_moe
        return cls(
            dims=dims, nprog=nprog,
            qkv=pick_tile(dims.qkv_rows, h, nprog, allow_split=True, **kw),
            o=pick_tile(h, dims.heads * d, nprog, **kw),
            gu=_pick_gate_up(dims.inter, h, nprog, interpret, kw) if dense else None,
            down=pick_tile(h, dims.inter, nprog, **kw) if dense else None,
            router=pick_tile(dims.experts, h, nprog, **kw) if moe else None,
            eup=pick_tile(dims.moe_inter, h, nprog, rows_per_item=2, slots=dims.topk, **kw) if moe else None,
            edown=pick_tile(h, dims.moe_inter, nprog, **kw) if moe else None,
            block_s=32 if interpret else 64,
            nsplit_max=4 if interpret else 16,
            head_bn=32 if interpret else 64,
            head_bk=64 if interpret else 128,
        )

    def for_row1(self, num_warps: int) -> MonoPlan:
        """The tiles of the one-row FMA form (``gemv_row1``) at ``num_warps`` warps: the same tiles and items,
        with a chunk width ``bk`` no larger than keeps a chunk's float32 products (``bn * bk`` per weight, both
        weights of a gate/up pair) within ``ROW1_ELEMS_PER_WARP * num_warps`` elements, past which sm90 spills.
        The default plans fit already (``bn * bk <= 16384`` per item at 4 warps), so this is the plan itself there."""
        budget = ROW1_ELEMS_PER_WARP * num_warps
        fit = lambda t, n=1: t.fit_row1(budget, n) if t is not None else None  # noqa: E731
        head_bk = self.head_bk
        while head_bk > 16 and self.head_bn * head_bk > budget:
            head_bk //= 2
        return replace(self, qkv=fit(self.qkv), o=fit(self.o), gu=fit(self.gu, 2), down=fit(self.down),
                       router=fit(self.router), eup=fit(self.eup, 2), edown=fit(self.edown), head_bk=head_bk)

    def step_shape(self, rows: int, tpr: int) -> StepShape:
        """Launch shape for a DECODE/VERIFY step of ``rows`` tokens, ``tpr`` per request."""
        batch = rows // tpr
        want = max(1, self.nprog // (batch * self.dims.kv_heads))
        nsplit = min(self.nsplit_max, 1 << (want.bit_length() - 1))
        return StepShape(rows=rows, tpr=tpr, batch=batch, nsplit=nsplit,
                         m_att=max(16, next_pow2(tpr * self.dims.group)))

    def items(self, stage: int, shape: StepShape, moe: bool) -> int:
        """Work items of ``stage`` in a step of ``shape`` (``moe``: the layer has a sparse MoE block)."""
        dm = self.dims
        table = {
            S_QKV: self.qkv.items,
            S_ROPE: dm.heads + 2 * dm.kv_heads,
            S_ATTN: shape.batch * dm.kv_heads * shape.nsplit,
            S_COMB: shape.batch * dm.kv_heads,
            S_OPROJ: self.o.n_tiles,
            S_RED_O: self.o.n_tiles,
        }
        if stage in table:
            return table[stage]
        if moe:
            assert self.router and self.eup and self.edown
            return {S_MLP1: self.router.n_tiles, S_MLP2: shape.rows * dm.topk * self.eup.n_tiles,
                    S_MLP3: self.edown.n_tiles, S_RED_D: self.edown.n_tiles}[stage]
        assert self.gu and self.down
        return {S_MLP1: self.gu.n_tiles, S_MLP2: self.down.n_tiles, S_RED_D: self.down.n_tiles}[stage]

    @property
    def max_items(self) -> int:
        """Flags per (layer, stage): the most items any stage has, rounded up to 16 so that every layer's slice
        of the flags buffer stays 64-byte aligned (Triton specializes kernels on pointer alignment)."""
        shapes = [self.step_shape(MAX_ROWS // tpr * tpr, tpr) for tpr in range(1, MAX_ROWS + 1)]
        shapes += [self.step_shape(r, 1) for r in range(1, MAX_ROWS + 1)]
        n = 1
        for sh in shapes:
            for moe in {m for m in self.dims.moe_layers}:
                stages = K1_STAGES + (K2_MOE_STAGES if moe else K2_DENSE_STAGES)
                n = max(n, *(self.items(s, sh, moe) for s in stages))
        return cdiv(n, 16) * 16
