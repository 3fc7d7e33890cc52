"""Client logic that needs no cluster: status -> exception mapping, index parsing, CLI parsing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.client import errors
from shardserve.client.channel import Credentials, check_address
from shardserve.client.cli.main import _ints, build_parser
from shardserve.client.indexing import parse_index
from shardserve.client.info import layout_summary
from shardserve.core.metadata import make_metadata

ROOT = Path(__file__).resolve().parents[2]


class _FakeRpcError(grpc.RpcError):
    """A failed call as grpc reports it: code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "code, cls, builtin",
    [
        (grpc.StatusCode.NOT_FOUND, errors.TensorNotFoundError, KeyError),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError, ValueError),
        (grpc.StatusCode.ALREADY_EXISTS, errors.TensorExistsError, ValueError),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.PreconditionError, errors.ShardServeError),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDeniedError, PermissionError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError, errors.ShardServeError),
        (grpc.StatusCode.UNAUTHENTICATED, errors.AuthenticationError, PermissionError),
        (grpc.StatusCode.UNAVAILABLE, errors.RankUnavailableError, ConnectionError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError, TimeoutError),
        (grpc.StatusCode.DATA_LOSS, errors.ShardsLostError, ConnectionError),
        (grpc.StatusCode.INTERNAL, errors.ShardServeError, Exception),
    ],
)
def test_status_maps_to_exception_keeping_message(code, cls, builtin):
    err = errors.error_from_rpc(_FakeRpcError(code, "tensor 'x' version 3: offsets[1]=9 is bad"))
    assert type(err) is cls
    assert isinstance(err, builtin) and isinstance(err, errors.ShardServeError)
    assert str(err).endswith("tensor 'x' version 3: offsets[1]=9 is bad")
    assert err.code == code


def test_not_found_prints_plain_message_not_repr():
    err = errors.error_from_rpc(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "tensor 'w' not found"))
    assert str(err) == "tensor 'w' not found"


def test_unavailable_names_the_peer():
    err = errors.error_from_rpc(
        _FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), "rank at h:1"
    )
    assert str(err) == "rank at h:1: connection refused"


_index_item = st.one_of(
    st.integers(-6, 5),
    st.builds(
        slice, st.one_of(st.none(), st.integers(-8, 8)), st.one_of(st.none(), st.integers(-8, 8))
    ),
    st.builds(
        slice,
        st.one_of(st.none(), st.integers(-8, 8)),
        st.one_of(st.none(), st.integers(-8, 8)),
        st.just(1),
    ),
)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=3), data=st.data())
def test_parse_index_reads_what_torch_indexing_reads(shape, data):
    source = torch.arange(max(1, torch.Size(shape).numel()))[: torch.Size(shape).numel()].reshape(
        shape
    )
    items = tuple(data.draw(st.lists(_index_item, max_size=len(shape))))
    index = items[0] if len(items) == 1 and data.draw(st.booleans()) else items
    try:
        expected = source[index]
    except IndexError:
        with pytest.raises(IndexError):
            parse_index(index, shape)
        return
    box, dropped = parse_index(index, shape)
    view = source
    for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
        view = view.narrow(d, o, s)
    got = view.reshape([n for d, n in enumerate(box.sizes) if d not in dropped])
    assert torch.equal(got, expected)


def test_parse_index_ellipsis_and_negative():
    box, dropped = parse_index((Ellipsis, -1), (4, 5, 6))
    assert (box.offsets, box.sizes, dropped) == ((0, 0, 5), (4, 5, 1), (2,))


@pytest.mark.parametrize(
    "index, exc",
    [
        (slice(0, 4, 2), ValueError),
        ((0, slice(None, None, -1)), ValueError),
        ([0, 1], ValueError),
        (None, ValueError),
        (True, ValueError),
        (1.5, ValueError),
        (torch.tensor([0, 1]), ValueError),
        ((0, 0, 0), IndexError),
        (7, IndexError),
        (-8, IndexError),
        ((..., ...), ValueError),
        (slice("a", None), ValueError),
    ],
)
def test_parse_index_rejects_unsupported(index, exc):
    with pytest.raises(exc):
        parse_index(index, (7, 3))


def test_layout_summary():
    rows = make_metadata((6, 4), [((0, 0), (3, 4), 0), ((3, 0), (3, 4), 1)])
    assert layout_summary(rows) == "2 shards on ranks 0,1, split dim 0"
    grid = make_metadata(
        (4, 4), [((0, 0), (2, 2), 0), ((0, 2), (2, 2), 1), ((2, 0), (2, 2), 2), ((2, 2), (2, 2), 0)]
    )
    assert layout_summary(grid) == "4 shards on ranks 0,1,2, split dims 0,1"
    assert (
        layout_summary(make_metadata((4,), [((0,), (4,), 0), ((0,), (4,), 1)]))
        == "2 shards on ranks 0,1, replicated"
    )


@pytest.mark.parametrize("address", ["localhost", ":80", "h:0", "h:70000", "h:x", ""])
def test_check_address_rejects(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        check_address(address)


def test_credentials_need_cert_and_key_together():
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        Credentials(tls_cert="c.pem")
    assert Credentials(token="t").metadata() == (("authorization", "Bearer t"),)
    assert Credentials().metadata() == ()


def test_connect_rejects_bad_arguments_before_any_network():
    from shardserve import connect

    with pytest.raises(ValueError, match="address"):
        connect("nohostport")
    with pytest.raises(ValueError, match="timeout"):
        connect("127.0.0.1:1", timeout=0)
    for timeout in (
        float("inf"),
        1e12,
        float("nan"),
    ):  # gRPC would answer DEADLINE_EXCEEDED at once
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            connect("127.0.0.1:1", timeout=timeout)
    with pytest.raises(ValueError, match="row_cache_max_age"):
        connect("127.0.0.1:1", row_cache_max_age=float("nan"))
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        connect("127.0.0.1:1", token="a\nb")
    with pytest.raises(ValueError, match="tls_ca: cannot read"):
        connect("127.0.0.1:1", tls_ca="/nonexistent/ca.pem", timeout=1)


def test_connect_to_nothing_is_rank_unavailable():
    from shardserve import RankUnavailableError, connect

    with pytest.raises(RankUnavailableError, match="coordinator at 127.0.0.1:1"):
        connect("127.0.0.1:1", timeout=5)


def test_plain_arguments_are_checked_naming_the_argument():
    from shardserve.client import arguments
    from shardserve.client.errors import InvalidArgumentError

    assert arguments.count(np.int64(5), "n") == 5 and arguments.seconds(np.float32(2.0), "t") == 2.0
    for call, message in (
        (lambda: arguments.count(2**70, "bucket_bytes"), "bucket_bytes must be in"),
        (lambda: arguments.count(True, "n"), "n must be an int"),
        (lambda: arguments.flag("yes", "overwrite"), "overwrite must be True or False"),
        (lambda: arguments.tensor_name("\ud800"), "not valid Unicode"),
        (lambda: arguments.name_list([5]), r"names\[0\] must be a non-empty string"),
        (lambda: arguments.name_list(b"ab"), "names must be a name or an iterable"),
    ):
        with pytest.raises((InvalidArgumentError, TypeError), match=message):
            call()
    assert arguments.name_list(n for n in ["a", "b"]) == ["a", "b"]  # a generator read once
    with pytest.raises(TypeError, match="progress must be callable"):
        arguments.callback(5, "progress")


def test_cli_parsing():
    assert _ints("4,5") == (4, 5)
    args = build_parser().parse_args(
        ["--coordinator", "h:1", "fetch", "t", "--offsets", "1,2", "--sizes", "3,4"]
    )
    assert (args.coordinator, args.name, args.offsets, args.sizes) == ("h:1", "t", (1, 2), (3, 4))


def test_cli_expected_errors_are_one_line_without_traceback():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "shardserve", "status"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "shardserve status: error: no coordinator given: pass --coordinator "
        "HOST:PORT or set SHARDSERVE_COORDINATOR"
    )
    done = subprocess.run(
        [sys.executable, "-m", "shardserve", "create", "x", "--shape", "4,a"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--shape" in done.stderr and "Traceback" not in done.stderr


@settings(max_examples=200, deadline=None)
@given(
    offset=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**20)),
    data=st.binary(max_size=600),
)
def test_chunk_codec_agrees_with_protobuf(offset, data):
    from shardserve.protos import shardserve_pb2 as pb
    from shardserve.protos.chunk_codec import decode_chunk, encode_write_chunk

    encoded = encode_write_chunk(offset, memoryview(data))
    assert (
        encoded
        == pb.WriteShardRequest(chunk=pb.TensorChunk(offset=offset, data=data)).SerializeToString()
    )
    decoded = decode_chunk(pb.TensorChunk(offset=offset, data=data).SerializeToString())
    assert decoded.offset == offset and bytes(decoded.data) == data


def test_chunk_decoder_skips_unknown_fields_and_rejects_truncation():
    from shardserve.protos import shardserve_pb2 as pb
    from shardserve.protos.chunk_codec import decode_chunk

    message = pb.TensorChunk(offset=7, data=b"abc").SerializeToString()
    unknown = bytes(
        [(9 << 3) | 0, 5, (10 << 3) | 2, 2, 1, 2, (11 << 3) | 5, 0, 0, 0, 0, (12 << 3) | 1]
    ) + bytes(8)
    decoded = decode_chunk(unknown + message)
    assert decoded.offset == 7 and bytes(decoded.data) == b"abc"
    assert message == b"\x08\x07\x12\x03abc"
    short = decode_chunk(message[:2])  # a whole message of the offset alone
    assert short.offset == 7 and bytes(short.data) == b""
    for cut in (1, 3, 4, 5, 6):  # inside a varint or inside the data: never a shorter chunk
        with pytest.raises(ValueError, match="truncated"):
            decode_chunk(message[:cut])


@pytest.mark.parametrize(
    "argv,forwarded",
    [
        (["--token", "T", "up", "--ranks", "2"], ["up", "--token", "T", "--ranks", "2"]),
        (
            ["--token=T", "coordinator", "--port", "5"],
            ["coordinator", "--token", "T", "--port", "5"],
        ),
        (["up", "--token", "x", "--ranks", "3"], ["up", "--token", "x", "--ranks", "3"]),
        (
            ["--coordinator", "h:1", "node", "--ranks", "0-1", "--world-size", "4"],
            ["node", "--coordinator", "h:1", "--ranks", "0-1", "--world-size", "4"],
        ),
    ],
)
def test_server_commands_get_the_global_token_and_their_own_options(argv, forwarded, monkeypatch):
    import shardserve.client.cli.main as cli

    ran: list[list[str]] = []

    def exec_server(command, args):  # type: ignore[no-untyped-def]
        ran.append([command, *args])
        raise SystemExit(0)

    monkeypatch.setattr(cli, "exec_server_command", exec_server)
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert ran == [forwarded]


def test_client_options_before_a_server_command_and_unknown_options_are_errors(monkeypatch, capsys):
    import shardserve.client.cli.main as cli

    monkeypatch.setattr(
        cli, "exec_server_command", lambda command, args: pytest.fail("must not start a server")
    )
    with pytest.raises(SystemExit) as stop:
        cli.main(["--tls-ca", "ca.pem", "up"])
    assert (
        stop.value.code == 2
        and "--tls-ca before `up` is a client option" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as stop:
        cli.main(["list", "--bogus"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--coordinator", "notanaddress", "status"],
            "--coordinator must be HOST:PORT, got 'notanaddress'",
        ),
        (
            ["--coordinator", "h:1", "reshard", "t", "--replicate", "--dim", "1"],
            "give one of --dim, --grid or --replicate",
        ),
        (
            ["--coordinator", "h:1", "reshard", "t", "--grid", "2x2", "--dim", "0"],
            "give one of --dim, --grid",
        ),
        (
            ["--coordinator", "h:1", "reshard", "t", "--grid", "2by2"],
            "--grid must look like 2x2, got '2by2'",
        ),
        (["--coordinator", "h:1", "reshard", "t", "--ranks", ""], "--ranks is empty"),
    ],
)
def test_flag_combinations_are_usage_errors(argv, message, capsys):
    """Exit 2 with the usage line, before any call (no coordinator listens at h:1)."""
    import shardserve.client.cli.main as cli

    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_grid_dims_without_a_grid_is_refused():
    from shardserve.client.errors import InvalidArgumentError
    from shardserve.client.ops.reshard import layout_from_options

    with pytest.raises(InvalidArgumentError, match="--grid-dims goes with --grid"):
        layout_from_options((4, 4), torch.float32, {0: "cpu", 1: "cpu"}, grid_dims=(0, 1))


def test_a_commit_whose_answer_was_lost_counts_when_the_version_is_ready():
    """CommitTensor may succeed on the coordinator while its answer is lost (a deadline): the put must not say
    it failed while the tensor is visible, nor raise when it really did not commit."""
    from shardserve.client.errors import DeadlineExceededError
    from shardserve.client.session import Session
    from shardserve.protos import shardserve_pb2 as pb

    def calls(ready_version):  # type: ignore[no-untyped-def]
        def call(method, request):  # type: ignore[no-untyped-def]
            if method == "CommitTensor":
                raise DeadlineExceededError("coordinator: deadline exceeded")
            return pb.TensorInfo(name=request.name, version=ready_version, state=pb.READY)

        return call

    session = Session.__new__(Session)
    session.call = calls(7)  # type: ignore[method-assign]
    assert session.commit("t", 7).version == 7
    session.call = calls(6)  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceededError):
        session.commit("t", 7)


def test_ids_come_only_as_ordered_integer_sequences():
    from shardserve.client.embedding.ids import as_ids
    from shardserve.client.errors import InvalidArgumentError

    assert torch.equal(as_ids(np.array([3, 1], dtype=np.uint32)), torch.tensor([3, 1]))
    assert torch.equal(as_ids(range(2)), torch.tensor([0, 1]))
    for ids, error, message in (
        ({1: 2}, TypeError, "got dict"),
        ({1, 2}, TypeError, "got set"),
        (b"\x01", TypeError, "got bytes"),
        (torch.tensor([2**64 - 1], dtype=torch.uint64), InvalidArgumentError, "2\\*\\*63 or more"),
        (
            np.array([2**63], dtype=np.uint64),
            InvalidArgumentError,
            "9223372036854775808, past the int64",
        ),
        (torch.tensor([1, 2]).to_sparse(), InvalidArgumentError, "dense tensor"),
        (
            torch.empty(2, dtype=torch.int64, device="meta"),
            InvalidArgumentError,
            "dense tensor holding data",
        ),
    ):
        with pytest.raises(error, match=message):
            as_ids(ids)
