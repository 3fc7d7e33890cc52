"""What each RPC requires, and the server interceptor that authenticates the caller and checks it.

Every method of both services has one rule (ACCESS_RULES): the right it needs
(read, write, admin, or cluster: the internal credential only) and, for writes
of a named tensor, where the name is so the principal's tensor patterns are
checked. Health needs nothing. A method without a rule is refused (fail closed).
Clients send ("authorization", "Bearer <token>"); coordinator and ranks send
("authorization", "Cluster <secret>") on the calls they make to each other, or, in an mTLS cluster
started with --cluster-cert-name, no authorization at all: their client certificate names the cluster.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from shardserve.server.common.errors import (
    PermissionDenied,
    ServiceError,
    Unauthenticated,
    abort_for,
)
from shardserve.server.common.principals import (
    ADMIN,
    ANONYMOUS_ADMIN,
    CLUSTER,
    CLUSTER_MEMBER,
    READ,
    WRITE,
    ClusterCertificate,
    ClusterSecret,
    Principal,
    PrincipalBook,
)
from shardserve.server.common.request_decoding import Undecodable

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_METHOD = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
COORDINATOR = "/shardserve.v1.Coordinator/"
LEADERSHIP = "/shardserve.v1.Leadership/"
SHARD_SERVER = "/shardserve.v1.ShardServer/"
BEARER, CLUSTER_SCHEME = "Bearer ", "Cluster "
_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("caller", default=None)


def caller() -> Principal | None:
    """The principal of the change this thread is serving (None outside one, or without the interceptor): what
    the coordinator records as a tensor's owner and checks the byte quota of."""
    return _CALLER.get()


def _field_name(request: Any) -> str | None:
    return getattr(request, "name", None)


def _field_prefix(request: Any) -> str | None:
    return getattr(request, "prefix", None)


def _shard_names(request: Any) -> list[str]:
    return sorted({header.name for header in request.shards})


def _region_names(request: Any) -> list[str]:
    return sorted({region.name for region in request.regions})


def _item_names(request: Any) -> list[str]:
    return sorted({item.name for item in request.items})


def _prefix_if_any(request: Any) -> str | None:
    return request.prefix or None


def _header_name(request: Any) -> str | None:
    header = getattr(request, "header", None)
    return header.name if header is not None and request.HasField("header") else None


@dataclass(frozen=True)
class Rule:
    """The right a method needs; `tensor`: where its request names the tensor it reads or writes (checked
    against the principal's patterns); `logged`: a change; `needs_caller`: the servicer asks caller() who
    called (to filter a listing by the patterns, or to remember the principal in a bulk-port ticket)."""

    right: str
    tensor: Callable[[Any], str | Sequence[str] | None] | None = (
        None  # one name, or every name of a batch
    )
    logged: bool = False
    needs_caller: bool = (
        False  # the servicer reads caller() (as OpenBulkSession does, for its ticket's rights)
    )


ACCESS_RULES: dict[str, Rule] = {
    COORDINATOR + "RegisterRank": Rule(CLUSTER),
    COORDINATOR + "Heartbeat": Rule(CLUSTER),
    COORDINATOR + "ReportRestore": Rule(CLUSTER),
    COORDINATOR + "ListRanks": Rule(READ),
    COORDINATOR + "CreateTensor": Rule(WRITE, _field_name, logged=True),
    COORDINATOR + "CommitTensor": Rule(WRITE, _field_name, logged=True),
    COORDINATOR + "AbortTensor": Rule(WRITE, _field_name, logged=True),
    COORDINATOR + "GetTensor": Rule(READ, _field_name),
    COORDINATOR + "ListTensors": Rule(READ, needs_caller=True),
    COORDINATOR + "DeleteTensor": Rule(WRITE, _field_name, logged=True),
    COORDINATOR + "Reshard": Rule(ADMIN, logged=True),
    COORDINATOR + "InspectCheckpoint": Rule(ADMIN),
    COORDINATOR + "LoadCheckpoint": Rule(ADMIN, logged=True),
    COORDINATOR + "SaveCheckpoint": Rule(ADMIN, logged=True),
    COORDINATOR + "CreateSnapshot": Rule(WRITE, _field_prefix, logged=True),
    COORDINATOR + "CommitSnapshot": Rule(WRITE, _field_prefix, logged=True),
    COORDINATOR + "AbortSnapshot": Rule(WRITE, _field_prefix, logged=True),
    COORDINATOR + "TakeReservedSnapshot": Rule(WRITE, _field_prefix),
    COORDINATOR + "GetSnapshot": Rule(READ, _field_prefix),
    COORDINATOR + "ListSnapshots": Rule(READ, _prefix_if_any, needs_caller=True),
    LEADERSHIP + "GetRole": Rule(READ),
    SHARD_SERVER + "AllocateShards": Rule(CLUSTER),
    SHARD_SERVER + "PromoteVersion": Rule(CLUSTER),
    SHARD_SERVER + "DropVersion": Rule(CLUSTER),
    SHARD_SERVER + "AllocateMany": Rule(CLUSTER),
    SHARD_SERVER + "PromoteMany": Rule(CLUSTER),
    SHARD_SERVER + "DropMany": Rule(CLUSTER),
    SHARD_SERVER + "WriteShard": Rule(WRITE, _header_name),
    SHARD_SERVER + "ReadRegion": Rule(READ, _field_name),
    SHARD_SERVER + "GetStats": Rule(READ),
    SHARD_SERVER + "Lookup": Rule(READ, _item_names),
    SHARD_SERVER + "LookupSmall": Rule(READ, _item_names),
    SHARD_SERVER + "WriteRows": Rule(WRITE, _field_name),
    SHARD_SERVER + "WriteBytes": Rule(WRITE, _field_name),
    SHARD_SERVER + "RunCollective": Rule(CLUSTER),
    SHARD_SERVER + "CancelCollective": Rule(CLUSTER),
    SHARD_SERVER + "OpenShard": Rule(READ, _field_name),
    SHARD_SERVER + "OpenShards": Rule(READ, _shard_names),
    SHARD_SERVER + "ReleaseShard": Rule(READ),
    SHARD_SERVER + "ReadRegionSmall": Rule(READ, _field_name),
    SHARD_SERVER + "ReadRegions": Rule(READ, _region_names),
    SHARD_SERVER + "OpenBulkSession": Rule(READ, needs_caller=True),
    SHARD_SERVER + "WriteShards": Rule(WRITE, _shard_names),
    SHARD_SERVER + "OpenShardsForWrite": Rule(WRITE, _shard_names),
    REFLECTION_METHOD: Rule(READ),
}


@dataclass(frozen=True)
class AccessPolicy:
    """How a server authenticates callers: client principals (None: no client auth, every client is an
    anonymous admin) and the cluster credential: a secret and/or a certificate name (neither configured: the
    cluster right is not checked)."""

    principals: PrincipalBook | None = None
    cluster: ClusterSecret | None = None
    cluster_cert: ClusterCertificate | None = None

    def by_certificate(self, authorization: str) -> bool:
        """Whether a call with this "authorization" is authenticated by its peer's certificate (which only the
        handler's context shows): one without any, where a cluster certificate name is configured."""
        return not authorization and self.cluster_cert is not None

    def authenticate_peer(self, auth_context: Any) -> Principal:
        """The principal of a call without "authorization": the cluster when its peer presented a certificate
        of the cluster, else what a call without a token is (UNAUTHENTICATED, or the anonymous admin)."""
        if self.cluster_cert is not None and self.cluster_cert.matches(auth_context):
            return CLUSTER_MEMBER
        return self.authenticate("")

    def authenticate(self, authorization: str) -> Principal:
        """The principal an "authorization" value stands for; Unauthenticated when it stands for none."""
        if authorization.startswith(CLUSTER_SCHEME):
            if self.cluster is not None and self.cluster.matches(
                authorization[len(CLUSTER_SCHEME) :]
            ):
                return CLUSTER_MEMBER
            raise Unauthenticated("wrong cluster credential in the 'authorization' metadata")
        if self.principals is None:
            return ANONYMOUS_ADMIN
        if not authorization:
            raise Unauthenticated("missing bearer token in the 'authorization' metadata")
        principal = (
            self.principals.find(authorization[len(BEARER) :])
            if authorization.startswith(BEARER)
            else None
        )
        if principal is None:
            raise Unauthenticated(
                "wrong bearer token in the 'authorization' metadata (no principal holds it)"
            )
        return principal

    def authorize(self, principal: Principal, method: str, rule: Rule | None) -> None:
        """PermissionDenied naming the principal and the right it lacks for `method`."""
        if rule is None:
            raise PermissionDenied(f"{method} has no access rule; refused")
        if rule.right == CLUSTER and self.cluster is None and self.cluster_cert is None:
            return
        if not principal.may(rule.right):
            raise PermissionDenied(
                f"principal {principal.name!r} (role "
                f"{principal.role}) lacks the '{rule.right}' right that {_short(method)} needs",
                metadata={"principal": principal.name, "right": rule.right},
            )


def check_tensor(
    principal: Principal, method: str, tensor: str | Sequence[str] | None, *, right: str = WRITE
) -> None:
    """PermissionDenied when `principal`'s tensor patterns do not cover the tensor (or every tensor of
    a batch) it reads or writes (`right`)."""
    for name in [tensor] if isinstance(tensor, str) else tensor or ():
        if not principal.covers(name):
            raise PermissionDenied(
                f"principal {principal.name!r} lacks the '{right}' right "
                f"on tensor {name!r} ({_short(method)}; its patterns: {', '.join(principal.tensors)})",
                metadata={"principal": principal.name, "tensor": name, "right": right},
            )


def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


def authorization_of(details: grpc.HandlerCallDetails) -> str:
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return ""


class AccessInterceptor(grpc.ServerInterceptor):
    """Authenticates every call but health, checks its method's rule, and logs every change with its principal.

    `on_principal(principal, method)` (optional) returns a wrapper for the handler once the caller is known
    (the stream limits use it)."""

    def __init__(
        self,
        policy: AccessPolicy,
        on_principal: Callable[[Principal, str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]
        | None = None,
    ) -> None:
        self.policy = policy
        self._on_principal = on_principal

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        rule = ACCESS_RULES.get(method)
        authorization = authorization_of(handler_call_details)
        if self.policy.by_certificate(authorization) and handler is not None:
            return self._admitting_by_certificate(handler, method, rule)
        try:
            principal = self.policy.authenticate(authorization)
            self.policy.authorize(principal, method, rule)
        except ServiceError as denied:
            log.warning("refused %s: %s", method, denied)
            return denying_handler(handler, denied)
        if handler is None:
            return None
        return self._admitted(handler, principal, method, rule)

    def _admitting_by_certificate(
        self, handler: grpc.RpcMethodHandler, method: str, rule: Rule | None
    ) -> grpc.RpcMethodHandler:
        """`handler` that first authenticates the call by its peer's certificate (the servicer context holds
        it, the interceptor's call details do not), then runs as `_admitted` would have."""

        def run(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                principal = self.policy.authenticate_peer(context.auth_context())
                self.policy.authorize(principal, method, rule)
            except ServiceError as denied:
                log.warning("refused %s: %s", method, denied)
                abort_for(context, method, denied)
            return behavior_of(self._admitted(handler, principal, method, rule))(request, context)

        return replace_behavior(handler, run)

    def _admitted(
        self, handler: grpc.RpcMethodHandler, principal: Principal, method: str, rule: Rule | None
    ) -> grpc.RpcMethodHandler:
        """`handler` for an authenticated, authorized caller: tensor patterns checked, changes logged, limits."""
        if rule is not None and (rule.tensor is not None or rule.logged or rule.needs_caller):
            handler = _checking_tensor(handler, principal, method, rule)
        if self._on_principal is not None:
            handler = self._on_principal(principal, method, handler)
        return handler


def _checking_tensor(
    handler: grpc.RpcMethodHandler, principal: Principal, method: str, rule: Rule
) -> grpc.RpcMethodHandler:
    """`handler` that first checks the tensor the request names against the principal's patterns, logs the
    change with the principal's name, and lets the servicer see the principal (caller())."""

    def check(request: Any, context: grpc.ServicerContext) -> None:
        if isinstance(request, Undecodable):  # RequestDecodingInterceptor answers INVALID_ARGUMENT
            return
        tensor = rule.tensor(request) if rule.tensor is not None else _field_name(request)
        if rule.tensor is not None:
            try:
                check_tensor(principal, method, tensor, right=rule.right)
            except ServiceError as denied:
                log.warning("refused %s: %s", method, denied)
                abort_for(context, method, denied)
        if rule.logged:
            target = tensor if tensor is not None else getattr(request, "path", "")
            log.info(
                "principal %r (%s, %s): %s %r",
                principal.name,
                principal.role,
                context.peer(),
                _short(method),
                target,
            )

    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary

        def run_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(_first_checked(requests, context, check), context)

        return replace_behavior(handler, run_stream)
    unary = handler.unary_unary or handler.unary_stream

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        check(request, context)
        _CALLER.set(principal)
        try:
            return unary(request, context)
        finally:
            _CALLER.set(None)

    def run_streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        check(request, context)
        _CALLER.set(principal)  # the answers are made while the stream is iterated, on this thread
        try:
            yield from unary(request, context)
        finally:
            _CALLER.set(None)

    return replace_behavior(handler, run_streaming if handler.response_streaming else run)


def _first_checked(
    requests: Iterator[Any],
    context: grpc.ServicerContext,
    check: Callable[[Any, grpc.ServicerContext], None],
) -> Iterator[Any]:
    first = True
    for request in requests:
        if first:
            check(request, context)
            first = False
        yield request


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The function `handler` runs, whatever its kind."""
    return (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )


def replace_behavior(
    handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as `handler` running `behavior`."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behavior, **kwargs)


def denying_handler(
    handler: grpc.RpcMethodHandler | None, denied: ServiceError
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers with the status of `denied`."""

    def deny(request: Any, context: grpc.ServicerContext) -> None:
        abort_for(context, "", denied)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(deny)
    return replace_behavior(handler, deny)
