"""The zoom tier: the prefill's own K / V of span tokens, stored in the pack and read in place of their factors'
rebuild when their zoom block is zoomed (``zoom_tier``: "exact" in the store dtype, "int8" with one scale a row).

The factors (sekv/factorize.py, coded 4-bit, sekv/codec.py) stay what the scout ranks with and what a pack without
the tier rebuilds from; the tier only changes what a zoomed block holds: the tokens the model reads at full
resolution are then the prefill's (up to the tier's rounding), not a rank-<=32, 4/3-bit approximation of them
(relative error ~0.05-0.13 on keys, ~0.35 on values: docs/long-documents.md, "Why sekv misses needles full KV
finds").  It costs pack bytes, not resident ones: the tier lives in host memory like the factors, and a zoomed
block takes the same resident rows whichever source filled them.

Pack tensors (sekv/layout.py):  zoom.idx [P] int64, the covered tokens' global positions (sorted; every span
token); per layer zoom.k.l / zoom.v.l [Hkv, P, d] (pre-RoPE keys where the pack's keys are, values): the store dtype
("exact") or int8 with zoom.ks.l / zoom.vs.l [Hkv, P] float16 scales, x = q * s ("int8").
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import torch

from ..chunk_stream import ChunkStream
from . import blocks as fb

TIERS = ("factors", "int8", "exact")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] float -> (int8 codes [..., d], float16 scales [...]): symmetric, one scale a row, x ~ q * s."""
    x = x.float()
    s = (x.abs().amax(-1) / 127.0).to(torch.float16).float()
    q = torch.where(s.unsqueeze(-1) > 0, torch.round(x / s.clamp_min(1e-30).unsqueeze(-1)), torch.zeros_like(x))
    return q.clamp(-127, 127).to(torch.int8), s.to(torch.float16)


def window_tensors(kind: str, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, undo, chunks, sdt: torch.dtype, li: int) -> dict[str, torch.Tensor]:
    """One layer's tier rows of a window: its span tokens ``pos`` (span order) of the prefill's post-RoPE keys and
    values k, v [Hkv, N, d] -> pre-RoPE keys (``undo(rows, p0, p1)``: RoPE undone on rows p0:p1; None: post-RoPE
    packs) and values [Hkv, M, d], made in compress's row chunks (sekv/compress.py plan) into their final tensors."""
    hkv, d, M, dev = k.shape[0], k.shape[-1], int(pos.numel()), k.device
    if kind == "exact":
        out = {f"zoom.k.{li}": torch.empty(hkv, M, d, dtype=sdt, device=dev), f"zoom.v.{li}": torch.empty(hkv, M, d, dtype=sdt, device=dev)}
    else:
        out = {f"zoom.k.{li}": torch.empty(hkv, M, d, dtype=torch.int8, device=dev), f"zoom.ks.{li}": torch.empty(hkv, M, dtype=torch.float16, device=dev),
               f"zoom.v.{li}": torch.empty(hkv, M, d, dtype=torch.int8, device=dev), f"zoom.vs.{li}": torch.empty(hkv, M, dtype=torch.float16, device=dev)}
    for _, _, p0, p1 in chunks:
        if p1 <= p0:
            continue
        kx = k[:, pos[p0:p1]].float()
        if undo is not None:
            kx = undo(kx, p0, p1)
        for name, x in (("k", kx), ("v", v[:, pos[p0:p1]])):
            if kind == "exact":
                out[f"zoom.{name}.{li}"][:, p0:p1] = x.to(sdt)
            else:
                q, sc = quantize_rows(x)
                out[f"zoom.{name}.{li}"][:, p0:p1] = q
                out[f"zoom.{name}s.{li}"][:, p0:p1] = sc
        del kx
    return out


LAYER_PARTS = ("k", "ks", "v", "vs")

#: devices where a fixed set's tier rows are staged (:class:`StagedRows`: gathered on the host on a thread, a few
#: layers in flight); elsewhere :meth:`ZoomTier.rows` reads a layer's rows when its fill asks (tests add "cpu" to run
#: the staging on the CPU)
STAGED_ON = {"cuda"}
#: layers of rows between the host's gather and the device's fill (the ring's slots)
SLOTS = 4


class ZoomTier:
    """An opened pack's tier: ``lookup(layer, group, token, valid)`` gives the rows of covered tokens.

    The tier stays in the pack file: each layer's parts are tensors over the file's memory map (``Pack.mapped``;
    a store without one, its tensors in memory), and a read gathers only the rows asked for, on the host.  Nothing
    is read or page-locked up front; the tier's sha256s are checked on a thread of their own (:class:`TierCheck`,
    from before the model load in a session: a mismatch is raised by the next read; rows read before their layer's
    check are unchecked).

    A fixed set (sekv/fixed_set.py) asks for the same rows in every layer: :meth:`fetch` gathers them for all layers
    on a thread into a small page-locked ring and copies them to the device a layer at a time (:class:`StagedRows`),
    the plan's row ids copied to the host once (non-blocking, the thread waits for them).  :meth:`rows` reads one
    layer's at once (per-layer routing, the CPU): on an accelerator its row ids' copy to the host is a sync."""

    def __init__(self, store, names: set[str], shape, device):
        self.store, self.names, self.shape = store, names, shape
        self.device = torch.device(device)
        self.pos = store.get("sekv.zoom.idx").long()
        self.P = int(self.pos.numel())
        self.pos_dev = self.pos.to(self.device)
        self.int8 = "sekv.zoom.ks.0" in names
        self._parts: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.dtype = shape.dtype if self.int8 or not self.P else self._layer(0)["k"].dtype
        self.code_dtype = torch.int8 if self.int8 else self.dtype  # what the pack holds of K and V
        self._ring: _Ring | None = None
        self._staged: StagedRows | None = None
        self._worker = None
        self._old: list = []
        #: the last fetch's parts of a question's time (host seconds) and bytes read: step_stats' first_token_parts
        self.last: dict = {}
        #: the sha256 check of the tier's tensors on a thread (started before the model load where the session could:
        #: start_check), None where the store reads tensors whole and checked (store.get)
        early = _EARLY.pop(id(store), None)
        self.check = early[1] if early is not None and early[0] is store else TierCheck.of(store, shape.n_layers) if self.P else None

    @classmethod
    def of(cls, store, names: set[str], shape, device) -> "ZoomTier | None":
        return cls(store, names, shape, device) if "sekv.zoom.idx" in names else None

    def nbytes(self) -> int:
        """Host bytes of the whole tier (what the pack stores)."""
        return sum(t.numel() * t.element_size() for li in range(self.shape.n_layers) for t in self._layer(li).values())

    def _names(self, layer: int) -> dict[str, str]:
        return {p: f"sekv.zoom.{p}.{layer}" for p in LAYER_PARTS if f"sekv.zoom.{p}.{layer}" in self.names}

    def _layer(self, layer: int) -> dict[str, torch.Tensor]:
        """A layer's parts as rows, k / v [Hkv * P, d] and (int8) ks / vs [Hkv * P]: views of the pack's map."""
        got = self._parts.get(layer)
        if got is None:
            read = getattr(self.store, "mapped", self.store.get)
            n = self.shape.n_kv_heads * self.P
            got = {p: read(name).reshape(n, -1) if p in ("k", "v") else read(name).reshape(n) for p, name in self._names(layer).items()}
            with self._lock:
                got = self._parts.setdefault(layer, got)
        return got

    @property
    def damaged(self) -> BaseException | None:
        """What the check found wrong so far (None: nothing, or no check)."""
        return None if self.check is None else self.check.error

    def _gather(self, layer: int, idx: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The rows idx [M] (host, int64) of a layer's parts, on the host (into ``out``'s tensors where given)."""
        if self.damaged is not None:
            raise self.damaged
        src = self._layer(layer)
        if out is None:
            return {p: t.index_select(0, idx) for p, t in src.items()}
        for p, t in src.items():
            torch.index_select(t, 0, idx, out=out[p])
        return out

    def _decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered rows -> (K [M, d], V [M, d]) in the model dtype: int8 codes times their row's scale; or the store dtype's."""
        if self.int8:
            k = parts["k"].float() * parts["ks"].float().unsqueeze(-1)
            v = parts["v"].float() * parts["vs"].float().unsqueeze(-1)
            return k.to(self.shape.dtype), v.to(self.shape.dtype)
        return parts["k"].to(self.shape.dtype, copy=True), parts["v"].to(self.shape.dtype, copy=True)  # never a view of a slot

    def lookup(self, layer: int, group: torch.Tensor, token: torch.Tensor, valid: torch.Tensor):
        """Rows of (KV group, document token) pairs [M] (on the compute device): (hit [M] bool: the token is covered
        and valid, K [M, d] pre-RoPE, V [M, d]) in the model dtype; rows not hit hold some covered token's K / V."""
        return self.rows(layer, *self.locate(group, token, valid))

    def locate(self, group: torch.Tensor, token: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`rows` reads for those pairs, the same in every layer: (hit [M], the tier row [M])."""
        if self.P == 0:
            return torch.zeros_like(valid), torch.zeros_like(token)
        pos = self.pos_dev if self.pos_dev.device == token.device else self.pos.to(token.device)
        i = torch.searchsorted(pos, token).clamp_max(self.P - 1)
        return valid & (pos[i] == token), group * self.P + i

    def rows(self, layer: int, hit: torch.Tensor, row: torch.Tensor):
        """:meth:`lookup` of one layer from :meth:`locate`'s (hit, row): gathered on the host now (on an accelerator
        the row ids' copy to the host waits for the device) and sent to the device."""
        dev = row.device
        if self.P == 0:
            z = torch.zeros(row.numel(), self.shape.head_dim, dtype=self.shape.dtype, device=dev)
            return hit, z, z
        parts = self._gather(layer, row.to("cpu"))
        k, v = self._decode({p: t.to(dev) for p, t in parts.items()})
        return hit, k, v

    def settle(self) -> None:
        """End the staging thread's work (a step about to be captured in a CUDA graph: no other thread's copies beside
        it).  A fill still to come for that plan reads its layer directly."""
        if self._staged is not None:
            self._staged.cancel()

    def worker(self):
        """The one thread that stages rows (:class:`StagedRows`), kept: a new thread a question would set up its own
        intra-op threads each time."""
        if self._worker is None:
            self._worker = _Worker()
            weakref.finalize(self, self._worker.jobs.put, None)
        return self._worker

    def fetch(self, hit: torch.Tensor, row: torch.Tensor, layers: int) -> "StagedRows | _Direct":
        """The rows (hit, row) of layers 0..layers-1, asked for a layer at a time in order (a fixed set's fill):
        staged from now on where the device is in STAGED_ON (:class:`StagedRows`), else :meth:`rows` per layer."""
        if self._staged is not None:  # the previous plan's: its thread ends before the ring is reused
            self._staged.cancel()
            self._staged = None
        if self.P == 0 or row.device.type not in STAGED_ON:
            return _Direct(self, hit, row)
        m = row.numel()
        with torch.inference_mode():  # the ring's tensors are written by the thread: inference tensors, wherever made
            if self._ring is None or not self._ring.fits(m, self, row.device):
                # a ring replaced is kept until its last copies ended (their host memory is read by the DMA)
                self._old = [r for r in self._old + ([self._ring] if self._ring is not None else []) if not r.idle()]
                self._ring = _Ring(m, self, row.device)
            self._staged = StagedRows(self, self._ring, hit, row, layers)
        return self._staged


class TierCheck:
    """The tier's tensors checked against their sha256s on a thread, a layer after another (``Pack.check``, through
    the file's map: the pages a question's gather reads are mapped by then).  ``done`` is set at the end; ``error``
    holds what was found (a damaged or closed pack), raised by the tier's next read."""

    def __init__(self, store, names: list[str]):
        self.store, self.names = store, names
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="sekv-tier-check", daemon=True).start()

    @classmethod
    def of(cls, store, n_layers: int) -> "TierCheck | None":
        """A check of the store's tier, where it has one and reads tensors unchecked through a map (Pack)."""
        names = set(store.keys())
        if "sekv.zoom.idx" not in names or not (hasattr(store, "check") and hasattr(store, "mapped")):
            return None
        return cls(store, [n for li in range(n_layers) for p in LAYER_PARTS if (n := f"sekv.zoom.{p}.{li}") in names])

    def _run(self) -> None:
        try:
            for name in self.names:
                self.store.check(name)
        except Exception as e:  # noqa: BLE001 - raised by the next read
            self.error = e
        finally:
            self.done.set()


#: checks started before a memory opens (start_check), by id(store): (the store, its check)
_EARLY: dict[int, tuple[object, TierCheck]] = {}


def start_check(store, n_layers: int) -> None:
    """The tier's check of a pack about to be opened, from now (in `sekv ask` / `chat`: while the model loads);
    the ZoomTier opened on the same store takes it up."""
    check = TierCheck.of(store, n_layers)
    if check is not None:
        _EARLY[id(store)] = (store, check)


class _Worker:
    """A daemon thread running the jobs submitted, in order (a staging that waits for a fill that never comes does not
    hold up the process's exit); ``submit`` returns an Event set when the job has ended."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="sekv-tier", daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, ended = job
            try:
                fn()
            finally:
                ended.set()

    def submit(self, fn) -> threading.Event:
        ended = threading.Event()
        self.jobs.put((fn, ended))
        return ended


class _Direct:
    """:meth:`ZoomTier.fetch` without staging: each layer's rows read when asked."""

    def __init__(self, tier: ZoomTier, hit: torch.Tensor, row: torch.Tensor):
        self.tier, self.hit, self.row = tier, hit, row

    def layer(self, layer: int):
        return self.tier.rows(layer, self.hit, self.row)


class _Ring:
    """The staging memory, allocated once (again only for more rows): SLOTS slots of one layer's rows in page-locked
    host memory (plain memory off CUDA) and as many on the device, the row ids' host copy, a side stream for the
    copies, and each slot's last copy and last use (CUDA events, None before any)."""

    def __init__(self, m: int, tier: ZoomTier, device: torch.device):
        self.m, self.device, self.cuda = m, device, device.type == "cuda"
        d = tier.shape.head_dim
        isz = torch.empty(0, dtype=tier.code_dtype).element_size()
        # a slot's parts, byte offsets: k, v [m, d] as the pack holds them (int8 codes or the store dtype), then the scales
        self.layout, at = {}, 0
        for p, (dt, shape) in {"k": (tier.code_dtype, (m, d)), "v": (tier.code_dtype, (m, d))}.items():
            self.layout[p], at = (at, dt, shape), at + m * d * isz
        if tier.int8:
            for p in ("ks", "vs"):
                self.layout[p], at = (at, torch.float16, (m,)), at + 2 * m
        self.nbytes = -(-at // 8) * 8
        words = SLOTS * self.nbytes // 8
        self.words = fb.page_locked(words) if self.cuda else torch.empty(words, dtype=torch.int64)
        self.host = self.words.view(torch.uint8).view(SLOTS, -1)
        self.dev = torch.empty(SLOTS, self.nbytes, dtype=torch.uint8, device=device)
        self.ids = fb.page_locked(m) if self.cuda else torch.empty(m, dtype=torch.int64)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:  # written on the side stream: its memory is not reused before the stream's work on it ended
            self.dev.record_stream(self.stream)
        self.copied: list = [None] * SLOTS
        self.used: list = [None] * SLOTS

    def copy_slot(self, s: int) -> None:
        """Slot s's bytes to its device slot, on the current stream: on CUDA one copy per page-locked registration
        the slot's range crosses (fb.pieces), each a direct DMA copy (one copy over the whole slot ran at pageable
        speed on the H200: docs/gpu.md, "The first token")."""
        if not self.cuda:
            self.dev[s].copy_(self.host[s])
            return
        w = self.nbytes // 8
        dev = self.dev.view(-1).view(torch.int64)
        for x, y in fb.pieces(self.words, s * w, (s + 1) * w):
            dev[x:y].copy_(self.words[x:y], non_blocking=True)

    def idle(self) -> bool:
        """No copy from this ring still in flight."""
        return all(e is None or e.query() for e in self.copied)

    def fits(self, m: int, tier: ZoomTier, device) -> bool:
        return m <= self.m and torch.device(device) == self.device

    def parts(self, buf: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
        """A slot's bytes as the parts of its first m rows (views)."""
        out = {}
        for p, (at, dt, shape) in self.layout.items():
            n = shape[-1] if len(shape) > 1 else 1
            isz = torch.empty(0, dtype=dt).element_size()
            out[p] = buf[at : at + m * n * isz].view(dt).view(m, n) if len(shape) > 1 else buf[at : at + m * isz].view(dt)
        return out


class StagedRows:
    """One plan's tier rows for every layer on their way to the device, from the plan on: the tier's thread waits for the
    row ids' copy to the host (an event polled: the question's stream is never synchronised), then for each layer
    in order gathers its rows from the mapped pack into a page-locked slot and copies it to the device slot on a
    side stream; :meth:`layer` (the fill, in layer order) waits for its layer's copy to be queued (a host wait on the
    thread, not a device sync), makes the question's stream wait for the copy, and decodes the rows.  A slot is reused
    SLOTS layers later, after its copy ended (polled) and its rows were decoded (the copy stream waits for that)."""

    def __init__(self, tier: ZoomTier, ring: _Ring, hit: torch.Tensor, row: torch.Tensor, layers: int):
        self.tier, self.ring, self.hit, self.row, self.L = tier, ring, hit, row, layers
        self.m = row.numel()
        self.ready = [threading.Event() for _ in range(layers)]
        self.done = [threading.Event() for _ in range(layers)]  # decoded (or skipped) by the fill
        self.events: list = [None] * layers
        self.staged = [False] * layers  # copied to the device slot (a cancelled staging leaves the rest False)
        self.owner: list = [None] * SLOTS  # the layer each slot holds now
        self.taken = 0  # layers below this were decoded or skipped
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.stats = {"tier_ids_wait_s": 0.0, "tier_gather_s": 0.0, "tier_wait_s": 0.0, "tier_bytes": 0}
        tier.last = self.stats
        ids = ring.ids[: self.m]
        self.t0 = time.perf_counter()
        if ring.cuda:
            ids.copy_(row, non_blocking=True)  # read by the thread once the event says it landed
            self.ids_ready = torch.cuda.Event()
            self.ids_ready.record(torch.cuda.current_stream(row.device))
        else:
            ids.copy_(row)
            self.ids_ready = None
        self._ended = tier.worker().submit(self._run)

    def _poll(self, event) -> bool:
        """Wait for a CUDA event by polling (no sync torch's debug mode would count); False: cancelled."""
        while event is not None and not event.query():
            if self._stop.is_set():
                return False
            time.sleep(0.0002)
        return True

    def _run(self) -> None:
        with torch.inference_mode():
            self._stage()

    def _stage(self) -> None:
        ring, tier = self.ring, self.tier
        try:
            t = time.perf_counter()
            if not self._poll(self.ids_ready):
                return
            self.stats["tier_ids_wait_s"] = time.perf_counter() - t
            idx = ring.ids[: self.m]
            for li in range(self.L):
                if self._stop.is_set():
                    return
                s = li % SLOTS
                if not self._poll(ring.copied[s]):  # the slot's last copy to the device has ended
                    return
                t = time.perf_counter()
                tier._gather(li, idx, out=ring.parts(ring.host[s], self.m))
                self.stats["tier_gather_s"] += time.perf_counter() - t
                if li >= SLOTS:  # the layer that had the slot before: decoded (or skipped)
                    while not self.done[li - SLOTS].wait(0.05):
                        if self._stop.is_set():
                            return
                if self._stop.is_set():  # (cancel() sets every done)
                    return
                if ring.cuda:
                    with torch.cuda.stream(ring.stream):
                        if ring.used[s] is not None:
                            ring.stream.wait_event(ring.used[s])
                        ring.copy_slot(s)
                        ev = torch.cuda.Event()
                        ev.record(ring.stream)
                    ring.copied[s] = self.events[li] = ev
                else:
                    ring.copy_slot(s)
                self.stats["tier_bytes"] += ring.nbytes
                self.owner[s] = li
                self.staged[li] = True
                self.ready[li].set()
        except BaseException as e:  # noqa: BLE001 - raised by layer()
            self.error = e
        finally:
            for r in self.ready:
                r.set()

    def layer(self, layer: int):
        """(hit, K, V) of a layer, as :meth:`ZoomTier.rows` gives them; layers before it not asked for are skipped."""
        if layer < self.taken:  # asked again (its slot may be reused): read it directly
            return self.tier.rows(layer, self.hit, self.row)
        for j in range(self.taken, layer):
            self.done[j].set()
        self.taken = layer + 1
        t = time.perf_counter()
        self.ready[layer].wait()
        self.stats["tier_wait_s"] += time.perf_counter() - t
        if self.error is not None:
            raise self.error
        if not self.staged[layer] or self.owner[layer % SLOTS] != layer:  # the staging ended first (settle): read it directly
            self.done[layer].set()
            return self.tier.rows(layer, self.hit, self.row)
        ring, s = self.ring, layer % SLOTS
        if ring.cuda:
            stream = torch.cuda.current_stream(ring.device)
            stream.wait_event(self.events[layer])
        k, v = self.tier._decode(ring.parts(ring.dev[s], self.m))
        if ring.cuda:
            used = torch.cuda.Event()
            used.record(stream)
            ring.used[s] = used
        self.done[layer].set()
        return self.hit, k, v

    def cancel(self) -> None:
        """End the thread (a new plan replaces this one) and wait for it: the ring is the next plan's."""
        self._stop.set()
        for e in self.done:
            e.set()
        self._ended.wait()


class TierStream(ChunkStream):
    """The zoom tier made while the prefill runs and written into the pack as it goes (sekv_core/chunk_stream.py).
    It covers every document token (``zoom.idx`` = 0..N-1): which tokens the spans take is known only after the
    prefill (the segmentation's statistics are the whole document's), and the rows of the few tokens kept at full
    resolution (sinks, anchors, the recent window) are never read.  Each row is made by the arithmetic of
    :func:`window_tensors` (RoPE's cos / sin of its position made on the host, undone on the device, one scale a
    row), so a span token's row is bit for bit the sequential path's."""

    def __init__(self, kind: str, shape, n_tokens: int, sdt: torch.dtype, pre_rope: bool):
        from . import rope

        super().__init__(shape, n_tokens)
        self.kind, self.sdt = kind, sdt
        self.inv = rope.inv_freq_of(shape) if pre_rope else None
        self.parts = ("k", "ks", "v", "vs") if kind == "int8" else ("k", "v")
        self._cs: dict = {}  # (a, device) -> RoPE's cos / sin of the chunk's positions there

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        hkv, d, out = self.shape.n_kv_heads, self.shape.head_dim, {}
        for li in range(self.shape.n_layers):
            for p in self.parts:
                scale = p.endswith("s")
                dt = torch.float16 if scale else torch.int8 if self.kind == "int8" else self.sdt
                out[f"sekv.zoom.{p}.{li}"] = (dt, (hkv, self.n) if scale else (hkv, self.n, d))
        return out

    def layer_rows(self, li: int, k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> list[tuple[str, torch.Tensor]]:
        from . import rope

        kx = k.float()
        if self.inv is not None:  # as compress's rot: cos / sin on the host, rounded through k's dtype
            key = (a, k.device)
            if key not in self._cs:
                c, s = rope.cos_sin(torch.arange(a, b), self.inv, self.shape.rope_attention_scaling, dtype=k.dtype)
                if k.device.type == "cuda":  # page-locked first: a pageable copy would wait for the prefill's kernels
                    c, s = c.pin_memory(), s.pin_memory()
                self._cs = {key: (c.to(k.device, non_blocking=True), s.to(k.device, non_blocking=True))}
            kx = rope.undo(kx, *self._cs[key])
        out = []
        for name, x in (("k", kx), ("v", v)):
            if self.kind == "exact":
                out.append((f"sekv.zoom.{name}.{li}", x.to(self.sdt)))
            else:
                q, sc = quantize_rows(x)
                out += [(f"sekv.zoom.{name}.{li}", q), (f"sekv.zoom.{name}s.{li}", sc)]
        return out

    def finish_tensors(self) -> dict[str, torch.Tensor]:
        """The covered tokens' index (every document token)."""
        return {"sekv.zoom.idx": torch.arange(self.n, dtype=torch.long)}
