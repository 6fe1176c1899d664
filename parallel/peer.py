"""The device-signalled transport: buffers every rank of a group writes directly, and flags that say what arrived.

The rings of :mod:`.rings` move each chunk with a message (NCCL or gloo ``isend``/``irecv``) and learn on the host
that it arrived, so each chunk costs a GEMM launch of its own. Here the sender writes straight into the receiver's
memory and then raises a flag there; the receiver runs one :func:`~tessel.kernels.gated_matmul.gated_matmul` launch
over every chunk, whose programs wait on the flags on the device. Nothing waits on the host. The reduce-scatter
(:class:`PeerReduceScatter`) is the dual: one GEMM launch whose epilogue stores each chunk's partial straight into
its owner's memory and raises the owner's flag once the chunk is complete, so the partials travel while the next
ones are computed; an all-reduce is the two in turn (:func:`peer_matmul_all_reduce`). ``overlap="peer"`` on
tessel's tensor-parallel ops and layers takes this path.

Memory (:class:`PeerBuffer`): each rank allocates a buffer and ``t + 1`` int32 flags, and maps every peer's.

- GPUs of one node: torch's symmetric memory (``torch.distributed._symmetric_memory``, what torch's own fused
  all-gather GEMM uses): each rank's allocation is mapped into every peer's address space, so a peer's buffer is a
  tensor on this rank's device, and writes to it go over NVLink (or PCIe).
- CPU: files in shared memory (``/dev/shm``), mapped by every rank. The gloo tests run the same protocol with
  real concurrency between processes; x86 keeps a process's stores in order, so a flag is seen after its rows.

Protocol of one all-gather (:class:`PeerAllGather`), the ``e``-th through this transport (``e`` its epoch):

1. Rank ``r`` copies its shard into its own rows of its buffer.
2. For ``j = 1 … t-1`` (``p = r + j``: so rank ``p`` receives from ``p-1``, ``p-2``, …, the ring's order), rank ``r``
   waits until ``p`` has finished reading call ``e-1`` (``p``'s flag ``t`` reaches ``e-1``), writes its shard into
   ``p``'s rows ``r`` and sets ``p``'s flag ``r`` to ``e``. Writes then flag, in one stream's order: the flag is
   seen only after the rows.
3. The consumer's GEMMs wait for flags ``>= e`` (never cleared: a flag from call ``e-1`` is below ``e``), then
   :meth:`PeerAllGather.finish` sets the rank's own flag ``t`` to ``e`` after them, releasing the buffer for the
   next call.

On CUDA step 1 runs on the caller's stream and step 2 on a side stream, ordered after the shard's producer, while
the GEMM runs on the caller's stream: the waits of step 2 are a one-program kernel (on one of the SMs the GEMM
leaves free, its ``reserve_sms``), the rows a copy, the flag a 4-byte copy from a device scalar. Every kernel the
side stream needs has run once when the transport is built (CUDA loads kernels lazily, and loading one may wait
for the running kernels: a spinning GEMM among them).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ..kernels.gated_matmul import gated_matmul_unchecked
from .comm import _account, group_rank, group_size, record_event

__all__ = [
    "PeerAllGather",
    "PeerBuffer",
    "PeerReduceScatter",
    "gather_all",
    "peer_all_gather_matmul",
    "peer_matmul_all_reduce",
    "peer_matmul_reduce_scatter",
    "reduce_transport_for",
    "release_transports",
    "transport_for",
    "wait_at_least",
]

# How often the host looks at a peer's flag that is not there yet (CPU).
_POLL_S = 2e-5


@triton.jit(do_not_specialize=["value"])  # one kernel for every value (see gated_matmul's EPOCH)
def _wait_at_least_kernel(flag_ptr, value):
    while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") < value:
        pass


def wait_at_least(flag: torch.Tensor, value: int) -> None:
    """Wait until the int32 ``flag`` (one element, possibly a peer's) reaches ``value``.

    On CUDA a one-program kernel spins on the current stream, so work enqueued after it waits and the host does
    not; on a CPU the host polls."""
    if flag.is_cuda:
        _wait_at_least_kernel[(1,)](flag, value, num_warps=1)
        return
    while int(flag) < value:
        time.sleep(_POLL_S)


def _shared_file_tensor(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


class PeerBuffer:
    """A ``shape`` buffer and ``t + 1`` int32 flags on every rank of ``group``, each rank able to write all of them.

    Collective: every rank of the group builds it with the same arguments. ``peer(p)`` and ``peer_flags(p)`` are
    rank ``p``'s (``p`` counted in the group), views this rank writes into; ``local`` and ``flags`` are its own.
    Flags start at zero.

    Args:
        shape: the buffer's shape, the same on every rank.
        dtype: its element type.
        group: the ranks; ``None``: the default group (a world of one without one).
        device: ``"cpu"`` or a CUDA device of this node (default: the current CUDA device where the group's
            backend is NCCL, else the CPU).
    """

    def __init__(self, shape, dtype: torch.dtype, group: dist.ProcessGroup | None = None, *, device=None):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"PeerBuffer: dtype must be a torch.dtype, received {type(dtype).__name__}")
        shape = tuple(shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in shape):
            raise ValueError(f"PeerBuffer: shape must be positive ints, received {shape}")
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        self.device = torch.device(device) if device is not None else _default_device(group)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"PeerBuffer: device must be the CPU or a CUDA device, received {self.device}")
        self.shape, self.dtype = shape, dtype
        numel = 1
        for s in shape:
            numel *= s
        if self.device.type == "cuda" and self.size == 1:
            self.local = torch.zeros(shape, dtype=dtype, device=self.device)
            self.flags = torch.zeros(self.size + 1, dtype=torch.int32, device=self.device)
            self._peers, self._peer_flags = [self.local], [self.flags]
        elif self.device.type == "cuda":
            self._peers, self._peer_flags = self._open_symmetric()
            self.local, self.flags = self._peers[self.rank], self._peer_flags[self.rank]
        else:
            self._peers, self._peer_flags = self._open_files(numel)
            self.local, self.flags = self._peers[self.rank], self._peer_flags[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer (this rank's own for ``rank == self.rank``)."""
        return self._peers[rank]

    def peer_flags(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s ``t + 1`` flags."""
        return self._peer_flags[rank]

    def _exchange(self, mine) -> list:
        if self.size == 1:
            return [mine]
        gathered = [None] * self.size
        dist.all_gather_object(gathered, mine, group=self.group)
        return gathered

    def _open_files(self, numel: int):
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        stem = os.path.join(directory, f"tessel-peer-{os.getpid()}-{secrets.token_hex(8)}")
        mine = (f"{stem}-data", f"{stem}-flags")
        for path, nbytes in zip(mine, (numel * _element_size(self.dtype), (self.size + 1) * 4)):
            with open(path, "wb") as f:
                f.truncate(nbytes)  # zero-filled
        try:
            paths = self._exchange(mine)
            peers = [_shared_file_tensor(data, numel, self.dtype).view(self.shape) for data, _ in paths]
            flags = [_shared_file_tensor(f, self.size + 1, torch.int32) for _, f in paths]
            if self.size > 1:
                dist.barrier(group=self.group)  # every rank has mapped every file
        finally:
            for path in mine:  # the mappings keep the memory; nothing is left behind in the file system
                os.unlink(path)
        return peers, flags

    def _open_symmetric(self):
        try:
            import torch.distributed._symmetric_memory as symmetric
        except ImportError as exc:  # a torch built without it
            raise RuntimeError(
                "PeerBuffer: GPU buffers need torch's symmetric memory (torch.distributed._symmetric_memory), which "
                f"this torch {torch.__version__} lacks; use overlap=True (the rings) instead"
            ) from exc

        name = (self.group if self.group is not None else dist.group.WORLD).group_name
        enabled = getattr(symmetric, "is_symm_mem_enabled_for_group", None)
        if enabled is not None and not enabled(name):  # needed by older torch; a deprecated no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symmetric.enable_symm_mem_for_group(name)
        views, self._handles = [], []  # the handles keep the peers' mappings
        for shape, dtype in ((self.shape, self.dtype), ((self.size + 1,), torch.int32)):
            # one-byte floats allocated as bytes, viewed after zeroing (fill kernels of every dtype are not a given)
            storage = torch.uint8 if dtype.itemsize == 1 else dtype
            local = symmetric.empty(shape, dtype=storage, device=self.device).zero_().view(dtype)
            torch.cuda.synchronize(self.device)  # zeroed before any peer can write
            handle = symmetric.rendezvous(local, name)
            self._handles.append(handle)
            views.append([local if p == self.rank else handle.get_buffer(p, shape, dtype) for p in range(self.size)])
        dist.barrier(group=self.group)
        return views[0], views[1]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _default_device(group) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PeerAllGather:
    """All-gather of ``[rows, features]`` shards into every rank's ``[t·rows, features]`` buffer, by writes into the
    peers' memory, each followed by its flag (see the module's protocol). Collective to build, like
    :class:`PeerBuffer`; reused call after call (each call's epoch is one more than the last).

    Use: ``x_full, ready, epoch = transport.start(x_shard)``, then GEMMs that wait on ``ready`` for ``epoch``
    (:func:`peer_all_gather_matmul`), then ``transport.finish()`` after them. ``x_full`` is overwritten by the
    next call: copy what must outlive it.
    """

    _op = "peer_all_gather"  # the name of its events (see record_events)

    def __init__(self, rows: int, features: int, dtype: torch.dtype, group=None, *, device=None):
        self._init_buffers(rows, features, dtype, group, device, (group_size(group) * rows, features))

    def _init_buffers(self, rows, features, dtype, group, device, shape) -> None:
        for name, value in (("rows", rows), ("features", features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive int, received {value!r}")
        self.rows, self.features = rows, features
        self.buffer = PeerBuffer(shape, dtype, group, device=device)
        self.epoch = 0
        self._stream = None
        if self.buffer.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.buffer.device)
            self._epoch_value = torch.zeros(1, dtype=torch.int32, device=self.buffer.device)
            self._load_kernels()

    @property
    def size(self) -> int:
        return self.buffer.size

    @property
    def rank(self) -> int:
        return self.buffer.rank

    def _load_kernels(self) -> None:
        """Every kernel the side stream launches, run once before any GEMM spins (see the module's notes)."""
        with torch.cuda.device(self.buffer.device), torch.cuda.stream(self._stream):
            self._epoch_value.fill_(0)
            wait_at_least(self.buffer.flags[self.size :], 0)
            self.buffer.flags[self.size :].copy_(self._epoch_value)
            self.buffer.local[:1].copy_(self.buffer.local[-1:])
        self._stream.synchronize()

    def _check(self, x_shard) -> None:
        if not isinstance(x_shard, torch.Tensor):
            raise TypeError(f"PeerAllGather: x_shard must be a torch.Tensor, received {type(x_shard).__name__}")
        want = ((self.rows, self.features), self.buffer.dtype, self.buffer.device)
        got = (tuple(x_shard.shape), x_shard.dtype, x_shard.device)
        if got != want:
            raise ValueError(
                f"PeerAllGather: x_shard must be {want[0]} {want[1]} on {want[2]} (as the transport was built), "
                f"received {got[0]} {got[1]} on {got[2]}"
            )

    def start(self, x_shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Send ``x_shard`` to every peer and return ``(x_full, ready, epoch)``: this rank's gathered buffer, whose
        rows ``[c·rows, (c+1)·rows)`` hold rank ``c``'s shard once ``ready[c] >= epoch`` (this rank's own rows at
        once, in the caller's stream order)."""
        self._check(x_shard)
        epoch, t, r, m = self.next_epoch(), self.size, self.rank, self.rows
        self.buffer.local[r * m : (r + 1) * m].copy_(x_shard)
        record_event("send", self._op, epoch)
        if self._stream is None:
            for j in range(1, t):
                self._write((r + j) % t, x_shard, epoch)
        else:
            with torch.cuda.stream(self._stream):  # (ordered after the shard's producer by next_epoch)
                self._epoch_value.fill_(epoch)
                for j in range(1, t):
                    self._write((r + j) % t, x_shard, epoch)
            x_shard.record_stream(self._stream)
        sent = (t - 1) * x_shard.numel() * x_shard.element_size()
        _account(sent, sent)
        return self.buffer.local, self.buffer.flags[:t], epoch

    def next_epoch(self) -> int:
        """The next call's epoch (one more than the last). On CUDA the side stream is ordered here after the caller's
        work so far (the call's input is written), before the call's GEMM is enqueued: the side stream then follows
        the GEMM chunk by chunk through its flags, never waiting for all of it."""
        if self.epoch + 1 >= 2**31:
            raise RuntimeError(f"{type(self).__name__}: the int32 epoch counter is exhausted; build a new transport")
        if self._stream is not None and torch.cuda.is_current_stream_capturing():
            # a replay would wait for the captured epoch, which the flags already hold: stale rows, silently
            raise RuntimeError(
                f"{type(self).__name__}: overlap='peer' cannot be captured in a CUDA graph (each call's epoch is "
                "counted on the host); capture the rings (overlap=True) instead"
            )
        self.epoch += 1
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.buffer.device))
        return self.epoch

    def _write(self, p: int, rows: torch.Tensor, epoch: int) -> None:
        """Once rank ``p`` has finished the previous call, write ``rows`` into its slot for this rank (its buffer
        seen as ``[t, rows, features]``), then raise its flag for this rank to ``epoch``."""
        flags = self.buffer.peer_flags(p)
        wait_at_least(flags[self.size :], epoch - 1)  # p has read the previous call's slot
        self.buffer.peer(p).view(self.size, self.rows, self.features)[self.rank].copy_(rows, non_blocking=True)
        if self._stream is None:
            flags[self.rank] = epoch  # after the rows: this process's stores land in order
        else:
            flags[self.rank : self.rank + 1].copy_(self._epoch_value, non_blocking=True)

    def finish(self) -> None:
        """After the work that read this call's buffer (in the caller's stream order): release it to the peers' next
        call."""
        if self._stream is None:
            self.buffer.flags[self.size] = self.epoch
        else:
            self.buffer.flags[self.size :].fill_(self.epoch)


class PeerReduceScatter(PeerAllGather):
    """Reduce-scatter of each rank's partial ``[t·rows, features]`` into every rank's ``[rows, features]`` share of
    their sum, by a GEMM whose epilogue stores each chunk's partial straight into its owner's memory (collective to
    build, reused call after call, as :class:`PeerAllGather`).

    Protocol of call ``e`` on rank ``r`` (:func:`peer_matmul_reduce_scatter`):

    1. One GEMM launch computes this rank's partial of every chunk, chunk ``r+1`` first and its own chunk ``r``
       last. Chunk ``c``'s rows are stored into rank ``c``'s slot ``r`` once ``c`` has finished call ``e-1`` (``c``'s
       flag ``t`` reaches ``e-1``), and ``c``'s flag ``r`` is raised to ``e`` once they are all stored (release at
       system scope: :func:`~tessel.kernels.gated_matmul.gated_matmul` with a destination, a ``done`` and a
       ``free`` flag per chunk). No partial is written locally first and copied after: the epilogue's stores are
       the transfer.
    2. Once every peer's flag is up, the rank's share is the ``t`` slots summed in fp32 (the bias added once), and
       :meth:`finish` releases the slots to the peers' next call.
    """

    _op = "peer_reduce_scatter"

    def __init__(self, rows: int, features: int, dtype: torch.dtype, group=None, *, device=None):
        self._init_buffers(rows, features, dtype, group, device, (group_size(group), rows, features))
        t, r = self.size, self.rank
        # chunk c's destination and flags: rank c's slot and flag for this rank, and rank c's own flag t
        self.destinations = [self.buffer.peer(c)[r] for c in range(t)]
        self.signals = [self.buffer.peer_flags(c)[r : r + 1] for c in range(t)]
        self.frees = [self.buffer.peer_flags(c)[t:] for c in range(t)]

    def reduce(self, epoch: int, bias=None) -> torch.Tensor:
        """Step 2: this rank's ``[rows, features]`` share of the sum (in the caller's stream order)."""
        t, r = self.size, self.rank
        for s in range(t):
            if s != r:
                wait_at_least(self.buffer.flags[s : s + 1], epoch)
        record_event("wait", self._op, epoch)
        total = self.buffer.local[r].to(torch.float32, copy=True)  # never a view of the buffer
        for s in range(t):
            if s != r:
                total += self.buffer.local[s]
        if bias is not None:
            total += bias
        return total.to(self.buffer.dtype)


# One transport per (kind, group, shape, dtype, device), built at the first call that needs it: collectively, since
# the ranks of a tensor-parallel group make the same calls in the same order.
_transports: dict[tuple, tuple[object, PeerAllGather]] = {}


def _cached(kind: type, group, rows: int, features: int, dtype: torch.dtype, device: torch.device):
    owner = group if group is not None else dist.group.WORLD
    key = (kind, id(owner), rows, features, dtype, device)
    entry = _transports.get(key)
    if entry is None or entry[0] is not owner:  # (an id can be reused once a group is gone)
        entry = _transports[key] = (owner, kind(rows, features, dtype, group, device=device))
    return entry[1]


def release_transports() -> int:
    """Drop the transports this process built for ``overlap="peer"`` (:func:`transport_for`,
    :func:`reduce_transport_for`) and return how many; their buffers are freed once nothing else holds them, and the
    next call that needs one builds it again. One transport is built per shape, so a run that changes shapes (another
    batch or sequence length for evaluation) holds one set of buffers per shape until it releases them.

    Collective: every rank calls it at the same point, with no call through a transport in flight. It waits for the
    device's work and for every rank of each transport's group (a rank's last writes into a peer may still be in
    flight when its own call has returned), then drops them."""
    if any(transport.buffer.device.type == "cuda" for _, transport in _transports.values()):
        torch.cuda.synchronize()
    for owner in {id(owner): owner for owner, _ in _transports.values()}.values():
        dist.barrier(group=owner)
    count = len(_transports)
    _transports.clear()
    return count


def transport_for(group, x_shard: torch.Tensor) -> PeerAllGather:
    """The process's :class:`PeerAllGather` for ``x_shard``'s shape, dtype and device over ``group`` (built at the
    first call: a collective)."""
    return _cached(PeerAllGather, group, *x_shard.shape, x_shard.dtype, x_shard.device)


def reduce_transport_for(group, rows: int, features: int, like: torch.Tensor) -> PeerReduceScatter:
    """The process's :class:`PeerReduceScatter` for ``[rows, features]`` shares of ``like``'s dtype and device."""
    return _cached(PeerReduceScatter, group, rows, features, like.dtype, like.device)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_scaled(op: str, x_name: str, x, weights, scales, biases, out_dtype) -> None:
    """The operands of an fp8 call (``scales`` given): fp8 ``x`` and weights sharing its features, one pair of
    one-element fp32 inverse scales per weight, and biases of the output's dtype."""
    named = [(x_name, x)] + [("weight" if len(weights) == 1 else f"weights[{i}]", w) for i, w in enumerate(weights)]
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _FP8 or t.device != x.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a 2-D float8 (e4m3fn or e5m2) tensor on {x_name}'s device, "
                             f"received {got}")  # fmt: skip
        if name != x_name and t.shape[1] != x.shape[1]:
            raise ValueError(f"{op}: {name} must be [out_features, {x.shape[1]}], received {tuple(t.shape)}")
    if len(scales) != len(weights) or any(len(pair) != 2 for pair in scales):
        raise ValueError(f"{op}: scales must hold one (x, weight) pair of inverse scales per weight, received "
                         f"{len(scales)} for {len(weights)} weights")  # fmt: skip
    for scale in (s for pair in scales for s in pair):
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"{op}: every inverse scale must be a one-element float32 tensor, received {scale!r}")
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: out_dtype must be float32, float16 or bfloat16, received {out_dtype}")
    for w, b in zip(weights, biases or [None] * len(weights)):
        if b is not None and (tuple(b.shape) != (w.shape[0],) or b.dtype != out_dtype or b.device != x.device):
            raise ValueError(f"{op}: a bias must be a ({w.shape[0]},) {out_dtype} tensor on {x.device}, received "
                             f"{tuple(b.shape)} {b.dtype} on {b.device}")  # fmt: skip


def peer_matmul_reduce_scatter(x, weight, transport: PeerReduceScatter, *, bias=None, reserve_sms=2, between=None,
                               scales=None, split_accumulator=False):  # fmt: skip
    """``RS(x @ Wᵀ) + bias`` through ``transport``: one GEMM launch over every chunk of ``x``'s rows whose epilogue
    stores each chunk's partial into its owner's memory and raises the owner's flag once the chunk is complete, and
    this rank's share summed once every peer's partial has arrived. No autograd (a forward building block).

    Args:
        x: ``[t·rows, K]``: every token, this rank's input features.
        weight: ``[features, K]`` (nn.Linear's layout), x's dtype and device.
        transport: a :class:`PeerReduceScatter` over the tensor-parallel group.
        bias: ``None`` or the whole ``[features]`` bias, added once.
        reserve_sms: SMs the GEMM leaves free for other streams' work (see gated_matmul).
        between: ``None``, or a function called once the GEMM (and with it the partials' transfers) is enqueued and
            before the sum waits for the peers' partials: work placed there (a backward's weight gradient) hides
            the transfers.
        scales: ``None``, or fp8 operands: ``x`` and ``weight`` float8 (e4m3fn/e5m2) and ``(x_scale_inv,
            weight_scale_inv)`` their inverse scales (one-element fp32), the partials and the result in the
            transport's dtype; ``split_accumulator`` as for :func:`~tessel.kernels.fp8.fp8_matmul`.

    Returns:
        This rank's ``[rows, features]`` rows of the sum over ranks.
    """
    from .overlap import check_operands

    if scales is None:
        check_operands("peer_matmul_reduce_scatter", "x", x, [weight], [bias])
    elif isinstance(transport, PeerReduceScatter):
        _check_scaled("peer_matmul_reduce_scatter", "x", x, [weight], [scales], [bias], transport.buffer.dtype)
    if not isinstance(transport, PeerReduceScatter):
        raise TypeError(
            f"peer_matmul_reduce_scatter: transport must be a PeerReduceScatter, received {type(transport).__name__}"
        )
    t, r = transport.size, transport.rank
    want = (t * transport.rows, transport.features, transport.buffer.dtype, transport.buffer.device)
    got = (x.shape[0], weight.shape[0], x.dtype if scales is None else transport.buffer.dtype, x.device)
    if got != want:
        raise ValueError(
            f"peer_matmul_reduce_scatter: x's rows, the weight's output features, the dtype and the device must be "
            f"{want} (as the transport was built), received {got}"
        )
    epoch = transport.next_epoch()
    record_event("gemm", transport._op, epoch)
    gated_matmul_unchecked(
        x, weight.t(), None, t, (r + 1) % t, 1, transport.destinations, None, None, False, reserve_sms, epoch,
        transport.signals, transport.frees, scales, split_accumulator,
    )  # fmt: skip
    record_event("send", transport._op, epoch)  # (the GEMM's stores into the peers' slots)
    sent = (t - 1) * transport.rows * transport.features * transport.buffer.local.element_size()
    _account(sent, sent)
    if between is not None:
        between()
    out = transport.reduce(epoch, bias)
    transport.finish()
    return out


def peer_all_gather_matmul(x_shard, weights, transport: PeerAllGather, *, biases=None, reserve_sms=2, keep_input=False,
                           scales=None, out_dtype=None, split_accumulator=False):  # fmt: skip
    """``[AG(x_shard) @ W_iᵀ + b_i for each W_i]`` through ``transport``: the gather's writes into the peers' memory,
    and one :func:`~tessel.kernels.gated_matmul.gated_matmul` launch per weight over every chunk, each chunk's tiles
    waiting on the device for its flag. No autograd (a forward building block, as for inference and the
    benchmarks).

    Args:
        x_shard: ``[rows, K]``, this rank's rows, as ``transport`` was built.
        weights: a ``[N_i, K]`` weight or a list of them (nn.Linear's layout), x_shard's dtype and device.
        transport: a :class:`PeerAllGather` over the tensor-parallel group.
        biases: ``None`` or one (optional) ``[N_i]`` bias per weight.
        reserve_sms: SMs the GEMMs leave to the transport's side stream (see gated_matmul).
        keep_input: also return a copy of the gathered input, taken after the GEMMs and before the buffer is
            released to the peers (who may write their next call's shards into it at once).
        scales: ``None``, or fp8 operands: ``x_shard`` and the weights float8 (e4m3fn/e5m2; the shards of one
            tensor, sharing one scale) and one ``(x_scale_inv, weight_scale_inv)`` pair per weight, the outputs
            in ``out_dtype``; ``split_accumulator`` as for :func:`~tessel.kernels.fp8.fp8_matmul`.

    Returns:
        One ``[t·rows, N_i]`` output per weight (a list, even for one weight); with ``keep_input``,
        ``(outputs, x_full)``.
    """
    from .overlap import check_operands

    weights = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if scales is None:
        check_operands("peer_all_gather_matmul", "x_shard", x_shard, weights, biases)
        out_dtype = x_shard.dtype
    else:
        _check_scaled("peer_all_gather_matmul", "x_shard", x_shard, weights, scales, biases, out_dtype)
    if not isinstance(transport, PeerAllGather):
        raise TypeError(
            f"peer_all_gather_matmul: transport must be a PeerAllGather, received {type(transport).__name__}"
        )
    biases = biases if biases is not None else [None] * len(weights)
    x_full, ready, epoch = transport.start(x_shard)
    t, r = transport.size, transport.rank
    outs = []
    for i, (w, b) in enumerate(zip(weights, biases)):
        out = x_full.new_empty((x_full.shape[0], w.shape[0]), dtype=out_dtype)
        record_event("gemm", "peer_all_gather", i)
        pair = None if scales is None else scales[i]
        gated_matmul_unchecked(x_full, w.t(), ready, t, r, max(1, t - 1), out, b, None, False, reserve_sms, epoch,
                               scales=pair, split_accumulator=split_accumulator)  # fmt: skip
        outs.append(out)
    record_event("wait", transport._op, epoch)  # (the GEMMs waited for every chunk)
    kept = x_full.clone() if keep_input else None
    transport.finish()
    return (outs, kept) if keep_input else outs


def gather_all(x_shard: torch.Tensor, transport: PeerAllGather) -> torch.Tensor:
    """``AG(x_shard)`` through ``transport`` into a new ``[t·rows, features]`` tensor: the shards written into the
    peers' memory, then (on the caller's stream) a wait for every peer's flag and one copy out of the buffer."""
    x_full, ready, epoch = transport.start(x_shard)
    for s in range(transport.size):
        if s != transport.rank:
            wait_at_least(ready[s : s + 1], epoch)
    record_event("wait", transport._op, epoch)
    out = x_full.clone()
    transport.finish()
    return out


def peer_matmul_all_reduce(x, weight, group=None, *, bias=None, between=None, scales=None, out_dtype=None,
                           split_accumulator=False):  # fmt: skip
    """``AR(x @ Wᵀ) + bias`` through the device-signalled transports: :func:`peer_matmul_reduce_scatter` (``between``,
    ``scales`` and ``split_accumulator`` as there; fp8 operands give ``out_dtype``), then :func:`gather_all` of the
    summed rows. ``x``'s rows must split evenly over the group. The transports are the process's own for these
    shapes (:func:`reduce_transport_for`, :func:`transport_for`)."""
    t = group_size(group)
    rows = x.shape[0] // t
    like = x if scales is None else x.new_empty(0, dtype=out_dtype)
    reduce = reduce_transport_for(group, rows, weight.shape[0], like)
    shard = peer_matmul_reduce_scatter(x, weight, reduce, bias=bias, between=between, scales=scales,
                                       split_accumulator=split_accumulator)  # fmt: skip
    return gather_all(shard, transport_for(group, shard))
