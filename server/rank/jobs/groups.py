"""The process groups a rank's collective jobs run on: one per (epoch, participants), over the coordinator's store.

There is no torch.distributed world. The coordinator hosts a TCPStore and
numbers epochs; every collective job carries (epoch, ranks). The first job of
an epoch over a participant set forms its group on every participant, as
torchft does: a PrefixStore `epoch/E/r0,r1,...` (shardcore/epochs.py) over a
client of the coordinator's store, and a ProcessGroup built directly with a
ProcessGroupGloo backend for CPU tensors (and ProcessGroupNCCL for CUDA ones),
this rank's index in the sorted participants as its group rank. Later jobs of
the same epoch and participants reuse it; ranks outside a job never join its
group. Job code talks to the group through `PeerGroup` (the group object's own
send / recv / barrier, since c10d's default world does not know it).

A job that fails ends its epoch here (`end_epoch`) as on the coordinator:
its groups are dropped (NCCL communicators aborted) and a later job of that
epoch is refused. Operations still posted on a dropped gloo group end on the
group's own timeout, which is the timeout of the job that formed it.

DCP (checkpoint jobs) needs a group registered with c10d, which a directly
built one is not: `default_world` makes the job's participants the default
c10d world for that one job (init_process_group over its own PrefixStore,
destroyed when the job ends). Jobs run one at a time on a rank, so one default
world at a time is enough.
"""

from __future__ import annotations

import enum
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.core.epochs import group_prefix, group_rank, participants_of
from shardserve.server.rank.errors import EpochEnded, RankUnavailable

log = logging.getLogger(__name__)

GLOO_IFNAME_ENV = (
    "GLOO_SOCKET_IFNAME"  # torch's own switch: the interface(s) gloo binds and advertises
)
_SIOCGIFADDR = 0x8915


class Verb(enum.Enum):
    """Which way a point-to-point operation moves its tensor."""

    SEND = "send to"
    RECEIVE = "receive from"


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation of a job: send or receive `tensor` with `peer` (its global rank)."""

    verb: Verb
    tensor: torch.Tensor
    peer: int


def process_group_backend() -> str:
    """The backend string for a default c10d world: gloo for CPU shards, NCCL for CUDA ones."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


class PeerGroup:
    """Point-to-point operations and a barrier over one process group whose members are `ranks` (global
    rank numbers, sorted: a member's index is its rank in the group)."""

    def __init__(
        self, pg: dist.ProcessGroup, ranks: Sequence[int], *, registered: bool = False
    ) -> None:
        self.pg = pg
        self.ranks = participants_of(ranks)
        self.registered = (
            registered  # known to c10d (the default world): CUDA batches go through it
        )

    @classmethod
    def world(cls) -> PeerGroup:
        """The default c10d world (in-process tools and tests that called init_process_group)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized")
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("torch.distributed has no default group")
        return cls(world, range(dist.get_world_size()), registered=True)

    def index(self, rank: int) -> int:
        """`rank`'s rank inside the group."""
        return group_rank(self.ranks, rank)

    def post(self, ops: Sequence[P2P], tag: int) -> list[dist.Work]:
        """Post sends and receives with `tag`, one Work per op; CUDA ops of one call go in one NCCL group."""
        if not ops:
            return []
        device = ops[0].tensor.device
        if device.type != "cuda":
            return [self._one(op, tag) for op in ops]
        if self.registered:
            p2p = [
                dist.P2POp(
                    dist.isend if op.verb is Verb.SEND else dist.irecv,
                    op.tensor,
                    op.peer,
                    None,
                    tag,
                )
                for op in ops
            ]
            return dist.batch_isend_irecv(p2p)
        # separate NCCL sends and receives between the same ranks could deadlock: coalesce them
        self.pg._start_coalescing(device)
        for op in ops:
            self._one(op, tag)
        work = self.pg._end_coalescing(device)
        return [work] * len(ops)

    def _one(self, op: P2P, tag: int) -> dist.Work:
        """One send or receive on the group itself, the peer named by its index in the group."""
        if op.verb is Verb.SEND:
            return self.pg.send([op.tensor], self.index(op.peer), tag)
        return self.pg.recv([op.tensor], self.index(op.peer), tag)

    def barrier(self, timeout_s: float) -> None:
        """Every member reached this point, or TimeoutError / RuntimeError within `timeout_s`."""
        work = self.pg.barrier()
        if not work.wait(timedelta(seconds=timeout_s)):
            raise TimeoutError(
                f"barrier of ranks {list(self.ranks)} did not complete within {timeout_s:.1f}s"
            )

    def abort(self) -> None:
        """Give the group up: NCCL communicators are aborted; gloo operations end on their own timeout."""
        try:
            self.pg.abort()
        except RuntimeError as err:  # a backend without abort (gloo in some builds)
            log.debug("abort of group %s: %s", list(self.ranks), err)


def build_group(
    store: dist.Store,
    epoch: int,
    ranks: Sequence[int],
    rank: int,
    device: torch.device,
    timeout_s: float,
) -> dist.ProcessGroup:
    """The ProcessGroup of `ranks` in `epoch`, built directly over `store` (blocks until every member joins)."""
    members = participants_of(ranks)
    index, size = group_rank(members, rank), len(members)
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(group_prefix(epoch, members), store)
    pg = dist.ProcessGroup(prefixed, index, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", prefixed), index, size, timeout)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", prefixed), index, size, options)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    return pg


class ProcessGroups:
    """This rank's groups, cached per (epoch, participants), and the coordinator's store they form over."""

    def __init__(
        self, rank: int, device: torch.device | str = "cpu", store_timeout_s: float = 120.0
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.store_timeout_s = store_timeout_s
        self._address: tuple[str, int] | None = None
        self._groups: dict[tuple[int, tuple[int, ...]], PeerGroup] = {}
        self._ended: set[int] = set()  # epochs a job of which failed here
        self._lock = threading.Lock()

    def set_store(self, host: str, port: int) -> None:
        """The coordinator's store (from RegisterRank); a new address drops every group formed over the old."""
        with self._lock:
            if self._address == (host, port):
                return
            self._address = (host, port)
            dropped, self._groups = list(self._groups.values()), {}
        log.info("rank %d: rendezvous store at %s:%d", self.rank, host, port)
        choose_gloo_interface(host, port)
        for group in dropped:
            group.abort()

    def for_job(self, epoch: int, ranks: Sequence[int], timeout_s: float) -> PeerGroup:
        """The group of `ranks` in `epoch`, formed now (with every other member) unless cached."""
        members = participants_of(ranks)
        with self._lock:
            self._check_epoch(epoch)
            dropped = self._drop_before(epoch)
            cached = self._groups.get((epoch, members))
        for old in dropped:
            old.abort()
        if cached is not None:
            return cached
        pg = build_group(self._client(timeout_s), epoch, members, self.rank, self.device, timeout_s)
        group = PeerGroup(pg, members)
        with self._lock:
            self._check_epoch(epoch)  # it may have ended while the group formed
            self._groups[(epoch, members)] = group
        log.info(
            "rank %d formed the group of ranks %s in epoch %d", self.rank, list(members), epoch
        )
        return group

    def end_epoch(self, epoch: int) -> None:
        """A job of `epoch` failed: drop its groups and refuse its later jobs."""
        with self._lock:
            self._ended.add(epoch)
            dropped = [self._groups.pop(key) for key in [k for k in self._groups if k[0] == epoch]]
        for group in dropped:
            group.abort()

    def cached(self) -> list[tuple[int, tuple[int, ...]]]:
        """(epoch, participants) of the groups held now."""
        with self._lock:
            return sorted(self._groups)

    @contextmanager
    def default_world(
        self, epoch: int, ranks: Sequence[int], seq: int, timeout_s: float
    ) -> Iterator[dist.ProcessGroup]:
        """The participants of job `seq` as c10d's default world while the block runs (for DCP); the block gets
        its group, to name explicitly: an abandoned job must never run collectives on a later job's world."""
        members = participants_of(ranks)
        with self._lock:
            self._check_epoch(epoch)
        if dist.is_initialized():  # left by an abandoned job
            dist.destroy_process_group()
        store = dist.PrefixStore(
            f"{group_prefix(epoch, members)}/world/{seq}", self._client(timeout_s)
        )
        dist.init_process_group(
            backend=process_group_backend(),
            store=store,
            rank=group_rank(members, self.rank),
            world_size=len(members),
            timeout=timedelta(seconds=timeout_s),
        )
        mine = dist.group.WORLD
        if mine is None:
            raise RuntimeError("torch.distributed has no default group")
        try:
            yield mine
        finally:
            if (
                dist.is_initialized() and dist.group.WORLD is mine
            ):  # not a later job's, if this one was abandoned
                dist.destroy_process_group()

    def _client(self, timeout_s: float) -> dist.Store:
        """A new client of the coordinator's store whose waits are bounded by `timeout_s`."""
        with self._lock:
            address = self._address
        if address is None:
            raise RankUnavailable(
                f"rank {self.rank} knows no rendezvous store yet (it has not registered "
                f"with the coordinator)"
            )
        timeout = timedelta(seconds=min(timeout_s, self.store_timeout_s))
        return dist.TCPStore(
            address[0], address[1], is_master=False, timeout=timeout, wait_for_workers=False
        )

    def _check_epoch(self, epoch: int) -> None:
        """EpochEnded for an epoch that has ended here (lock held)."""
        if epoch in self._ended:
            raise EpochEnded(
                f"epoch {epoch} has ended on rank {self.rank} (a job of it failed); the "
                f"coordinator runs later jobs in a new epoch"
            )

    def _drop_before(self, epoch: int) -> list[PeerGroup]:
        """Forget the groups of epochs before `epoch` (lock held): a job of a newer epoch means they ended."""
        old = [key for key in self._groups if key[0] < epoch]
        return [self._groups.pop(key) for key in old]


def choose_gloo_interface(host: str, port: int) -> None:
    """Make gloo bind the interface this rank reaches the coordinator's store by, unless GLOO_SOCKET_IFNAME says.

    Without it gloo binds and advertises the address this host's name resolves to, which on many hosts is
    127.0.0.1 (/etc/hosts): a peer on another host is then told to connect to its own loopback and every job
    between hosts fails ("connectFullMesh failed ... Connection refused"). The store's route is one every
    rank of the cluster uses, so its interface is one peers can reach. A store on loopback changes nothing."""
    if os.environ.get(GLOO_IFNAME_ENV):
        return
    interface = interface_towards(host, port)
    if interface and interface != "lo":
        os.environ[GLOO_IFNAME_ENV] = interface
        log.info(
            "collective jobs use interface %s (the route to the rendezvous store; set %s to choose)",
            interface,
            GLOO_IFNAME_ENV,
        )


def interface_towards(host: str, port: int) -> str:
    """The name of the IPv4 interface whose address this host sends from to reach host:port ("" if unknown)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # a UDP connect only picks the route: nothing is sent
            source = probe.getsockname()[0]
    except OSError as err:
        log.warning("no IPv4 route to the rendezvous store %s:%d: %s", host, port, err)
        return ""
    if ipaddress.ip_address(source).is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        if _ipv4_address(name) == source:
            return name
    return ""


def _ipv4_address(interface: str) -> str:
    """The IPv4 address of `interface` ("" when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15])
            )
        except OSError:
            return ""
    return socket.inet_ntoa(answer[20:24])
