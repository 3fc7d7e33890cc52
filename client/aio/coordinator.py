"""The coordinator's calls on grpc.aio: the blocking Session's requests with the same deadline, credentials,
channel options and error mapping (client.errors), awaited on the event loop, following the leader as the
blocking client does (client/coordinators.py: the same addresses, so a leader one of them found is the one
the other calls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from shardserve.client.channel import CHANNEL_OPTIONS, Credentials
from shardserve.client.coordinators import (
    FIRST_PAUSE_S,
    MAX_PAUSE_S,
    STREAM_SLACK_S,
    Refusal,
    after_failure,
)
from shardserve.client.errors import ShardServeError, error_from_rpc
from shardserve.core.coordinator_addresses import CoordinatorAddresses
from shardserve.protos import shardserve_pb2_grpc as pb_grpc


class AioCoordinator:
    """grpc.aio channels to the coordinators of `addresses` (made on the running loop, one per address)."""

    def __init__(
        self, addresses: CoordinatorAddresses, credentials: Credentials, timeout: float
    ) -> None:
        self.addresses = addresses
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.CoordinatorStub] = {}
        self._metadata = credentials.metadata()
        self._timeout = timeout

    @property
    def where(self) -> str:
        return f"coordinator at {self.addresses.current}"

    def _stub(self, address: str) -> pb_grpc.CoordinatorStub:
        stub = self._stubs.get(address)
        if stub is None:
            if self._credentials.uses_tls:
                channel = grpc.aio.secure_channel(
                    address, self._credentials.channel_credentials(), options=CHANNEL_OPTIONS
                )
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = pb_grpc.CoordinatorStub(channel)
        return stub

    async def call(self, method: str, request: Any) -> Any:
        """The unary `method` at the leader under the client's deadline; errors as the blocking client raises
        them."""
        deadline = time.monotonic() + self._timeout
        return await self._at_leader(
            lambda stub, left: getattr(stub, method)(
                request, timeout=left, metadata=self._metadata
            ),
            deadline,
        )

    async def follow(
        self,
        method: str,
        request: Any,
        work_timeout: float,
        report: Callable[[Any], None],
        refused: Callable[[ShardServeError], ShardServeError],
    ) -> list[Any]:
        """The progress stream `method` at the leader, as Session.follow: report(message) for each, in order;
        returns them. A stream refused before its first message goes to the leader. The stream is cancelled
        however it ends (the awaiting task cancelled too), which aborts the work."""
        deadline = time.monotonic() + work_timeout + STREAM_SLACK_S
        messages: list[Any] = []

        async def stream(stub: pb_grpc.CoordinatorStub, left: float) -> list[Any]:
            call = getattr(stub, method)(request, timeout=left, metadata=self._metadata)
            try:
                async for message in call:
                    messages.append(message)
                    report(message)
            except grpc.RpcError as err:
                if messages:
                    raise refused(error_from_rpc(err, self.where)) from None
                raise
            finally:
                call.cancel()
            return messages

        try:
            return await self._at_leader(stream, deadline)
        except ShardServeError as error:
            if messages:
                raise
            raise refused(error) from None

    async def _at_leader(
        self, attempt: Callable[[Any, float], Awaitable[Any]], deadline: float
    ) -> Any:
        address, pause = self.addresses.current, FIRST_PAUSE_S
        refusal: Refusal | None = None
        while True:
            try:
                return await attempt(self._stub(address), max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as err:
                refusal = Refusal.of(err, address) or refusal
                moved = after_failure(self.addresses, address, err, pause)
                if moved is None or time.monotonic() + moved.pause >= deadline:
                    raise Refusal.last(err, address, refusal) from None
                if moved.pause:
                    await asyncio.sleep(moved.pause)
                    pause = min(2 * pause, MAX_PAUSE_S)
                address = moved.address

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
