"""The one collective helper of dataflow: the core, ``training`` and ``eval`` run theirs here.

A process group exists only where torch was imported, so nothing here imports
torch unless one does. Every collective runs on the device its group's backend
communicates from (CUDA under NCCL: a CPU tensor there fails), and a rank that
failed joins it anyway: a failure on one rank becomes an error on every rank
(:class:`~dataflow.PeerFailedError` on the others, or the type a caller asks
for) instead of a peer left waiting until the group's timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dataflow.model._errors import InvalidArgumentError, PeerFailedError

if TYPE_CHECKING:
    import torch

#: Backends that communicate from an accelerator, and the device type they use.
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}
#: Bytes of each rank's slot in a meeting's first all_gather: a message that fits (the
#: common case: a flag, a path, a few digests) needs no second collective.
_SLOT = 4096
_LENGTH = 8  # the slot's first bytes: the length of the whole message


def group_active(world_size: int) -> bool:
    """Whether ``world_size`` ranks share an initialized default process group."""
    torch = sys.modules.get("torch")
    return (
        world_size > 1
        and torch is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def communication_device(backend: str) -> torch.device:
    """The device type collectives of a group with ``backend`` run on.

    ``gloo`` (and any other host backend) communicates from the CPU, ``nccl`` from CUDA;
    for a per-device backend such as ``"cpu:gloo,cuda:nccl"`` the accelerator wins.
    Derived from the backend alone, so every rank of a group picks the same device.
    """
    import torch

    for part in str(backend).lower().split(","):
        device, _, name = part.strip().rpartition(":")
        if device and device != "cpu":
            return torch.device(device)
        if not device and name in _ACCELERATOR_BACKENDS:
            return torch.device(_ACCELERATOR_BACKENDS[name])
    return torch.device("cpu")


def flag_device(group: Any = None) -> torch.device:
    """The device ``group`` (the default one: None) communicates from: this process's
    current accelerator under an accelerator's backend (``"nccl"``, ``"cpu:gloo,cuda:nccl"``),
    else the CPU. Derived from the backend, so every rank of a group picks alike."""
    import torch

    device = communication_device(torch.distributed.get_backend(group))
    if device.type == "cpu":
        return device
    return torch.device(device.type, getattr(torch, device.type).current_device())


@contextlib.contextmanager
def _meeting(what: str) -> Iterator[None]:
    """Turn the backend's failure of a collective (a peer that died, or whose link is cut
    past the group's timeout) into :class:`PeerFailedError` saying so and what to do."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistBackendError and DistError are RuntimeErrors
        raise PeerFailedError(
            f"{what}: the ranks could not meet ({_described(exc)}): a peer process died, "
            "or the link to it is cut for longer than the process group's timeout "
            "(init_process_group(timeout=...), the timeout_s of join_gloo); stop every "
            "rank, restart them all and resume from the ledger"
        ) from exc


def broadcast_int(value: int) -> int:
    """Rank 0's ``value``, on every rank of the default group."""
    import torch

    tensor = torch.tensor([value], dtype=torch.int64, device=flag_device())
    with _meeting("broadcast_int"):
        torch.distributed.broadcast(tensor, src=0)
    return int(tensor.item())


def reduce_max(values: list[int], group: Any = None) -> list[int]:
    """The element-wise maximum of every rank's ``values`` (the same length on every
    rank), in one all_reduce: "does any rank still have ...", "the most any has"."""
    import torch

    tensor = torch.tensor(values, dtype=torch.int64, device=flag_device(group))
    with _meeting("reduce_max"):
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]


def exchange(text: str, group: Any = None) -> list[str]:
    """Every rank's ``text``, in rank order: UTF-8 bytes, no pickle.

    One all_gather of a fixed slot per rank; a second one, of the longest text, only
    when some rank's text does not fit its slot.
    """
    with _meeting("exchange"):
        return _exchange(text, group)


def _exchange(text: str, group: Any) -> list[str]:
    import torch

    dist = torch.distributed
    device = flag_device(group)
    data = text.encode()
    slot = torch.zeros(_SLOT, dtype=torch.uint8)
    slot[:_LENGTH] = torch.tensor(list(len(data).to_bytes(_LENGTH, "little")), dtype=torch.uint8)
    head = data[: _SLOT - _LENGTH]
    if head:
        slot[_LENGTH : _LENGTH + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    slots = [torch.zeros(_SLOT, dtype=torch.uint8, device=device) for _ in range(_size(group))]
    dist.all_gather(slots, slot.to(device), group=group)
    gathered = torch.stack(slots).cpu()
    lengths = [int.from_bytes(bytes(g[:_LENGTH].tolist()), "little") for g in gathered]
    if max(lengths) <= _SLOT - _LENGTH:
        texts = (g[_LENGTH : _LENGTH + n] for g, n in zip(gathered, lengths, strict=True))
        return [bytes(t.tolist()).decode() for t in texts]
    # Some text is longer than its slot: every rank knows the longest, so all send it whole.
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    whole = [torch.zeros_like(padded, device=device) for _ in lengths]
    dist.all_gather(whole, padded.to(device), group=group)
    return [bytes(w[:n].cpu().tolist()).decode() for w, n in zip(whole, lengths, strict=True)]


def _size(group: Any) -> int:
    import torch

    return torch.distributed.get_world_size(group)


def _described(error: BaseException | None) -> str | None:
    """``error`` as its peers read it; never raises (its ``__str__`` is user code)."""
    if error is None:
        return None
    try:
        message = str(error)
    except Exception as exc:
        message = f"(its message could not be made: {type(exc).__name__})"
    return f"{type(error).__name__}: {message}"


def agree(
    error: BaseException | None,
    payload: Any = None,
    *,
    what: str,
    group: Any = None,
    peer_error: type[Exception] = PeerFailedError,
) -> list[Any]:
    """Meet every rank of ``group`` (the default one: None); raise on each if any rank
    passed an error; else return every rank's ``payload`` (JSON), in rank order.

    The rank that failed raises its own ``error``; the others raise ``peer_error``
    (:class:`PeerFailedError` unless the caller asks for its own type, e.g.
    ``training.CheckpointError``) naming the ranks that failed and the first one's
    error. A payload JSON cannot carry fails its rank with a ``peer_error`` saying so,
    raised after the meeting, so no peer is left in it. With no error anywhere it
    returns once every rank got here, as a barrier would: one all_gather when every
    rank's message fits its slot (see :func:`exchange`).
    """
    import torch

    rank = torch.distributed.get_rank(group)
    described = _described(error)
    try:
        text = json.dumps({"error": described, "payload": payload})
    except Exception as exc:  # before the collective: the peers wait in it
        if error is None:
            error = peer_error(
                f"{what}: rank {rank}'s payload cannot be sent to the other ranks as JSON "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            )
            described = _described(error)
        text = json.dumps({"error": described, "payload": None})
    with _meeting(what):
        replies = [json.loads(r) for r in _exchange(text, group)]
    if error is not None:
        raise error
    failed = [(r, m["error"]) for r, m in enumerate(replies) if m["error"] is not None]
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        raise peer_error(f"{what} failed on rank {ranks} (this is rank {rank}): {failed[0][1]}")
    return [m["payload"] for m in replies]


def join_loopback_gloo(rank: int, world_size: int, port: int, *, timeout_s: float) -> None:
    """Join a gloo group whose rank 0 listens on 127.0.0.1:``port``, on loopback only: the
    processes of one machine (the demo's ranks, the benchmarks', the tests')."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    join_gloo(rank, world_size, "127.0.0.1", port, timeout_s=timeout_s)


def join_gloo(
    rank: int,
    world_size: int,
    address: str,
    port: int,
    *,
    timeout_s: float,
    interface: str | None = None,
    join_timeout_s: float = 120.0,
) -> None:
    """Join a gloo group whose rank 0 listens on ``address``:``port`` (rank 0's own
    address, reachable from every rank's machine).

    ``timeout_s`` bounds every collective: a peer that died, or whose link is cut
    without a word, fails each rank's next collective after that long (with
    :class:`PeerFailedError` from this module's collectives). ``join_timeout_s`` bounds
    the wait for every rank to join (processes that start seconds apart), apart from
    it, so that a short collective timeout does not fail a slow start. ``interface``:
    the network interface gloo's connections use on this machine
    (``GLOO_SOCKET_IFNAME``), e.g. ``"eth0"``; None leaves the environment's, or gloo's
    choice from the host name.
    """
    from datetime import timedelta

    import torch.distributed as dist

    for name, value in (("timeout_s", timeout_s), ("join_timeout_s", join_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise InvalidArgumentError(
                f"{name} must be a positive number of seconds, got {value!r}"
            )
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    store = dist.TCPStore(
        address, port, world_size, rank == 0, timeout=timedelta(seconds=join_timeout_s)
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
