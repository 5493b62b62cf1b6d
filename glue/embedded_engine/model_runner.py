"""The engine's model worker: one thread owns the HF model, admits requests into the running batch, decodes and
samples; the HTTP side submits, aborts, pauses and swaps weights through thread-safe calls.

Continuous batching in a simple form: new (or retracted) requests are prefilled, grouped by length so no padding,
and join the running batch at the next step; finished rows leave it. Every forward and every weight copy holds
`self.model_lock`, so weights never change under a forward; `pause()` returns only once the thread is parked
between two steps.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch
from transformers import DynamicCache

from glue.embedded_engine.checkpoint_names import checkpoint_tensors
from glue.embedded_engine.kv_batch import KVBatch, cache_tensors
from glue.embedded_engine.prompt_logprobs import record_input_logprobs, wants_input_logprobs
from glue.embedded_engine.request_schema import GenerationRequest
from glue.embedded_engine.routed_experts import RoutingRecorder
from glue.embedded_engine.sampling import sample_token
from glue.embedded_engine.sequence import MemoryReleasedError, Sequence, position_generator

ABORT_MESSAGE = "Aborted"
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode


class ModelRunner:
    """Owns the model and the scheduling thread. Call `start()` once; `stop()` ends the thread."""

    def __init__(self, model: Any, *, max_running_requests: int, seed: int, weight_version: str, eos_token_ids: set[int],
                 deterministic: bool = False, recorder: RoutingRecorder | None = None):
        self.model = model
        self.device = next(model.parameters()).device  # inputs go there; logits come back to the CPU for sampling
        self.recorder = recorder  # set with --enable-return-routed-experts: files each forward's MoE routing
        self.deterministic = deterministic  # see _deterministic_step
        self.model_lock = threading.Lock()
        self.weight_version = weight_version
        self.max_running_requests = max_running_requests
        self.eos_token_ids = frozenset(eos_token_ids)
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._active: set[Sequence] = set()  # admitted and not finished; only the loop thread finishes them
        self._running: list[Sequence] = []  # rows of self._batch, in order
        self._batch = KVBatch()
        self._paused = False
        self._is_stepping = False  # the runner thread is inside a step (prefill + decode) and may run a forward
        self._stopped = False
        self._seeds = torch.Generator().manual_seed(seed)
        self._thread = threading.Thread(target=self._loop, name="model-runner", daemon=True)
        self.forward_count = 0  # forwards run so far (prefill and decode)
        self.released: set[str] = set()  # memory tags given up by /release_memory_occupation ("weights", "kv_cache")
        self._weight_shapes: dict[int, torch.Size] = {}  # id(parameter) -> shape, while "weights" is released

    # ---- calls from the HTTP side (any thread) ----
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest, on_done: Callable[[Sequence], None]) -> Sequence:
        """Queue a request; `on_done(seq)` is called from the runner thread when it finishes (or is aborted).
        Raises MemoryReleasedError while weights or KV cache are released."""
        with self._cond:
            if self.released:
                raise MemoryReleasedError(sorted(self.released))
            seed = request.sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            seq = Sequence(request=request, on_done=on_done, generator=torch.Generator().manual_seed(seed), seed=seed)
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq

    def abort(self, rid: str | None = None, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort the request `rid` (every request whose rid starts with it when `prefix`, as SGLang's scheduler
        matches; or all of them): queued ones at once, running ones before the next step."""
        with self._cond:
            matches = lambda s: (abort_all or s.request.rid == rid  # noqa: E731
                                 or (prefix and s.request.rid.startswith(rid)))
            queued = [s for s in self._waiting if matches(s)]
            for seq in queued:
                self._waiting.remove(seq)
                seq.aborted_in_queue = True
                self._finish(seq, {"type": "abort", "message": ABORT_MESSAGE, "status_code": None, "err_type": None})
            running = [s for s in self._active if matches(s)]
            for seq in running:
                seq.abort_requested = True
            self._cond.notify_all()
            return len(queued) + len(running)

    def pause(self, mode: str, timeout_s: float = 60.0) -> None:
        """Stop taking steps and return once the runner thread is parked: no forward is in progress and none starts
        until `resume()`; new requests queue meanwhile. In-flight requests, by SGLang's `mode`:
        "abort": answered now with an abort finish reason and their output so far.
        "retract": leave the running batch and lose their KV; they wait at the front of the queue with their output
        so far and, once resumed, are prefilled again from prompt + output with the weights current then, so no
        request's KV mixes weight versions.
        "in_place": keep their KV and continue after `resume()`; after a weight update their next tokens attend to
        KV computed with the old weights (SGLang's in_place mixes versions in the KV the same way)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            self._paused = True
            if not self._cond.wait_for(lambda: not self._is_stepping, timeout=timeout_s):
                raise TimeoutError(f"pause_generation: the running step did not end within {timeout_s} s")
            if mode == "retract":
                self._retract_running()
        if mode == "abort":
            self.abort(abort_all=True)
            with self._cond:
                if not self._cond.wait_for(lambda: not self._active, timeout=timeout_s):
                    raise TimeoutError(f"pause_generation: in-flight requests were not aborted within {timeout_s} s")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def is_live(self, rid: str) -> bool:
        """Whether a request with exactly this rid is queued or running."""
        with self._cond:
            return any(s.request.rid == rid for s in (*self._waiting, *self._active))

    def is_idle(self, ignore_waiting: bool) -> bool:
        """SGLang's `Scheduler.is_fully_idle(ignore_waiting=...)`: nothing admitted (running or paused in place) and,
        unless `ignore_waiting`, nothing queued (queued requests hold no KV here: retracted ones lost theirs)."""
        with self._cond:
            return not self._active and not self._is_stepping and (ignore_waiting or not self._waiting)

    def load(self) -> dict[str, int]:
        """Requests admitted (prefilling or decoding) and queued right now."""
        with self._cond:
            return {"num_running_reqs": len(self._active), "num_waiting_reqs": len(self._waiting)}

    # ---- memory occupation (colocated placement: the trainer uses the device during training) ----
    def release_memory(self, tags: set[str]) -> None:
        """Give up memory: any tag aborts every request and drops the KV cache (new requests are refused until
        resumed); "weights" also frees every parameter's storage (the contents are lost: sync weights after resume)."""
        with self._cond:
            self.released |= tags
        self.abort(abort_all=True)
        with self._cond:
            if not self._cond.wait_for(lambda: not self._active, timeout=60):
                raise TimeoutError("release_memory_occupation: in-flight requests were not aborted within 60 s")
            self._batch = KVBatch()
        if "weights" in tags:
            with self.model_lock:
                for p in self.model.parameters():
                    if p.numel():
                        self._weight_shapes[id(p)] = p.shape
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def resume_memory(self, tags: set[str]) -> None:
        """Take memory back; "weights" re-allocates every parameter (zeros until the next weight update)."""
        if "weights" in tags:
            with self.model_lock:
                for p in self.model.parameters():
                    if id(p) in self._weight_shapes:
                        p.data = torch.zeros(self._weight_shapes.pop(id(p)), dtype=p.dtype, device=p.device)
        with self._cond:
            self.released -= tags
            self._cond.notify_all()

    def weight_bytes(self) -> int:
        """Bytes the parameters' storages hold now (0 while "weights" is released)."""
        with self.model_lock:
            return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                        for p in self.model.parameters() if p.numel()}.values())

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None) -> tuple[bool, str]:
        """Copy tensors into the model's weights by HF checkpoint name, all or nothing, between two forwards; a
        `weight_version` tags them in the same lock hold, so no forward runs on the new weights under the old tag."""
        if "weights" in self.released:
            return False, ("the engine's weights are released (/release_memory_occupation); call "
                           "/resume_memory_occupation with tags [\"weights\"] before updating them")
        params = checkpoint_tensors(self.model)
        unknown = [n for n, _ in named_tensors if n not in params]
        if unknown:
            return False, (f"unknown parameter name(s) {unknown[:5]} ({len(unknown)} in all); the checkpoint's names look "
                           f"like {list(params)[:3]}. Convert trainer names to HF names before sending.")
        bad = [f"{n}: sent {tuple(t.shape)}, model has {tuple(params[n].shape)}"
               for n, t in named_tensors if tuple(t.shape) != tuple(params[n].shape)]
        if bad:
            return False, f"shape mismatch for {len(bad)} tensor(s), nothing was loaded: {'; '.join(bad[:5])}"
        with self.model_lock, torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
            if weight_version is not None:
                self.weight_version = weight_version
        return True, f"Succeeded to update {len(named_tensors)} parameter(s)."

    def set_weight_version(self, weight_version: str) -> None:
        with self.model_lock:
            self.weight_version = weight_version

    # ---- the runner thread ----
    def _has_work(self) -> bool:
        if self._stopped or any(s.abort_requested for s in self._active):
            return True
        return not self._paused and bool(self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._stopped:
                    return
                self._drop_aborted()
                if self._paused:
                    continue
                room = self.max_running_requests - len(self._running)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self._active.update(admitted)
                self._is_stepping = True  # decided under the lock that pause() takes: a pause waits for this step
            try:
                if self.deterministic:
                    self._deterministic_step(admitted)
                    continue
                self._prefill(admitted)
                if self._running:
                    self._decode_step()
            finally:
                with self._cond:
                    self._is_stepping = False
                    self._cond.notify_all()

    def _retract_running(self) -> None:
        """Put the running batch back at the front of the queue, in order, without its KV (called with self._cond
        held while the thread is parked). Each request keeps its output; its next prefill covers it."""
        self._drop_aborted()
        assert self._active == set(self._running), "a parked runner has every admitted request in its batch"
        for seq in self._running:
            seq.retraction_count += 1
        self._waiting.extendleft(reversed(self._running))
        self._active.clear()
        self._running = []
        self._batch = KVBatch()

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        """Record the result and hand it back (called with self._cond held)."""
        seq.finish_reason = reason
        seq.final_version = self.weight_version
        seq.finished_at = time.monotonic()
        self._active.discard(seq)
        self._cond.notify_all()
        seq.on_done(seq)

    def _drop_aborted(self) -> None:
        keep = [i for i, s in enumerate(self._running) if not s.abort_requested]
        for seq in self._running:
            if seq.abort_requested:
                self._finish(seq, {"type": "abort", "message": ABORT_MESSAGE, "status_code": None, "err_type": None})
        self._running = [self._running[i] for i in keep]
        if not self.deterministic:  # deterministic steps keep no KV
            self._batch.keep_rows(keep)

    def _stop_reason(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        """SGLang's order (Req.update_finish_state): a stop string, then a stop token (all off with ignore_eos,
        stop_token_ids included), then the length budget."""
        s = seq.request.sampling
        matched = s.stop_strings.match(seq.output_ids) if s.stop_strings is not None else None
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if not s.ignore_eos and (token in s.stop_token_ids or token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if len(seq.output_ids) >= s.max_new_tokens:
            return {"type": "length", "length": s.max_new_tokens}
        return None

    def _take_tokens(self, seqs: list[Sequence], logits: torch.Tensor, version: str) -> list[int]:
        """Sample one token per row; finish the rows that stop; return the indices of rows that go on."""
        going_on, finished = [], []
        logits = logits.cpu()
        for i, seq in enumerate(seqs):
            generator = seq.generator if not self.deterministic else position_generator(seq)
            token, logprob = sample_token(logits[i], seq.request.sampling, generator)
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            reason = self._stop_reason(seq, token)
            (finished if reason else going_on).append((i, reason))
        with self._cond:
            for i, reason in finished:
                self._finish(seqs[i], reason)
        return [i for i, _ in going_on]

    def _forward(self, seqs: list[Sequence], first_positions: list[int], use_cache: bool = True,
                 **inputs: Any) -> tuple[Any, str]:
        """One forward for `seqs` (row i's first input token sits at `first_positions[i]` of its sequence); the
        routing it used is filed under the sequences that asked for it before any of them is finished."""
        with self.model_lock, torch.inference_mode():
            self.forward_count += 1
            inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            out, version = self.model(**inputs, use_cache=use_cache), self.weight_version
            if self.recorder is not None:
                self.recorder.record(seqs, first_positions, inputs["input_ids"].shape[1])
            return out, version

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Run each context-length group's contexts together and move the survivors into the running batch. A
        request for 0 new tokens is answered from the prefill (its input logprobs), or at once if it asked none."""
        by_length: dict[int, list[Sequence]] = {}
        for seq in seqs:
            if seq.request.sampling.max_new_tokens == 0 and not wants_input_logprobs(seq.request):
                self._finish_unsampled(seq)
                continue
            by_length.setdefault(len(seq.context_ids), []).append(seq)
        for length, group in by_length.items():
            ids = torch.tensor([s.context_ids for s in group], dtype=torch.long)
            out, version = self._forward(group, [0] * len(group), input_ids=ids, past_key_values=DynamicCache())
            record_input_logprobs(group, out.logits)
            rows = [i for i, s in enumerate(group) if s.request.sampling.max_new_tokens > 0]
            for seq in (s for s in group if s.request.sampling.max_new_tokens == 0):
                self._finish_unsampled(seq)
            going_on = [rows[i] for i in self._take_tokens([group[r] for r in rows], out.logits[rows, -1], version)]
            if going_on:
                index = torch.tensor(going_on, dtype=torch.long, device=self.device)
                kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in cache_tensors(out.past_key_values)]
                self._batch.add(kv, [length] * len(going_on))
                self._running.extend(group[i] for i in going_on)

    def _finish_unsampled(self, seq: Sequence) -> None:
        """Answer a request for 0 new tokens (finish reason length 0, as SGLang)."""
        with self._cond:
            self._finish(seq, {"type": "length", "length": 0})

    def _deterministic_step(self, admitted: list[Sequence]) -> None:
        """`--enable-deterministic-inference`: every token comes from a forward of one request over its whole
        context (no KV cache, no batch), sampled with a generator seeded by the request's seed and the token's
        position. A token then depends only on the weights, the context and the seed: not on which requests ran
        beside it, nor on whether its request was retracted, aborted and continued, or re-issued after a restart
        from the tokens it had. Slow (quadratic in the length): for tests and reproducible runs on small models."""
        for seq in admitted:
            if seq.request.sampling.max_new_tokens > 0:
                self._running.append(seq)
                continue
            if wants_input_logprobs(seq.request):
                out, _ = self._forward([seq], [0], use_cache=False, input_ids=torch.tensor([seq.context_ids]))
                record_input_logprobs([seq], out.logits)
            self._finish_unsampled(seq)
        going_on = []
        for seq in self._running:
            out, version = self._forward([seq], [0], use_cache=False,
                                         input_ids=torch.tensor([seq.context_ids], dtype=torch.long))
            record_input_logprobs([seq], out.logits)
            going_on.extend(seq for i in self._take_tokens([seq], out.logits[:, -1], version) if i == 0)
        self._running = going_on

    def _decode_step(self) -> None:
        tokens = torch.tensor([[s.output_ids[-1]] for s in self._running], dtype=torch.long)
        cache, mask, positions = self._batch.decode_inputs()
        out, version = self._forward(self._running, [len(s.context_ids) - 1 for s in self._running], input_ids=tokens,
                                     attention_mask=mask, position_ids=positions, past_key_values=cache)
        self._batch.advance(out.past_key_values)
        going_on = self._take_tokens(self._running, out.logits[:, -1], version)
        self._running = [self._running[i] for i in going_on]
        self._batch.keep_rows(going_on)
