"""``lowlat bench serve``: per-user decode speed of a server under 1, 2, 4, 8 concurrent streaming users.

Either against a running server (``url``), or per path (``general``, a plugin name) against a ``lowlat serve``
subprocess it starts, waits for (``/health``) and stops (SIGTERM) itself, one path after another on the same
device. Per path and concurrency: warm-up requests first (excluded), then ``requests`` measured requests with
``concurrency`` in flight (``serve_client.run_level``). Reports TTFT, TPOT, ITL and end-to-end latency (mean,
p50, p90, p99), per-user decode tokens/s (a request's tokens after the first over the time after its first
token), output and total throughput, and the ratio of each plugin path to the general path for the same
workload in the same run. Writes results.json, results.md and results.png (``serve_report``).

Speculation: with ``speculative`` (``--speculative METHOD``) each path is served twice, plain and with
``--speculative METHOD --num-draft-tokens K`` (only the latter with ``speculative_only``), and each speculative
level also reports its acceptance (mean acceptance length, acceptance rate, VERIFY and DECODE steps, the
off-switch state) from the server's ``lowlat_spec_*`` counters, read before and after the level's measured
requests, and its per-user speed against the same path's plain server (``spec_ratios``). A ``--url`` server
that speculates gets its acceptance reported the same way.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowlat.bench.serve_client import RequestRecord, random_prompts, run_level

SCHEMA = "lowlat-bench-serve/1"
GENERAL = "general"
GPU_DEFAULTS = dict(model="llama-3.2-1b", input_len=8192, output_len=1024, concurrency=(1, 2, 4, 8))
CPU_DEFAULTS = dict(model="tiny-llama", input_len=32, output_len=16, concurrency=(1, 2))
Log = Callable[[str], None]


@dataclass(frozen=True)
class ServeBenchConfig:
    """What one ``lowlat bench serve`` run measures.

    Attributes:
        paths: "general" or plugin names, each served by its own ``lowlat serve`` (ignored with ``url``).
        url: a running server to measure instead (its path is labelled ``label``).
        requests: measured requests per concurrency level; None: 4 x concurrency (at least 8).
        warmup: warm-up requests per level (run at that concurrency, excluded).
        serve_args: extra flags for each ``lowlat serve`` (for example ``--no-cuda-graph``).
        speculative: a drafter (ngram, draft:PATH, simulated:MEAN): each path is also served with it.
        num_draft_tokens: its k (None: lowlat serve's default); speculative_only: skip the plain servers.
    """

    model: str
    device: str
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]
    paths: tuple[str, ...] = (GENERAL,)
    url: str | None = None
    label: str = "server"
    requests: int | None = None
    warmup: int | None = None
    dtype: str = "auto"
    seed: int = 0
    start_timeout_s: float = 1200.0
    serve_args: tuple[str, ...] = ()
    speculative: str | None = None
    num_draft_tokens: int | None = None
    speculative_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency needs levels >= 1, got {self.concurrency}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.url and not self.paths:
            raise ValueError("--paths is empty; give general and/or plugin names, or --url")
        if self.speculative is None and (self.num_draft_tokens is not None or self.speculative_only):
            raise ValueError("--num-draft-tokens and --speculative-only need --speculative METHOD")
        if self.speculative is not None and self.url:
            raise ValueError("--speculative starts servers with speculation on and off; with --url the running "
                             "server's own flags apply (its acceptance is reported if it speculates)")

    def spec_modes(self) -> list[str | None]:
        """The speculative setting of each server per path: None is plain."""
        if self.speculative is None:
            return [None]
        return [self.speculative] if self.speculative_only else [None, self.speculative]

    def measured(self, c: int) -> int:
        return self.requests if self.requests is not None else max(4 * c, 8)

    def warmups(self, c: int) -> int:
        return self.warmup if self.warmup is not None else c


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation; None for no samples)."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(records: list[RequestRecord], wall_s: float, concurrency: int) -> dict[str, Any]:
    """One level's figures (latencies in ms, rates in tokens/s)."""
    ok = [r for r in records if r.error is None]
    ms = 1e3
    per_user = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in ok if r.output_tokens > 1 and r.e2e > r.ttft]
    out_tok = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
        "error_examples": [r.error for r in records if r.error][:3], "wall_s": wall_s,
        "ttft_ms": percentiles([ms * r.ttft for r in ok]),
        "tpot_ms": percentiles([ms * r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles([ms * x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([ms * r.e2e for r in ok]),
        "per_user_decode_tok_s": percentiles(per_user),
        "output_throughput_tok_s": out_tok / wall_s if wall_s > 0 else 0.0,
        "total_throughput_tok_s": (out_tok + sum(r.prompt_tokens for r in ok)) / wall_s if wall_s > 0 else 0.0,
    }


def series_label(path: str, spec: str | None) -> str:
    """A (path, speculative setting) pair's name in tables and plots: ``general`` or ``general +ngram``."""
    return path if spec is None else f"{path} +{spec}"


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each non-general path against general at the same concurrency and speculative setting: per-user tok/s,
    throughput, TPOT."""
    base = {(lv.get("spec"), lv["concurrency"]): lv for lv in levels if lv["path"] == GENERAL}
    out = []
    for lv in levels:
        g = base.get((lv.get("spec"), lv["concurrency"]))
        if lv["path"] == GENERAL or g is None:
            continue
        out.append({"path": lv["path"], "spec": lv.get("spec"), "concurrency": lv["concurrency"],
                    "per_user_tok_s_x_general": _div(lv["per_user_decode_tok_s"]["mean"],
                                                     g["per_user_decode_tok_s"]["mean"]),
                    "output_throughput_x_general": _div(lv["output_throughput_tok_s"], g["output_throughput_tok_s"]),
                    "tpot_speedup_x_general": _div(g["tpot_ms"]["mean"], lv["tpot_ms"]["mean"])})
    return out


def spec_ratios(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each speculative level against the same path's plain level at the same concurrency: per-user tok/s."""
    plain = {(lv["path"], lv["concurrency"]): lv for lv in levels if lv.get("spec") is None}
    out = []
    for lv in levels:
        p = plain.get((lv["path"], lv["concurrency"]))
        if lv.get("spec") is None or p is None:
            continue
        out.append({"path": lv["path"], "spec": lv["spec"], "concurrency": lv["concurrency"],
                    "per_user_tok_s_x_plain": _div(lv["per_user_decode_tok_s"]["mean"],
                                                   p["per_user_decode_tok_s"]["mean"]),
                    "output_throughput_x_plain": _div(lv["output_throughput_tok_s"], p["output_throughput_tok_s"])})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``lowlat serve`` for one path as a subprocess (its output goes to ``log_path``)."""

    def __init__(self, cfg: ServeBenchConfig, path: str, log_path: Path, spec: str | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        plugin = "none" if path == GENERAL else path
        self.argv = [sys.executable, "-m", "lowlat.cli", "serve", "--model", cfg.model, "--plugin", plugin,
                     "--device", cfg.device, "--dtype", cfg.dtype, "--seed", str(cfg.seed), "--port", str(self.port),
                     "--max-context-len", str(cfg.input_len + cfg.output_len + 8),
                     "--max-batch-size", str(max(cfg.concurrency)), "--max-queued-requests", "4096",
                     "--request-timeout", "3600", "--shutdown-grace", "10", *cfg.serve_args]
        if spec is not None:  # one token each, so a value starting with "-" is never taken for a flag
            self.argv.append(f"--speculative={spec}")
            if cfg.num_draft_tokens is not None:
                self.argv.append(f"--num-draft-tokens={cfg.num_draft_tokens}")
        self.log_path = log_path
        self.timeout_s = cfg.start_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                self.__exit__()
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"lowlat serve exited with {self.proc.returncode} before it was ready "
                                   f"(log {self.log_path}):\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"lowlat serve was not ready within {self.timeout_s:.0f} s (log {self.log_path})")
            time.sleep(0.25)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


def _vocab(cfg: ServeBenchConfig) -> int:
    """Random ids stay below this: the model's vocabulary, or the byte range when only a URL is known."""
    if cfg.url:
        return 256
    from lowlat.loader import resolve_model
    from lowlat.serve.hf_cache import resolve_model_path

    return resolve_model(resolve_model_path(cfg.model)).vocab_size


def _served_name(url: str) -> str:
    import httpx

    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return data[0]["id"]


def _metrics_text(url: str) -> str:
    import httpx

    try:
        return httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return ""


def step_counts(url: str) -> dict[str, float]:
    """``{"DECODE/plugin": steps, ...}`` from the server's ``lowlat_steps_total`` (which path served what)."""
    out: dict[str, float] = {}
    for line in _metrics_text(url).splitlines():
        if line.startswith("lowlat_steps_total{"):
            labels, value = line[len("lowlat_steps_total{"):].rsplit("} ", 1)
            kv = dict(part.split("=", 1) for part in labels.split(","))
            out[f"{kv['mode'].strip(chr(34))}/{kv['path'].strip(chr(34))}"] = float(value)
    return out


def spec_counts(url: str) -> dict[str, Any]:
    """The server's ``lowlat_spec_*`` values (``serve.metrics.SpecCollector``): ``{"verify_steps": n, ...,
    "on": 0/1, "method": ..., "k": ..., "simulated": ...}``; empty when it does not speculate."""
    return parse_spec_counts(_metrics_text(url))


def parse_spec_counts(text: str) -> dict[str, Any]:
    """``spec_counts`` of a ``/metrics`` text (Prometheus exposition format)."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.startswith("lowlat_spec_"):
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("lowlat_spec_info{"):  # label values are quoted, with \\ \" \n escapes
            out.update({k: re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], v)
                        for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', name)})
        elif "{" not in name and not name.endswith("_created"):
            out[name[len("lowlat_spec_"):].removesuffix("_total")] = float(value)
    return out


def acceptance(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """What a level's requests did speculatively: the difference of two ``spec_counts`` (None when empty)."""
    if "verify_steps" not in after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after if isinstance(after[k], float) and k != "on"}
    return {"method": after.get("method"), "k": int(after.get("k", 0)), "simulated": after.get("simulated") == "true",
            "verify_steps": int(d["verify_steps"]), "decode_steps": int(d["decode_steps"]),
            "acceptance_length": _div(d["emitted_tokens"], d["request_steps"]) or 0.0,
            "acceptance_rate": _div(d["accepted_tokens"], d["drafted_tokens"]) or 0.0,
            "on_at_end": bool(after.get("on"))}


def measure_path(cfg: ServeBenchConfig, path: str, url: str, model_name: str, vocab: int,
                 progress: Any = None, spec: str | None = None) -> list[dict[str, Any]]:
    """Every concurrency level against one server; one summary per level (``spec``: its speculative setting)."""
    levels = []
    for c in cfg.concurrency:
        n, w = cfg.measured(c), cfg.warmups(c)
        prompts = random_prompts(n + w, cfg.input_len, vocab, cfg.seed + 1000 * c)
        task = progress.add_task(f"{series_label(path, spec)} c={c}", total=n + w) if progress is not None else None

        def done(_: RequestRecord, task: Any = task) -> None:
            if progress is not None:
                progress.advance(task)

        if w:
            asyncio.run(run_level(url, model_name, prompts[:w], cfg.output_len, c, done))
        before = spec_counts(url)
        records, wall = asyncio.run(run_level(url, model_name, prompts[w:], cfg.output_len, c, done))
        levels.append({"path": path, "spec": spec, **summarize(records, wall, c),
                       "acceptance": acceptance(before, spec_counts(url))})
    return levels


def run_serve_bench(cfg: ServeBenchConfig, *, out_dir: Path, command: list[str] | None = None, plot: bool = True,
                    log: Log = print) -> dict[str, Any]:
    """Run it; write results.json / results.md / results.png to ``out_dir``; return the results dict.

    A path whose server does not start is recorded under ``skipped`` (with the log's tail) and the run goes on;
    results.json and results.md are rewritten after every path, so a run cut short keeps what it measured.
    """
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lowlat.bench.env import environment

    device = torch.device("cuda", 0) if cfg.device == "cuda" and torch.cuda.is_available() else torch.device("cpu")
    vocab = _vocab(cfg)
    paths = [cfg.label] if cfg.url else list(cfg.paths)
    results: dict[str, Any] = {
        "schema": SCHEMA, "meta": environment(device, command),
        "settings": {"model": cfg.model, "device": cfg.device, "dtype": cfg.dtype, "input_len": cfg.input_len,
                     "output_len": cfg.output_len, "concurrency": list(cfg.concurrency),
                     "requests": {str(c): cfg.measured(c) for c in cfg.concurrency},
                     "warmup": {str(c): cfg.warmups(c) for c in cfg.concurrency}, "url": cfg.url,
                     "serve_args": list(cfg.serve_args), "seed": cfg.seed, "speculative": cfg.speculative,
                     "num_draft_tokens": cfg.num_draft_tokens},
        "paths": [], "series": [], "levels": [], "ratios": [], "spec_ratios": [], "server_steps": {}, "skipped": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        for path, spec in [(p, s) for p in paths for s in ([None] if cfg.url else cfg.spec_modes())]:
            label = series_label(path, spec)
            if cfg.url:
                results["levels"] += measure_path(cfg, path, cfg.url, _served_name(cfg.url), vocab, progress)
                results["server_steps"][label] = step_counts(cfg.url)
            else:
                log(f"bench serve: starting lowlat serve for {label} ({cfg.model} on {cfg.device})")
                log_name = "server-" + "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in label) + ".log"
                try:
                    with ServerProcess(cfg, path, out_dir / log_name, spec) as server:
                        results["levels"] += measure_path(cfg, path, server.url, cfg.model, vocab, progress, spec)
                        results["server_steps"][label] = step_counts(server.url)
                except RuntimeError as e:  # the server did not start: say why, measure the other paths
                    log(f"bench serve: {label} skipped: {e}")
                    results["skipped"].append({"path": path, "spec": spec, "reason": str(e)})
                    continue
            if path not in results["paths"]:
                results["paths"].append(path)
            results["series"].append({"path": path, "spec": spec, "label": label})
            results["ratios"] = ratios(results["levels"])
            results["spec_ratios"] = spec_ratios(results["levels"])
            _write(results, out_dir, plot=False, log=log)
    _write(results, out_dir, plot=plot, log=log)
    log(f"bench serve: wrote {out_dir}/results.json, results.md" + (", results.png" if plot else ""))
    return results


def _write(results: dict[str, Any], out_dir: Path, *, plot: bool, log: Log) -> None:
    import json

    from lowlat.bench.serve_report import plot_serve, render_serve_markdown

    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(render_serve_markdown(results))
    if plot and results["levels"]:
        try:
            plot_serve(results, out_dir / "results.png")
        except ImportError:
            log("bench serve: matplotlib is missing; no PNG (pip install 'lowlat[bench]'; in a checkout: "
                "pip install -e 'core[bench]')")
