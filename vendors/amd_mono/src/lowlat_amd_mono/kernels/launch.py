"""Options and the launcher that runs a kernel's stages persistently (one launch) or one launch per stage.

Mode selection: the stage-per-launch mode is used under the Triton interpreter (whose programs run one after
another, so a spinning wait would deadlock), on CPU, and when ``LOWLAT_MONO_STAGED=1`` (GPU debugging).
Otherwise a kernel runs once over a persistent grid of ``programs_per_sm`` x SMs programs, after the residency
check (``residency.check_grid``) of its compiled variant. Tests may also run the persistent kernels under the
interpreter over a grid of one program (``MonoOptions(staged=False)`` passed directly), where every wait finds
its flags already published by the program itself.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lowlat_amd_mono.kernels.gemv import PREFETCH_ACT
from lowlat_amd_mono.kernels.residency import Occupancy, check_grid, kernel_occupancy
from lowlat_amd_mono.kernels.sync import TIMER_CUDA, TIMER_HIP, TIMER_SPIN

ENV_PREFIX = "LOWLAT_MONO_"
# Variables read by the test suite only, not launch options (so not in EngineConfig.extra): the rank that never
# publishes at tp_size > 1 (``lowlat_amd_mono.tp.FAULT_ENV``, fault injection).
TEST_VARIABLES = ("fault_no_publish",)
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def is_interpreted(kernel: Any) -> bool:
    """True when Triton built ``kernel`` for the interpreter (``TRITON_INTERPRET=1`` before import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


@dataclass(frozen=True)
class MonoOptions:
    """How lowlat-amd-mono launches its kernels.

    Attributes:
        staged: run each stage as its own launch (no cross-workgroup waits). Forced under the interpreter.
        one_launch: run every decoder layer of a step in one persistent launch (``kernels.step``: three launches
            per step with the embedding and the LM head) instead of two persistent launches per layer (K1, K2).
            Off by default: on the H200 it is even on llama-3.2-1b (74.4 against 74.1 µs per layer at one row)
            and 4-6% slower on qwen3-30b-a3b (137.7 against 131.8; docs/design.md, "One launch per step"). A model
            that mixes dense and MoE layers always runs two per layer.
        deadline_ms: how long a cross-workgroup wait may spin before the launch aborts (milliseconds).
        programs_per_sm: persistent programs per SM/CU (the grid is this times the SM/CU count); 0 picks 2 for
            a model with MoE layers and 1 otherwise (the faster on the H200, docs/design.md).
        pdl: programmatic dependent launch between consecutive launches (CUDA sm90+ only). Off by default: on
            the H200 it cost 28 µs per llama-3.2-1b layer (docs/design.md, "Overlaps, and what each bought").
        pdl_early: with PDL, release the next launch at the start of a layer kernel (True) or only once its
            programs reach K1's RoPE stage / K2's MLP (False), so fewer successor programs wait resident.
        cooperative: launch persistent grids with ``launch_cooperative_grid`` so an oversize grid fails
            instead of hanging (CUDA only; default on when PDL is off).
        l2_prefetch_bytes: bytes of its next weight tile a workgroup asks L2 to fetch before it waits for a tag
            (CUDA sm90+; 0, the default, disables: on the H200 64 KB cost 7 µs per layer). Keep
            ``programs x bytes`` well under the L2 size.
        stage_counters: a wait for every item of a stage polls one per-stage counter (``sync.wait_count``)
            instead of every item's flag (``sync.wait_flags``).
        gemv_prefetch: in GEMV loops with an RMSNorm prologue, load the next activation chunk (and norm
            weights) one chunk ahead into registers (``kernels.gemv.PREFETCH_ACT``; on by default). Process-wide:
            only ``LOWLAT_MONO_GEMV_PREFETCH``, read when the kernels are first imported, sets it; an
            ``EngineConfig.extra`` value that disagrees is an error.
        row1_fma: at a step of exactly one row (batch-1 decode), run every GEMV (QKV, o_proj, gate/up, down,
            router, experts, LM head) in the one-row FMA form (``kernels.gemv_row1``: the row as a 1-D float32
            vector, ``[BN, BK]`` weight chunks, no padding to 16 rows) instead of ``tl.dot``; the kernels of a
            one-row step compile with the constexpr ``ROW1``. Off by default: on the H200 it made a llama-3.2-1b
            step slower (1.385 -> 1.508 ms; its K2 kernel needs 248 registers against 196). Per instance.
        gemv_bk_max, gemv_tile_elems: the most weight columns / elements one pipelined weight load of a GEMV
            stage holds (``MonoPlan.build``); larger chunks keep more bytes in flight per program. ``gemv_bk_max``
            0 (the default) picks ``plan.default_bk_max``: 512 for a model without MoE layers, 256 with them.
        num_warps, num_stages: Triton launch options of the layer kernels.
    Every field can be set by ``LOWLAT_MONO_<FIELD>`` in the environment or ``amd_mono_<field>`` in
    ``EngineConfig.extra`` (which wins).
    """

    staged: bool = False
    one_launch: bool = False
    deadline_ms: float = 100.0
    programs_per_sm: int = 0
    pdl: bool = False
    pdl_early: bool = True
    cooperative: bool = False
    l2_prefetch_bytes: int = 0
    stage_counters: bool = False
    gemv_prefetch: bool = True
    row1_fma: bool = False
    gemv_bk_max: int = 0
    gemv_tile_elems: int = 16384
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def resolve(cls, device: torch.device, extra: Mapping[str, Any] | None = None, *,
                interpret: bool = False) -> MonoOptions:
        """Defaults, then environment, then ``extra``; then what the platform cannot do is turned off.

        Raises:
            ValueError: an unknown ``amd_mono_*`` key or ``LOWLAT_MONO_*`` variable, a value that does not parse,
                a non-positive deadline or a negative programs_per_sm.
        """
        names = set(cls.__dataclass_fields__)
        unknown = sorted({k for k in (extra or {}) if k.startswith("amd_mono_") and k[9:] not in names}
                         | {k for k in os.environ
                            if k.startswith(ENV_PREFIX)
                            and k[len(ENV_PREFIX):].lower() not in names | set(TEST_VARIABLES)})
        if unknown:
            hints = []
            for k in unknown:
                env = k.startswith(ENV_PREFIX)
                bare = k[len(ENV_PREFIX):].lower() if env else k[len("amd_mono_"):]
                close = difflib.get_close_matches(bare, sorted(names), n=1)
                if close:
                    fix = ENV_PREFIX + close[0].upper() if env else "amd_mono_" + close[0]
                    hints.append(f"{k}: did you mean {fix}?")
            known = ", ".join(f"{ENV_PREFIX}{n.upper()}" for n in sorted(names))
            raise ValueError(f"unknown amd_mono option(s) {', '.join(unknown)}. {' '.join(hints)} Known (also as "
                             f"EngineConfig.extra['amd_mono_<name>']): {known}")
        vals: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            key = f"amd_mono_{f.name}"
            src = f"EngineConfig.extra[{key!r}]" if key in (extra or {}) else ENV_PREFIX + f.name.upper()
            raw = (extra or {}).get(key, os.environ.get(ENV_PREFIX + f.name.upper()))
            if raw is None:
                continue
            is_bool = f.type in ("bool", bool)
            try:
                if is_bool:
                    vals[f.name] = raw if isinstance(raw, bool) else _BOOL[str(raw).lower()]
                else:
                    vals[f.name] = (float if f.type in ("float", float) else int)(raw)
            except (KeyError, ValueError):
                words = f" (use one of {', '.join(sorted(_BOOL))})" if is_bool else ""
                raise ValueError(f"amd_mono option {f.name}={raw!r} from {src} does not parse as {f.type}"
                                 f"{words}") from None
        opts = cls(**vals)
        if opts.gemv_prefetch != bool(PREFETCH_ACT.value):
            raise ValueError(f"amd_mono_gemv_prefetch={opts.gemv_prefetch} but the kernels were imported with "
                             f"LOWLAT_MONO_GEMV_PREFETCH={int(bool(PREFETCH_ACT.value))}: the switch is process-wide; "
                             "set the environment variable before lowlat_amd_mono is imported")
        if 0 < opts.gemv_bk_max < 16 or opts.gemv_bk_max < 0 or opts.gemv_tile_elems < 256:
            raise ValueError(f"amd_mono needs gemv_bk_max 0 (auto) or >= 16 and gemv_tile_elems >= 256, got {opts}")
        if opts.deadline_ms <= 0 or opts.programs_per_sm < 0:
            raise ValueError(f"amd_mono needs deadline_ms > 0 and programs_per_sm >= 0 (0: auto), got {opts}")
        cuda = device.type == "cuda" and torch.version.hip is None and not interpret
        sm90 = cuda and torch.cuda.get_device_capability(device)[0] >= 9
        staged = opts.staged or interpret or device.type == "cpu"
        pdl = opts.pdl and sm90 and not staged
        # Cooperative launch is the default only without PDL (the two launch attributes are not combined here).
        cooperative = bool(vals.get("cooperative", not pdl)) and cuda and not staged
        return cls(staged=staged, one_launch=opts.one_launch, deadline_ms=opts.deadline_ms,
                   programs_per_sm=opts.programs_per_sm, pdl=pdl,
                   cooperative=cooperative, pdl_early=opts.pdl_early,
                   l2_prefetch_bytes=opts.l2_prefetch_bytes if sm90 and not staged else 0,
                   stage_counters=opts.stage_counters, gemv_prefetch=opts.gemv_prefetch, row1_fma=opts.row1_fma,
                   gemv_bk_max=opts.gemv_bk_max, gemv_tile_elems=opts.gemv_tile_elems,
                   num_warps=opts.num_warps, num_stages=opts.num_stages)


class StageRunner:
    """Launches one kernel's stages: persistently (after the residency check) or one launch per stage."""

    def __init__(self, device: torch.device, options: MonoOptions, interpret: bool, nprog: int) -> None:
        self.device = device
        self.options = options
        self.interpret = interpret
        self.nprog = nprog
        is_hip = torch.version.hip is not None
        cuda = device.type == "cuda" and not is_hip and not interpret
        self.timer = TIMER_SPIN if options.staged or interpret else (TIMER_HIP if is_hip else TIMER_CUDA)
        self.deadline = int(options.deadline_ms * {TIMER_SPIN: 1e3, TIMER_CUDA: 1e6, TIMER_HIP: 1e5}[self.timer])
        self.xc = ".cg" if cuda and not options.staged else ""
        self.occupancy: dict[str, Occupancy] = {}
        self._checked: set[tuple[Any, ...]] = set()
        base = {"num_warps": options.num_warps, "num_stages": options.num_stages}
        self._staged_kw = dict(base)
        self._persistent_kw = dict(base)
        if options.cooperative:
            self._persistent_kw["launch_cooperative_grid"] = True
        if options.pdl:
            self._persistent_kw["launch_pdl"] = True

    @property
    def pdl(self) -> bool:
        return self.options.pdl

    def common_meta(self) -> dict[str, Any]:
        """Constexprs every layer kernel takes for the mode it runs in."""
        return {"INTERP": self.interpret, "TIMER": self.timer, "USE_PDL": self.options.pdl,
                "PDL_EARLY": self.options.pdl_early,
                "PF_L2": self.options.l2_prefetch_bytes > 0, "XC": self.xc, "MAXW": 128}

    def run(self, name: str, kernel: Callable[..., Any], stage_items: Mapping[int, int], args: tuple[Any, ...],
            meta: dict[str, Any]) -> None:
        """Run ``kernel``'s stages ``stage_items`` (stage id -> work items, in order) over ``args``.

        Raises:
            ResidencyError: the persistent grid would not fit on the device at once.
        """
        if self.options.staged:
            for stage, n in stage_items.items():
                if n > 0:
                    kernel[(n,)](*args, STAGE=stage, **meta, **self._staged_kw)
            return
        grid = (self.nprog,)
        key = (name, tuple(sorted((k, str(v)) for k, v in meta.items())))
        if key not in self._checked and not self.interpret:  # (an interpreted grid is one program)
            compiled = kernel.warmup(*args, grid=grid, STAGE=-1, **meta, **self._persistent_kw)
            occ = kernel_occupancy(compiled, self.device)
            check_grid(name, self.nprog, occ)
            self.occupancy[name] = occ
            self._checked.add(key)
        kernel[grid](*args, STAGE=-1, **meta, **self._persistent_kw)
