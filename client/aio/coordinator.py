"""The coordinator's calls on grpc.aio: the blocking Session's requests with the same deadline, credentials,
channel options and error mapping (client.errors), awaited on the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from shardserve.client.channel import CHANNEL_OPTIONS, Credentials
from shardserve.client.errors import ShardServeError, error_from_rpc
from shardserve.client.session import STREAM_SLACK_S
from shardserve.protos import shardserve_pb2_grpc as pb_grpc


class AioCoordinator:
    """One grpc.aio channel to the coordinator at `address` (made on the running loop)."""

    def __init__(self, address: str, credentials: Credentials, timeout: float) -> None:
        if credentials.uses_tls:
            self._channel = grpc.aio.secure_channel(
                address, credentials.channel_credentials(), options=CHANNEL_OPTIONS
            )
        else:
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._metadata = credentials.metadata()
        self._timeout = timeout
        self.where = f"coordinator at {address}"

    async def call(self, method: str, request: Any) -> Any:
        """The unary `method` under the client's deadline; errors as the blocking client raises them."""
        try:
            return await getattr(self._stub, method)(
                request, timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.where) from None

    async def follow(
        self,
        method: str,
        request: Any,
        work_timeout: float,
        report: Callable[[Any], None],
        refused: Callable[[ShardServeError], ShardServeError],
    ) -> list[Any]:
        """The progress stream `method`, as Session.follow: report(message) for each, in order; returns them.
        The stream is cancelled however it ends (the awaiting task cancelled too), which aborts the work."""
        call = getattr(self._stub, method)(
            request, timeout=work_timeout + STREAM_SLACK_S, metadata=self._metadata
        )
        messages = []
        try:
            async for message in call:
                messages.append(message)
                report(message)
        except grpc.RpcError as err:
            raise refused(error_from_rpc(err, self.where)) from None
        finally:
            call.cancel()
        return messages

    async def close(self) -> None:
        await self._channel.close()
