"""The engine on rank 0, and ``launch_engine`` which builds one on every rank:
``with launch_engine(config) as engine: engine.generate([GenerationRequest([1, 2, 3])])``.
MPI stays on the main thread: ``generate`` and ``serve_forever`` tick the scheduler on the
calling thread; other threads only ``submit`` and wait on their handles. (With ``--overlap`` on
the CPU, a decode step's forward pass and its combines run on one helper thread while the main
thread plans or waits, never calling MPI meanwhile: eprt/engine/overlap.py.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from eprt.api import ENGINE_FAILED, STOPPED, GenerationRequest, GenerationResult, Guide, RequestError
from eprt.engine.adapters import UnknownAdapter
from eprt.engine.choices import best_choices
from eprt.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args  # noqa: F401
from eprt.engine.eplb import Rebalancer
from eprt.engine.expert_load import imbalance
from eprt.engine.images import EngineImages
from eprt.engine.isolation import one_by_one
from eprt.engine.launch import close_transport, open_rank, rank0_runner, serve_worker, start
from eprt.engine.runner import ModelRunner
from eprt.scheduler.clock import WallClock
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.scheduler import Scheduler

log = logging.getLogger("eprt.engine")
EXPERT_LOAD_INTERVAL_S = 1.0  # the expert-load counts are read from the device at most this often
STATS_LOG_INTERVAL_S = 10.0  # how often a busy engine logs its counters and KV accounting


class Handle:
    """A submitted request: ``result()`` blocks, ``cancel()`` ends it and frees its blocks."""

    def __init__(self, inner, engine: Engine):
        self._inner, self._engine = inner, engine

    @property
    def seq_id(self) -> int:
        return self._inner.seq_id

    def done(self) -> bool:
        return self._inner.done()

    @property
    def started(self) -> bool:
        return self._inner.started

    def cancel(self) -> None:
        self._inner.cancel()

    @property
    def logprobs(self) -> list | None:
        return self._inner.logprobs

    @property
    def prompt_logprobs(self) -> list | None:
        return self._inner.prompt_logprobs

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self._engine._with_text(self._inner.result(timeout))


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, loaded, config: EngineConfig, transport):
        self.runner, self.scheduler, self.config, self.transport = runner, scheduler, config, transport
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.vocab_size = loaded.config.vocab_size
        self.max_model_len = scheduler.config.max_model_len
        self._lock = threading.Lock()
        self._counters = {"requests_finished": 0, "cached_tokens": 0, "prompt_tokens": 0}
        self._closed = False
        self._stop_requested = False
        self._expert_load = runner.executor.model.expert_load()  # [L, E], refreshed by the loop
        self._expert_load_at = time.monotonic()
        self._next_log = time.monotonic() + STATS_LOG_INTERVAL_S
        self.eplb = None  # eprt.engine.eplb.Rebalancer under EPLB
        # --check-state: in a job of several ranks, and not under --overlap (its forward pass may be in flight)
        self.check_state = config.check_state and transport.size > 1 and runner.overlap is None
        self.images = EngineImages(config.model, loaded.config)
        self.images.preload()

    @property
    def generation_tokens(self) -> int:
        """Tokens generated so far, counted as they are generated (any thread)."""
        return self.scheduler.generated_tokens

    # ---- clients (any thread) ------------------------------------------------------------
    def submit(self, req: GenerationRequest, on_finish=None):
        """Queue a request of one choice; RequestError (naming the problem) if it cannot be served."""
        if getattr(req.params, "choices", 1) != 1:
            raise RequestError(f"{req.params.choices} choices asked for: submit them with submit_choices")
        return self.submit_choices(req, on_finish)[0]

    def _adapter_id(self, name: str | None, count: int = 1) -> int:
        """-1 for the base model (None or its name), else the adapter's id (UnknownAdapter if none),
        held in flight ``count`` times (once per choice: each choice's finish lets go once)."""
        if name is None or name == self.model_name:
            return -1
        if self.runner.adapters is None:
            raise UnknownAdapter(f"model {name!r} is not {self.model_name!r} and no LoRA adapters are served")
        return self.runner.adapters.begin(name, count)

    def adapter_names(self) -> list[str]:
        return [] if self.runner.adapters is None else self.runner.adapters.names()

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at ``path`` as ``name`` (checked on rank 0 now; put into slots when used)."""
        if self.runner.adapters is None:
            raise RequestError("LoRA adapters are not enabled (start with --enable-lora or --lora-modules)")
        self.runner.adapters.register(name, path)

    def unload_adapter(self, name: str) -> None:
        if self.runner.adapters is None:
            raise UnknownAdapter(f"no LoRA adapter named {name!r} (LoRA is not enabled)")
        self.runner.adapters.unregister(name)

    def submit_choices(self, req: GenerationRequest, on_finish=None, on_tokens: list | None = None) -> list:
        """Queue a request of ``req.params.choices`` choices (n, or best_of), one Handle each;
        they share the prompt's prefill (docs/design.md, "Choices"). ``on_tokens[k]`` streams
        choice k; ``on_finish`` runs once per choice (``result.index``)."""
        self.images.apply(req)
        self._check_vision(req)
        self.compile_guide(req.params.guide)
        count = getattr(req.params, "choices", 1)
        adapter = self._adapter_id(req.adapter, count)
        try:
            inner = self.scheduler.submit_choices(
                req, on_finish=self._finisher(on_finish, adapter), on_tokens=on_tokens, adapter=adapter
            )
        except BaseException:
            if adapter != -1:
                self.runner.adapters.end(adapter, count)
            raise
        return [Handle(h, self) for h in inner]

    def compile_guide(self, guide) -> None:
        """RequestError naming the problem when a structured-output guide does not compile for this
        model (the runner compiles it again per sequence, which then cannot fail)."""
        if guide is not None:
            if not isinstance(guide, Guide):
                raise RequestError(f"guide must be an eprt.api.Guide, got {guide!r:.80}")
            self.runner.sampler.guides.compiler.grammar(guide)

    def _with_text(self, result: GenerationResult) -> GenerationResult:
        """``result`` with its text decoded; a decoding that fails fails that request alone."""
        if self.tokenizer is not None and not result.text:
            eos = set(self.scheduler.config.eos_token_ids)
            ids = [t for t in result.token_ids if t not in eos]
            (text,) = one_by_one([ids], self.tokenizer.decode, "detokenizing")
            if not isinstance(text, RowFailure):
                result.text = text
            elif result.error is None:  # (an error result keeps its first error)
                result.finish_reason, result.error = "error", text.reason
        return result

    def _finisher(self, user_cb, adapter: int = -1):
        def done(result: GenerationResult) -> None:
            if adapter != -1:
                self.runner.adapters.end(adapter)
            self._with_text(result)
            with self._lock:
                c = self._counters
                c["requests_finished"] += 1
                if result.index == 0:  # the choices of one prompt count it once
                    c["cached_tokens"] += result.cached_tokens
                    c["prompt_tokens"] += len(result.prompt_ids)
            if user_cb is not None:
                user_cb(result)

        return done

    def _check_vision(self, req: GenerationRequest) -> None:
        rows = req.image_embeds
        if rows is None:
            return
        try:
            rows = np.asarray(rows)
        except (ValueError, TypeError) as e:  # ragged nested lists, objects NumPy cannot take
            raise RequestError(f"image_embeds is not an array of numbers: {e}") from None
        d = self.runner.executor.hidden_size  # a vision row's width
        if rows.ndim != 2 or rows.shape[1] != d:
            raise RequestError(f"image_embeds must have shape [n, {d}], got {list(rows.shape)}")
        if rows.dtype.kind not in "fiu" or not np.isfinite(rows).all():
            raise RequestError("image_embeds must be finite numbers")
        token = self.runner.executor.image_token_id
        if token is None:
            raise RequestError("image_embeds given but the model has no image_token_id (use --image-token-id)")
        n = sum(1 for t in req.prompt_ids if t == token)
        if n != len(rows):
            raise RequestError(f"{len(rows)} image_embeds rows for {n} image placeholder tokens ({token})")
        req.image_embeds = np.ascontiguousarray(rows, dtype=np.float32)

    # ---- the loop (main thread) ---------------------------------------------------------
    def request_stop(self) -> None:
        """Stop admitting work (safe in a signal handler: it only sets a flag). ``generate``
        then cancels its requests that have not started, which come back as ``error`` results
        beginning with STOPPED, and lets the running ones finish."""
        self._stop_requested = True

    def generate(self, reqs: list) -> list:
        """Run requests as one continuous batch; invalid ones come back as error results. A
        request of several choices (n, best_of) must go through ``generate_choices``."""
        several = [i for i, req in enumerate(reqs) if getattr(req.params, "choices", 1) != 1]
        if several:
            raise RequestError(f"request {several[0]} asks for several choices (n, best_of): use generate_choices")
        return [choices[0] for choices in self.generate_choices(reqs)]

    def generate_choices(self, reqs: list, on_step=None, strict: bool = False) -> list:
        """Like ``generate``, one list of results per request: its ``params.n`` choices (with
        best_of, the n of highest cumulative logprob; engine.choices.best_choices).
        ``on_step(done)``: called after each step with the number of requests done. ``strict``: a
        request that cannot be served raises its RequestError (naming it) before any is run."""
        out = self._run_choices(reqs, on_step, strict)
        return [
            best_choices(res, req.params.n) if req.params.best_of is not None else res for req, res in zip(reqs, out)
        ]

    def _run_choices(self, reqs: list, on_step=None, strict: bool = False) -> list:
        handles, results = _submit_all(self, reqs, strict)
        dropped: set = set()
        while not all(h.done() for _, hs in handles for h in hs):
            if self._stop_requested:
                for i, hs in handles:
                    if i not in dropped and not any(h.started for h in hs):
                        dropped.add(i)
                        for h in hs:
                            h.cancel()
            self.step()
            if on_step is not None:
                on_step(len(reqs) - len(handles) + sum(all(h.done() for h in hs) for _, hs in handles))
        for i, hs in handles:
            results[i] = [h.result() for h in hs]
            if i in dropped:
                results[i] = [
                    GenerationResult(
                        reqs[i].request_id,
                        list(reqs[i].prompt_ids),
                        [],
                        "error",
                        error=f"{STOPPED}: the run was stopped before this request started",
                    )
                ]
        return results

    def serve_forever(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Tick while there is work, sleep on the inbox while idle, until ``stop`` is set and
        everything in flight is done. On going idle the expert-load counts are read once more:
        step() reads them at most once a second, which would leave the last steps unshown."""
        stepped = False  # steps ran since the counts were last read
        while not stop.is_set():
            if self.scheduler.in_flight():
                self.step()
                stepped = True
            else:
                if stepped:
                    self._refresh_expert_load(time.monotonic())
                    stepped = False
                self.scheduler.wait_for_work(poll_s)
        while self.scheduler.in_flight():
            self.step()

    def step(self) -> None:
        """One scheduler tick, then the engine's periodic work (what generate and serve_forever
        loop on; a caller driving several engines in turn may call it)."""
        frames = self.transport.stats.frames
        try:
            self.scheduler.step()
            if self.check_state and self.transport.stats.frames != frames:  # a step that ran something
                self.runner.check_state(self.scheduler.tick)
        except BaseException as e:  # a failed rank or model error: no request waits forever
            self.scheduler.fail_all(f"{ENGINE_FAILED}: {type(e).__name__}: {e}")
            raise
        if self.eplb is not None:
            self.eplb.after_step()
        now = time.monotonic()
        if now - self._expert_load_at >= EXPERT_LOAD_INTERVAL_S:
            self._refresh_expert_load(now)
        if now >= self._next_log:
            self._next_log = now + STATS_LOG_INTERVAL_S
            log.info("%s", self.stats_line())

    def fail(self, message: str) -> None:
        """End every request in flight with ``message`` (the loop failed outside a step, e.g. a
        signal while idle); the main thread only, once the loop has stopped."""
        self.scheduler.fail_all(message)

    def expert_load(self, refresh: bool = False) -> np.ndarray:
        """Tokens routed to each expert so far, [layers, experts] (any thread: the loop reads the
        device at most once per EXPERT_LOAD_INTERVAL_S; ``refresh`` reads it now, main thread only)."""
        if refresh:
            self._refresh_expert_load(time.monotonic())
        return self._expert_load

    def eplb_figures(self) -> dict | None:
        """Per MoE layer rank imbalance, contiguous vs the EPLB placement (None without EPLB); any thread."""
        return None if self.eplb is None else self.eplb.figures(self._expert_load)

    def _refresh_expert_load(self, now: float) -> None:
        self._expert_load, self._expert_load_at = self.runner.executor.model.expert_load(), now

    def stats_line(self) -> str:
        s = self.stats()
        worst = imbalance(self._expert_load)
        return (
            f"running {s['running']}, waiting {s['waiting']}; KV blocks: {s['free_blocks']} free "
            f"of {s['total_blocks']} ({s['cached_blocks']} cached); prompt tokens computed "
            f"{s['prompt_tokens_computed']}, from cache {s['cached_tokens']}; generated "
            f"{s['generation_tokens']}; preemptions {s['preemptions']}; expert load max/mean "
            f"{worst.max():.2f} (layer {int(worst.argmax())})"
            + ("" if self.eplb is None else f"; {self.eplb.summary(self._expert_load)}")
            + moe_exchange_text(s)
        )

    def stats(self) -> dict:
        pools = getattr(self.runner.executor, "pools", None)  # dp attention: every rank's pool, mirrored here
        blocks = [self.runner.executor.blocks] if pools is None else pools.pools
        with self._lock:
            out = dict(self._counters)
        sched = self.scheduler.stats()
        out.update(
            sched,
            waiting=sched["queued"],
            free_blocks=sum(b.num_free_blocks() for b in blocks),
            cached_blocks=sum(b.num_cached_blocks() for b in blocks),
            total_blocks=sum(b.num_blocks for b in blocks),
            prompt_tokens_computed=self.runner.prompt_tokens_computed,
            decode_steps=self.runner.decode_steps,
            decode_rows=self.runner.decode_rows,
            spec_proposed_tokens=self.runner.drafts.proposed_tokens,
            spec_accepted_tokens=self.runner.kv.accepted_tokens,
            spec_verify_steps=self.runner.drafts.verify_steps,
            spec_mean_accepted_length=self.runner.mean_accepted_length(),
        )
        model, comm = self.runner.executor.model, self.transport.stats
        out.update(
            moe_exchange="alltoall" if getattr(model, "alltoall", None) is not None else "allgather",
            moe_layers=getattr(model, "moe_layers_run", 0),  # (the scripted model runs none)
            moe_sent_bytes=comm.moe_sent_bytes,
            moe_recv_bytes=comm.moe_recv_bytes,
            moe_exchange_seconds=comm.moe_exchange_s,
        )
        return out

    def shutdown(self) -> None:
        """Finish what is in flight, send SHUTDOWN to the workers and free everything."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        while self.scheduler.step():
            pass
        self._refresh_expert_load(time.monotonic())
        log.info("shutdown: %s", self.stats_line())
        close_transport(self.transport, self.config)


def moe_exchange_text(s: dict) -> str:
    """The log line's MoE exchange: rank 0's bytes and time per MoE layer (nothing on one rank)."""
    layers = s.get("moe_layers", 0)
    if not layers or not (s["moe_sent_bytes"] or s["moe_recv_bytes"]):
        return ""
    return (
        f"; MoE exchange {s['moe_exchange']}: {s['moe_sent_bytes'] / layers:.0f} B sent, "
        f"{s['moe_recv_bytes'] / layers:.0f} B received, {1e6 * s['moe_exchange_seconds'] / layers:.0f} us "
        f"per layer (rank 0, {layers} layers)"
    )


def _submit_all(engine: Engine, reqs: list, strict: bool) -> tuple:
    """(handles [(i, [Handle])], results with each refused request's error result in its place);
    ``strict``: the first refused request cancels those submitted and raises its RequestError."""
    handles, results = [], [None] * len(reqs)
    for i, req in enumerate(reqs):
        try:
            handles.append((i, engine.submit_choices(req)))
        except RequestError as e:
            if strict:
                for _, hs in handles:
                    for h in hs:
                        h.cancel()
                raise RequestError(f"prompt {i}: {e}" if len(reqs) > 1 else str(e)) from None
            results[i] = [GenerationResult(req.request_id, list(req.prompt_ids), [], "error", error=str(e))]
    return handles, results


@contextlib.contextmanager
def launch_engine(args_or_config, transport=None, precheck=None):
    """Build the engine on every rank (eprt/engine/launch.py): rank 0 gets the Engine; a worker rank
    serves the command stream and leaves with SystemExit (0 after SHUTDOWN, 1 after a failure, 2 when
    the job could not start). ``transport`` defaults to the launcher's world (``open_transport()``);
    ``precheck``: rank 0's check of its input, run before loading (``launch.precheck``)."""
    cfg = args_or_config if isinstance(args_or_config, EngineConfig) else engine_config_from_args(args_or_config)
    cfg.validate()
    transport, device = open_rank(cfg, transport)
    started = start(cfg, device, transport, precheck)
    if transport.rank != 0:
        serve_worker(cfg, transport, started)  # (never returns)
    runner, sched_cfg = rank0_runner(cfg, device, transport, started)
    engine = Engine(runner, Scheduler(runner, sched_cfg, clock=WallClock()), started.loaded, cfg, transport)
    if cfg.eplb.active:
        engine.eplb = Rebalancer(runner, cfg.eplb, started.loaded.config, transport.size, started.nodes)
    ok = False
    try:
        yield engine
        ok = True
    finally:
        if ok:
            engine.shutdown()
        else:
            transport.close("rank 0 failed")
