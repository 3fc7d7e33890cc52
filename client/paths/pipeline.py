"""Pipelined network calls: every rank's request sent before any answer is awaited (reads of several small
parts, lookups).

A call is sent on the first path the network chain (client.paths.chain) tries for its rank where that path
declares pipelined calls (the bulk port), else made whole on the path of streamed calls (gRPC) on the caller's
pool; a pipelined path that fails at the send or at the answer falls back to the streamed path for that rank
alone, as the chain says. Every call runs as a race (client.paths.hedging) that a hedge may win.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from shardserve.client.info import RankStatus
from shardserve.client.paths.chain import FallbackChain
from shardserve.client.paths.hedging import Cancellation, Hedge, Landing, Race, Watchdog
from shardserve.client.paths.kinds import (
    DataPath,
    PathKind,
    PipelinedCalls,
    StreamedCalls,
    pipelined,
)

# settle(race, rank, error): the hedge's (path, landing) when it answered, else the error raised
Settle = Callable[[Race, RankStatus, BaseException], tuple[str, Landing]]


@dataclass(frozen=True)
class NetworkCall:
    """One rank's request for send_all: `send(path, cancel)` sends it on a pipelined path and returns the call
    that takes its answer (None: this request may not be pipelined); `call(path, cancel)` makes the whole call
    on a streamed path; `hedge` makes it of another copy (client.paths.hedging), `nbytes` its answer's size."""

    rank: RankStatus
    send: Callable[[PipelinedCalls, Cancellation], Callable[[], object]] | None
    call: Callable[[StreamedCalls, Cancellation], object]
    hedge: Hedge | None = None
    nbytes: int = 0


@dataclass(frozen=True)
class CallPipeline:
    """What pipelined calls share: the network chain, the path of streamed calls (`direct`), the watchdog and
    the policy's settle."""

    network: FallbackChain
    direct: StreamedCalls
    watchdog: Watchdog
    settle: Settle

    def sent_on(self, call: NetworkCall) -> PipelinedCalls | None:
        """The pipelined path `call` goes out on: the first its rank's chain tries, where that pipelines."""
        return pipelined(self.network.first(call.rank)) if call.send is not None else None

    def send_all(
        self, calls: Sequence[NetworkCall], submit: Callable[[Callable[[], object]], Future]
    ) -> SentCalls:
        """Start every call: its request out on a pipelined path where one serves the rank first, else a streamed
        call on `submit`'s threads; SentCalls.wait() takes the answers (falling back as the chain does).

        Every pipelined request goes out before any answer is awaited, and all on this thread: the ranks work at
        once with no thread hand-off (one per rank cost a two-rank 512-id lookup ~250 us of client CPU), and a
        caller can hold a lock for its CPU work while sending and release it to wait. Nothing here waits on
        the network but the sends themselves and, where a rank has no kept connection, opening one (an
        OpenBulkSession call and a connect); a lone gRPC call runs in wait(), on the waiting thread."""
        ways = [self.sent_on(call) for call in calls]  # before any send
        sent = SentCalls(self, calls, paths=[self.direct.kind] * len(calls))
        sent.races = [
            self.watchdog.start(call.rank.rank, call.nbytes, call.hedge) for call in calls
        ]
        streamed = []
        for index, (call, way) in enumerate(zip(calls, ways)):
            if way is None or call.send is None:
                streamed.append(index)
                continue
            try:
                sent.answers[index] = call.send(way, sent.races[index].primary)
                sent.paths[index], sent.ways[index] = way.kind, way
            except BaseException as err:  # noqa: BLE001 - raised by wait(), once the calls sent have ended
                if sent.pipelined_failed(index, way, err):
                    streamed.append(index)
        sent.inline = streamed[:1] if not sent.answers else []
        sent.future_calls = streamed[len(sent.inline) :]
        sent.futures = [
            submit(partial(calls[index].call, self.direct, sent.races[index].primary))
            for index in sent.future_calls
        ]
        return sent


@dataclass
class SentCalls:
    """Calls started by CallPipeline.send_all; wait() ends them."""

    pipeline: CallPipeline
    calls: Sequence[NetworkCall]
    paths: list[
        PathKind | None
    ]  # per call: the path that answered, or None (failed before any answer)
    answers: dict[int, Callable[[], object]] = field(
        default_factory=dict
    )  # pipelined answers to take, by call
    ways: dict[int, PipelinedCalls] = field(
        default_factory=dict
    )  # the pipelined path, by call sent on one
    errors: list[BaseException] = field(default_factory=list)
    inline: list[int] = field(default_factory=list)  # streamed calls to make on the waiting thread
    futures: list[Future] = field(default_factory=list)
    future_calls: list[int] = field(default_factory=list)  # per future, the call it makes
    races: list[Race] = field(default_factory=list)  # per call (client.paths.hedging)

    def wait(self) -> list[PathKind | None]:
        """Take every pipelined answer (a failed one falls back to a streamed call here), wait for the streamed
        calls; returns each
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

    def pipelined_failed(self, index: int, way: DataPath, err: BaseException) -> bool:
        """Call `index` failed on pipelined path `way`: True when the chain falls back (it becomes a streamed
        call), else the call failed (False)."""
        call = self.calls[index]
        if self.pipeline.network.falls_back(way, call.rank, err, cancel=self.races[index].primary):
            self.paths[index] = self.pipeline.direct.kind
            return True
        self.failed(index, err)
        return False

    def _take_answers(self) -> None:
        for index, answer in self.answers.items():
            try:
                answer()
            except BaseException as err:  # noqa: BLE001 - raised by wait(), after every call ended
                if self.pipelined_failed(index, self.ways[index], err):
                    self.inline.append(index)
            else:
                self.races[index].primary_done()
        runs: list[tuple[int, Callable[[], object]]] = [
            *(
                (
                    index,
                    partial(
                        self.calls[index].call, self.pipeline.direct, self.races[index].primary
                    ),
                )
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
