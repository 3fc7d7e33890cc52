"""Pipelined network calls: every rank's request sent before any answer is awaited (reads of several small
parts, lookups).

A call goes out on the rank's bulk port where the network chain (client.paths.chain) tries that first, else
as a gRPC call on the caller's pool; a bulk port that fails at the send or at the answer falls back to gRPC for
that rank alone, as the chain says. Every call runs as a race (client.paths.hedging) that a hedge may win.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from shardserve.client.info import RankStatus
from shardserve.client.paths.chain import FallbackChain
from shardserve.client.paths.hedging import Cancellation, Hedge, Landing, Race, Watchdog
from shardserve.client.paths.kinds import DataPath, PathKind

# settle(race, rank, error): the hedge's (path, landing) when it answered, else the error raised
Settle = Callable[[Race, RankStatus, BaseException], tuple[str, Landing]]


@dataclass(frozen=True)
class NetworkCall:
    """One rank's request for send_all: `send_bulk(cancel)` sends it on the rank's bulk port and returns the
    call that takes its answer (None: this request may not use the port); `over_grpc(cancel)` makes the whole
    call over gRPC; `hedge` makes it of another copy (client.paths.hedging), `nbytes` its answer's size."""

    rank: RankStatus
    send_bulk: Callable[[Cancellation], Callable[[], object]] | None
    over_grpc: Callable[[Cancellation], object]
    hedge: Hedge | None = None
    nbytes: int = 0


@dataclass(frozen=True)
class CallPipeline:
    """What pipelined calls share: the network chain, its bulk path, the watchdog and the policy's settle."""

    network: FallbackChain
    bulk: DataPath
    watchdog: Watchdog
    settle: Settle

    def bulk_first(self, call: NetworkCall) -> bool:
        """Whether `call` goes out on its rank's bulk port."""
        return call.send_bulk is not None and self.network.first(call.rank) is self.bulk

    def send_all(
        self, calls: Sequence[NetworkCall], submit: Callable[[Callable[[], object]], Future]
    ) -> SentCalls:
        """Start every call: its request out on the bulk port where that may serve the rank, else a gRPC call on
        `submit`'s threads; SentCalls.wait() takes the answers (falling back as the chain does).

        Every bulk request goes out before any answer is awaited, and all on this thread: the ranks work at
        once with no thread hand-off (one per rank cost a two-rank 512-id lookup ~250 us of client CPU), and a
        caller can hold a lock for its CPU work while sending and release it to wait. Nothing here waits on
        the network but the sends themselves and, where a rank has no kept connection, opening one (an
        OpenBulkSession call and a connect); a lone gRPC call runs in wait(), on the waiting thread."""
        usable = [self.bulk_first(call) for call in calls]  # before any send
        sent = SentCalls(self, calls, paths=[PathKind.GRPC] * len(calls))
        sent.races = [
            self.watchdog.start(call.rank.rank, call.nbytes, call.hedge) for call in calls
        ]
        over_grpc = []
        for index, call in enumerate(calls):
            if not usable[index]:
                over_grpc.append(index)
                continue
            try:
                sent.answers[index] = call.send_bulk(sent.races[index].primary)  # type: ignore[misc]
                sent.paths[index] = PathKind.BULK
            except BaseException as err:  # noqa: BLE001 - raised by wait(), once the calls sent have ended
                if sent.bulk_failed(index, err):
                    over_grpc.append(index)
        sent.inline = over_grpc[:1] if not sent.answers else []
        sent.future_calls = over_grpc[len(sent.inline) :]
        sent.futures = [
            submit(partial(calls[index].over_grpc, sent.races[index].primary))
            for index in sent.future_calls
        ]
        return sent


@dataclass
class SentCalls:
    """Calls started by CallPipeline.send_all; wait() ends them."""

    pipeline: CallPipeline
    calls: Sequence[NetworkCall]
    paths: list[PathKind | None]  # per call: BULK, GRPC, or None (failed before any answer)
    answers: dict[int, Callable[[], object]] = field(
        default_factory=dict
    )  # bulk answers to take, by call
    errors: list[BaseException] = field(default_factory=list)
    inline: list[int] = field(default_factory=list)  # calls to make over gRPC on the waiting thread
    futures: list[Future] = field(default_factory=list)
    future_calls: list[int] = field(default_factory=list)  # per future, the call it makes
    races: list[Race] = field(default_factory=list)  # per call (client.paths.hedging)

    def wait(self) -> list[PathKind | None]:
        """Take every bulk answer (a failed one falls back to gRPC here), wait for the gRPC calls; returns each
        call's path and raises the first failure once every call has ended. A call whose hedge answered
        first takes the hedge's answer here, once its own call has returned."""
        try:
            self._take_answers()
        finally:
            for race in self.races:
                self.pipeline.watchdog.finish(race)
        if self.errors:
            raise self.errors[0]
        return self.paths

    def bulk_failed(self, index: int, err: BaseException) -> bool:
        """Call `index` failed on the bulk port: True when the chain falls back (it goes over gRPC), else the
        call failed (False)."""
        call = self.calls[index]
        if self.pipeline.network.falls_back(
            self.pipeline.bulk, call.rank, err, cancel=self.races[index].primary
        ):
            self.paths[index] = PathKind.GRPC
            return True
        self.failed(index, err)
        return False

    def _take_answers(self) -> None:
        for index, answer in self.answers.items():
            try:
                answer()
            except BaseException as err:  # noqa: BLE001 - raised by wait(), after every call ended
                if self.bulk_failed(index, err):
                    self.inline.append(index)
            else:
                self.races[index].primary_done()
        runs: list[tuple[int, Callable[[], object]]] = [
            *(
                (index, partial(self.calls[index].over_grpc, self.races[index].primary))
                for index in self.inline
            ),
            *((index, future.result) for index, future in zip(self.future_calls, self.futures)),
        ]
        for index, run in runs:
            try:
                run()
            except BaseException as err:  # noqa: BLE001 - raised by wait(), after every call ended
                self.failed(index, err)
            else:
                self.races[index].primary_done()

    def cancel(self) -> None:
        """Cancel every call (a hedge whose primary answered first drops its calls)."""
        for race in self.races:
            race.primary.cancel()

    def failed(self, index: int, err: BaseException) -> None:
        """Call `index` failed with `err`: its hedge's answer lands when it has one, else the error is kept."""
        try:
            path, land = self.pipeline.settle(self.races[index], self.calls[index].rank, err)
            land()
        except BaseException as failure:  # noqa: BLE001 - raised by wait(), after every call ended
            self.errors.append(failure)
            self.paths[index] = None
            return
        self.paths[index] = PathKind(path)
