"""Engine: the user-facing generate loop over Scheduler and ModelRunner.

``Engine.step()`` is the whole flow: schedule -> ModelRunner.forward(batch) -> postprocess (sample, append,
finish). ``generate`` adds requests and steps until they finish; ``verify`` runs one VERIFY step (the step a
speculative-decoding verifier runs) for given draft tokens. With ``EngineConfig.speculative`` the engine's
``Speculator`` (``lowlat.runtime.speculative``) takes each step after prompt work: drafts, VERIFY, acceptance.
Otherwise, with ``EngineConfig.resolved_overlap``, DECODE steps run overlapped (``lowlat.runtime.overlap``): each
``step()`` launches the next DECODE step on the device before it reads the tokens of the one before it.

With ``tp_size > 1`` the engine is one rank of an SPMD group (``lowlat.runtime.tp_launch``): under torchrun
every rank runs the caller's program; otherwise rank 0 spawns the other ranks and mirrors each public call to
them before running it itself. Inputs are validated on rank 0 before they are mirrored, so a bad prompt
raises on rank 0 and leaves the workers running.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch

from lowlat.config import ConfigError, EngineConfig
from lowlat.errors import LowlatPluginError
from lowlat.forward_batch import ForwardMode
from lowlat.runtime import tp_launch
from lowlat.runtime.completion import Completion, VerifyResult, completion_of
from lowlat.runtime.deadline import StepDeadlineExceeded, StepWatchdog, wait_for_device_watching
from lowlat.runtime.model_runner import ModelRunner, is_checkpoint_dir
from lowlat.runtime.overlap import OverlapLoop
from lowlat.runtime.prompts import check_token_ids, prepare_prompts
from lowlat.runtime.sampling import SamplingParams, make_generator, sample
from lowlat.runtime.scheduler import Request, ScheduledStep, Scheduler, accepted_tokens
from lowlat.runtime.speculative.speculator import Speculator
from lowlat.runtime.stats import StepStats
from lowlat.runtime.step_guard import checked_picks, describe_step, is_ids, laggards, packed_ids, picks_if_finite

# Errors about the user's input (configuration, checkpoint, plugin choice) that every rank raises alike.
INPUT_ERRORS = (ConfigError, LowlatPluginError)


class Engine:
    """A decode engine for one model.

    Args:
        config: the EngineConfig.

    Attributes:
        runner: this rank's ModelRunner; ``tokenizer``: the checkpoint's tokenizer (or the byte tokenizer);
        stats: StepStats by forward mode and path; ``rank``: this TP rank.
        speculator: the speculative step (``lowlat.runtime.speculative``; its ``stats``), None unless speculative.
        overlap: the overlapped DECODE loop (``lowlat.runtime.overlap.OverlapLoop``), None: plain steps. While it
            is on, ``step()`` returns the requests finished by the step before the one it launched, and
            observers see a step's tokens when they are read, one ``step()`` call after its launch.
        logits_observer: optional ``fn(step, logits)`` called after each forward with the step's float32
            logits (``lowlat run --compare`` records them); None by default. While it is set, DECODE steps ask a
            sampling plugin for logits, not ids, unless ``logits_needed(step)`` says False for the step.
        logits_needed: optional ``fn(step) -> bool`` (the server's: some request wants logprobs); None: every step
            with a ``logits_observer`` needs logits. A step that got sampled ids is not shown to the observer.
        step_observer: optional ``fn(step)`` called after each step's tokens are appended: the step's requests
            (finished ones included) hold this step's new tokens at the end of ``output_ids`` (streaming
            reads them); None by default.

    Raises:
        ConfigError / ValueError: bad configuration; WorkerError: a TP worker failed to start.
        A failed start frees the model and KV pool, stops the workers and tears down the process group.
    """

    def __init__(self, config: EngineConfig, *, _tp_context: tp_launch.TPContext | None = None) -> None:
        from lowlat.loader import load_tokenizer, resolve_model

        self.config = config
        self._follower = _tp_context is not None
        self._ctx = _tp_context
        self._workers: tp_launch.WorkerGroup | None = None
        self._failed: BaseException | None = None
        self.runner: ModelRunner | None = None
        self.speculator: Speculator | None = None  # EngineConfig.speculative: drafts + VERIFY in step()
        if self._ctx is None and config.tp_size > 1:  # fail on bad input before any process starts
            tp_launch.check_tp(resolve_model(config.model), config.tp_size)
        try:
            if self._ctx is None and config.tp_size > 1:
                if tp_launch.under_torchrun():
                    self._ctx = tp_launch.init_from_torchrun(config)
                else:
                    self._ctx, self._workers = tp_launch.start_spawned(config, type(self))
                    weakref.finalize(self, self._workers.close)  # stop workers even if close() is never called
            ctx = self._ctx
            self.rank = ctx.tp.rank if ctx else 0
            if config.speculative:  # first: a draft model's KV pool is small, the target's takes what is left
                self.speculator = Speculator(config, ctx)
            self.runner = ModelRunner(config, tp=ctx.tp if ctx else None, device=ctx.device if ctx else None,
                                      cpu_group=ctx.cpu_group if ctx else None)
            if self._workers is not None:
                self._workers.wait_stage("ready", tp_launch.tp_timeout_s())
            self.tokenizer = load_tokenizer(config.model if is_checkpoint_dir(config.model) else None)
        except BaseException as e:
            # A worker's error explains a failure here (a collective that timed out, say), except when this rank
            # raised a clear input error of its own: every rank raises that one, and rank 0's is the one to show.
            err = None if isinstance(e, INPUT_ERRORS) else self._worker_error()
            self.close(abort=True)
            if err is not None:
                raise err from e
            raise
        self.model_config = self.runner.model_config
        eos = self.model_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, tuple) else ([] if eos is None else [eos]))
        self.eos_ids = frozenset(eos_ids | set(self.tokenizer.eos_token_ids))
        self.scheduler = Scheduler(self.runner.kv_pool, max_batch_size=config.max_batch_size,
                                   chunked_prefill_size=config.chunked_prefill_size, inputs=self.runner.step_inputs)
        if self.speculator is not None:  # VERIFY rows may run past max_new_tokens: promise their KV too
            self.scheduler.slack = self.speculator.k
        self.stats = StepStats()
        self._watchdog = StepWatchdog(config.resolved_step_timeout_s, self.runner.device)
        self._steps_run = 0
        self.logits_observer: Callable[[ScheduledStep, torch.Tensor], None] | None = None
        self.logits_needed: Callable[[ScheduledStep], bool] | None = None
        self.step_observer: Callable[[ScheduledStep], None] | None = None
        self._next_rid = 0
        self.overlap = OverlapLoop(self) if config.resolved_overlap and self.speculator is None else None

    # -- public API (mirrored to spawned TP workers) ---------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Generate a completion for each prompt, batching them continuously.

        Args:
            prompts: texts (tokenized with ``self.tokenizer``) or lists of token ids.
            params: one SamplingParams for all, one per prompt, or None for the defaults.

        Returns:
            One Completion per prompt, in prompt order.

        Raises:
            TypeError / ValueError: a malformed, empty, out-of-vocabulary or too long prompt (nothing runs);
            RuntimeError: requests added with ``add_request`` are still running.
        """
        self._check_usable()
        if self.scheduler.has_unfinished():
            raise RuntimeError("generate() needs an idle engine, but requests added with add_request() are still "
                               "running; finish them with step() first")
        ids, plist = self._prepare(prompts, params)
        return self._call("_generate_ids", ids, plist, ack=True)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue one request for ``step()``; returns its id. Raises like ``generate``."""
        self._check_usable()
        ids, plist = self._prepare([prompt], params)
        return self._call("_add_ids", ids[0], plist[0])

    def step(self) -> list[Completion]:
        """Run one step over the queued requests; returns those that finished in it ([] when idle).

        With ``self.overlap`` a DECODE call launches the next step before it reads this one (runtime/overlap.py).
        """
        self._check_usable()
        return self._call("_step")

    def abort(self, rid: int) -> bool:
        """Drop request ``rid`` (queued or running) and free its KV pages now; False when it is not there."""
        self._check_usable()
        return self._call("_abort", int(rid))

    def verify(self, drafts: dict[int, Sequence[int]]) -> VerifyResult:
        """Run one VERIFY step: each request feeds its pending token plus its k draft tokens.

        A draft token is accepted while it equals the token the request's own sampling picks at that
        position; the first differing pick is appended too (so 1..k+1 tokens are appended), and the KV
        cache is truncated to the accepted tokens. With greedy sampling the result equals plain decoding.

        Args:
            drafts: request id -> k draft token ids, the same k for all, k + 1 <= max_verify_tokens.

        Raises:
            ValueError: see ``Scheduler.check_verify``; a draft id outside the vocabulary.
        """
        self._check_usable()
        clean = {int(rid): [int(t) for t in toks] for rid, toks in drafts.items()}
        for rid, toks in clean.items():
            check_token_ids(toks, f"draft of request {rid}", self.model_config.vocab_size, self.config.model)
        # VERIFY is a plain step: the DECODE step in flight is read first (its finished requests are reported here)
        drained = self._call("_drain") if self.overlap is not None and self.overlap.pending is not None else []
        self.scheduler.check_verify(clean, self.config.max_verify_tokens)
        res = self._call("_verify", clean)
        res.finished[:0] = drained
        return res

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self, *, abort: bool = False) -> None:
        """Stop TP workers, free the model and KV pool, and tear down the process group (idempotent)."""
        abort = abort or isinstance(self._failed, (tp_launch.WorkerError, StepDeadlineExceeded))
        if getattr(self, "overlap", None) is not None:
            self.overlap.discard()
        if getattr(self, "_watchdog", None) is not None:
            self._watchdog.close()
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        if self.speculator is not None:
            self.speculator.close()
            self.speculator = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self._ctx is not None and not self._follower:
            self._ctx.close(abort=abort)
            self._ctx = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step --------------------------------------------------------------------------------------------

    def _step(self) -> list[Completion]:
        if not torch.is_inference_mode_enabled():  # generate() enters it once for the whole loop
            with torch.inference_mode():
                return self._step()
        if self.speculator is not None:  # a speculative VERIFY (or plain DECODE) step, None: prompt work first
            done = self.speculator.step(self)
            if done is not None:
                return done
        if self.overlap is not None:  # DECODE overlapped; PREFILL through _run after the step in flight
            return self.overlap.step()
        step = self.scheduler.schedule()
        if step is None:
            return []
        return self._run(step)

    def _run(self, step: ScheduledStep,
             pick: Callable[[ScheduledStep, torch.Tensor], list[int]] | None = None) -> list[Completion]:
        """Run ``step``; ``pick(step, logits)`` replaces ``_pick`` (the speculative acceptance of a VERIFY step)."""
        try:
            t0 = time.perf_counter()
            if step.mode is ForwardMode.PREFILL:
                for r in step.requests:
                    if r.t_prefill_start is None:
                        r.t_prefill_start = t0
            toks = self._watchdog.run(lambda: self._forward_pick(step, pick), lambda: self._describe_stuck(step))
            now = time.perf_counter()
            if step.mode is ForwardMode.DECODE:
                finished = self.scheduler.update_decode(step, toks, now)
            else:
                finished = self.scheduler.update(step, accepted_tokens(step, toks), now)
        except BaseException as e:
            self._failed = e
            self.scheduler.abort_all()
            if isinstance(e, StepDeadlineExceeded) and self._workers is not None:
                self._workers.close(timeout=1.0)  # stop every rank (frees a thread stuck in a collective)
                self._workers = None
                raise
            err = self._worker_error()
            if err is not None:
                raise err from e
            raise
        self._steps_run += 1
        if self._ctx is not None and self._ctx.progress is not None:
            self._ctx.progress[self.rank] = self._steps_run
        self.stats.record(step.mode, now - t0, step.batch.num_tokens, graphed=self.runner.last_graphed,
                          path=self.runner.last_path)
        if self.step_observer is not None:
            self.step_observer(step)
        return [self._completion(r) for r in finished] if finished else []

    def _forward_pick(self, step: ScheduledStep,
                      pick: Callable[[ScheduledStep, torch.Tensor], list[int]] | None = None) -> list[int]:
        """The step's forward and its picks (what runs under the step deadline)."""
        if pick is None:  # a speculative acceptance reads logits: no ids for it
            self.attach_sampling(step)
        logits = self.runner.forward(step.batch)
        if self.logits_observer is not None and not is_ids(logits):
            self.logits_observer(step, logits)
        return (pick or self._pick)(step, logits)

    def attach_sampling(self, step: ScheduledStep) -> None:
        """Let a sampling plugin return this DECODE step's ids (plugin API 3): its rows' SamplingInfo, and whether
        logits are needed (an observer that wants them). No-op without a sampling plugin."""
        if self.runner.sampling_inputs is None or step.mode is not ForwardMode.DECODE:
            return
        self.runner.attach_sampling(step.batch, [r.params for r in step.requests], [r.seed for r in step.requests],
                                    logits_required=self.wants_logits(step))

    def wants_logits(self, step: ScheduledStep) -> bool:
        """Whether ``step``'s logits are needed: a ``logits_observer`` is set and ``logits_needed`` (if set) says so."""
        return self.logits_observer is not None and (self.logits_needed is None or self.logits_needed(step))

    def _describe_stuck(self, step: ScheduledStep) -> str:
        progress = self._ctx.progress if self._ctx is not None else None
        return describe_step(step, self.runner, self._steps_run + 1) + laggards(progress, self.rank)

    def _pick(self, step: ScheduledStep, logits: torch.Tensor) -> list[int]:
        """The token picked for each of the step's sample rows (argmax alone when every request is greedy)."""
        if not step.sample_rows:  # a prompt chunk: wait for it anyway, so step times are device times
            self._sync()
            if logits.is_cuda:
                torch.cuda.current_stream(logits.device).synchronize()
            return []
        rows = logits if len(step.sample_rows) == logits.shape[0] else logits[step.sample_rows]
        if is_ids(rows):  # a sampling plugin's ids: -1 flags non-finite logits (step_guard)
            self._sync()
            return checked_picks(packed_ids(rows, self.model_config.vocab_size)[0].tolist(),
                                 lambda: describe_step(step, self.runner, self._steps_run + 1), self.runner.check_peer)
        picked = None if step.greedy else sample(rows, [r.params for r in step.sample_reqs],
                                                 [r.generator for r in step.sample_reqs])  # None: argmax
        self._sync()
        return picks_if_finite(rows, picked, lambda: describe_step(step, self.runner, self._steps_run + 1),
                               self.runner.check_peer)

    def _sync(self) -> None:
        """On CUDA with spawned workers, wait for the step while watching the workers (never hang on NCCL)."""
        if self._workers is not None and self.runner.device.type == "cuda":
            wait_for_device_watching(self._workers)

    # -- internals -------------------------------------------------------------------------------------------

    def _call(self, method: str, *args: object, ack: bool = False) -> object:
        """Mirror ``method(*args)`` to spawned workers (if any), run it here, and wait for their ack if asked.

        A worker failure marks the engine failed and raises WorkerError.
        """
        try:
            seq = self._workers.send(method, args, {}, ack=ack) if self._workers is not None else None
            result = getattr(self, method)(*args)
            if ack and self._workers is not None:
                self._workers.wait_ack(seq, tp_launch.tp_timeout_s())
            return result
        except tp_launch.WorkerError as e:
            self._failed = e
            raise
        except BaseException as e:
            err = self._worker_error()
            if err is not None:
                self._failed = err
                raise err from e
            raise

    def _generate_ids(self, ids: list[list[int]], plist: list[SamplingParams]) -> list[Completion]:
        rids = [self._add_ids(i, p) for i, p in zip(ids, plist)]
        done: dict[int, Completion] = {}
        with torch.inference_mode():
            while self.scheduler.has_unfinished():
                for c in self._step():
                    done[c.request_id] = c
        return [done[r] for r in rids]

    def _add_ids(self, ids: list[int], params: SamplingParams) -> int:
        rid = self._next_rid
        self._next_rid += 1
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + rid
            gen = make_generator(seed, self.runner.device)
        self.scheduler.add(Request(rid, list(ids), params, gen, self.eos_ids, t_added=time.perf_counter(),
                                   seed=seed if gen is not None else 0))
        return rid

    def _abort(self, rid: int) -> bool:
        return self.scheduler.abort(rid)

    def _verify(self, drafts: dict[int, list[int]]) -> VerifyResult:
        step = self.scheduler.schedule_verify(drafts, self.config.max_verify_tokens)
        reqs = list(step.requests)
        before = {r.rid: len(r.output_ids) for r in reqs}
        finished = self._run(step)
        return VerifyResult({r.rid: r.output_ids[before[r.rid]:] for r in reqs}, finished)

    def _drain(self) -> list[Completion]:
        return self.overlap.drain() if self.overlap is not None else []

    def _prepare(self, prompts: object, params: object) -> tuple[list[list[int]], list[SamplingParams]]:
        """Tokenize and validate on the calling rank, before anything is mirrored or queued (``prepare_prompts``)."""
        return prepare_prompts(prompts, params, self.tokenizer, self.model_config.vocab_size, self.config,
                               lambda i, n: self.scheduler.check_fits(self._next_rid + i, n))

    def _completion(self, r: Request) -> Completion:
        return completion_of(r, self.tokenizer.decode)

    def _check_usable(self) -> None:
        if self.runner is None:
            raise RuntimeError("this Engine is closed; create a new one")
        if self._failed is not None:
            raise RuntimeError(f"this Engine failed in an earlier step ({type(self._failed).__name__}: "
                               f"{self._failed}); close it and create a new one")

    def _worker_error(self) -> tp_launch.WorkerError | None:
        """The error a spawned worker reported or its death, if any (checked after a failure here)."""
        if self._workers is None:
            return None
        try:
            self._workers.check()
        except tp_launch.WorkerError as e:
            return e
        return None
