"""Request decoding: the project's decoders against msgspec Structs straight from the bytes.

Run as ``python benchmarks/bench_decoders.py [--quick]``; writes ``decoders.json`` and
``decoders.png``.

Every edge that decodes what a peer sent is measured from the bytes on the wire to the
validated message, both ways side by side in one process (the order alternates per round):

- HTTP bodies (``server/_messages.py``): ``decode_body`` (strict ``json.loads`` and its walk,
  which refuse duplicate keys, deep nesting, integers past 64 bits and lone surrogates,
  naming where) then ``EncodeBody.from_json`` & co. (msgspec Structs converted from the
  decoded value), against ``msgspec.json.Decoder(Struct)`` from the bytes plus the checks a
  schema cannot say (``part_idx < num_parts``, URLs, the nested media objects' depth): the
  price of the pre-pass;
- data-parallel IPC (``server/_dp/_ipc.py``): ``unpack`` then the fields checked by hand (the
  decoders it had, kept here as the baseline), against ``WorkMessage.decode`` /
  ``ReplyMessage.decode``, which decode with msgspec now;
- the ``/encode`` answer a receiver reads (``receiver/_encoder_wire.py``): ``json.loads`` (what
  ``httpx.Response.json`` does) then ``PartMetadata.from_json``, against a JSON Struct;
- the push header (``transfer/_wire.py``): ``decode_header``, which decodes with msgspec
  now (the bytes straight to a private Struct, then the frozen ``EmbeddingHeader`` built
  and checked as a whole), against a msgpack Struct alone with the same cross-field checks:
  the price of the public dataclass.

``pipeline/_pd_messages.py`` has no decoder: its messages are handed over in one process as the
values they are. Both sides must accept every valid body and refuse a set of broken ones
before timing, with two gaps on the bytes-only side: msgspec keeps the last of two duplicate
JSON keys, where ``decode_body`` refuses the body (printed when the benchmark starts), and
msgspec's integer bounds must fit an int64, so its counts stop at 2**63 - 1 where the
project takes any 64-bit integer (a 64-bit address is checked after decoding instead).
"""

from __future__ import annotations

import base64
import json
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgpack
import msgspec
from _common import Options, headline, parse_options, write_json, write_png

_REQ_ID = msgspec.Meta(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+\Z")
_TEXT = msgspec.Meta(min_length=1, max_length=512)
# msgspec bounds must fit an int64; the only field that may exceed it (a 64-bit address)
# is checked after decoding.
_I64_MAX = 2**63 - 1
_U64 = msgspec.Meta(ge=0, le=_I64_MAX)
ReqId = Annotated[str, _REQ_ID]
Text = Annotated[str, _TEXT]
Count = Annotated[int, _U64]
Visible = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=r"^[\x21-\x7e]+\Z")]


class EncodeStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    req_id: ReqId
    mm_items: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1)] | dict[str, Any], ...],
        msgspec.Meta(min_length=1),
    ]
    modality: Annotated[str, msgspec.Meta(min_length=1, max_length=32)] = "image"
    num_parts: Annotated[int, msgspec.Meta(ge=1, le=_I64_MAX)] = 1
    part_idx: Count = 0
    hashes: tuple[Text, ...] | None = None


class SendStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    req_id: ReqId
    receive_url: Text | None = None
    session_id: Visible | None = None
    buffer_address: Annotated[int, msgspec.Meta(ge=1)] | None = None
    prefill_host: Visible | None = None
    embedding_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    receive_count: Annotated[int, msgspec.Meta(ge=1, le=_I64_MAX)] | None = None
    part_idx: Count | None = None
    embedding_size: Count | None = None
    embedding_len: Count | None = None
    embedding_dim: Count | None = None


class ReleaseStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    req_id: ReqId


class PartStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    req_id: Annotated[str, msgspec.Meta(min_length=1)]
    part_idx: Count
    embedding_size: Count
    embedding_len: Count
    embedding_dim: Annotated[int, msgspec.Meta(ge=1)]
    token_counts: tuple[Count, ...]
    grid: tuple[tuple[Count, ...], ...]


class HeaderStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    v: Literal[1]
    req_id: Annotated[str, msgspec.Meta(min_length=1)]
    num_parts: Annotated[int, msgspec.Meta(ge=1)]
    part_idx: Count
    modality: Literal["image", "video", "audio"]
    shape: tuple[Count, Count]
    dtype: Literal[
        "float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64"
    ]
    token_counts: tuple[Count, ...]
    grid: tuple[tuple[Count, ...], ...]
    error: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    status: Annotated[int, msgspec.Meta(ge=400, le=599)] | None = None


def _msgspec_decoders() -> dict[str, Callable[[bytes], object]]:
    """The msgspec side: one decoder per edge, plus the checks a schema cannot say."""
    from encdisagg import BadRequestError, Modality
    from encdisagg.server._dp._ipc import ReplyMessage, WorkMessage
    from encdisagg.server._fields import zmq_url
    from encdisagg.server._json import _check

    encode = msgspec.json.Decoder(EncodeStruct)
    send = msgspec.json.Decoder(SendStruct)
    release = msgspec.json.Decoder(ReleaseStruct)
    part = msgspec.json.Decoder(PartStruct)
    header = msgspec.msgpack.Decoder(HeaderStruct)

    def encode_body(data: bytes) -> object:
        body = encode.decode(data)
        if body.part_idx >= body.num_parts:
            raise BadRequestError("part_idx")
        Modality.parse(body.modality)
        if body.hashes is not None and len(body.hashes) != len(body.mm_items):
            raise BadRequestError("hashes")
        for item in body.mm_items:
            if not isinstance(item, str):
                _check(item)
        return body

    def send_body(data: bytes) -> object:
        body = send.decode(data)
        if body.receive_url is not None:
            zmq_url("receive_url", body.receive_url)
        elif body.buffer_address is None or body.session_id is None or body.prefill_host is None:
            raise BadRequestError("missing")
        elif body.buffer_address > 2**64 - 1:
            raise BadRequestError("buffer_address")
        return body

    def part_answer(data: bytes) -> object:
        answer = part.decode(data)
        if sum(answer.token_counts) != answer.embedding_len or len(answer.grid) != len(
            answer.token_counts
        ):
            raise BadRequestError("sizes")
        return answer

    def push_header(data: bytes) -> object:
        value = header.decode(data)
        if value.part_idx >= value.num_parts or (value.error is None) != (value.status is None):
            raise BadRequestError("header")
        if value.error is None and sum(value.token_counts) != value.shape[0]:
            raise BadRequestError("sizes")
        return value

    return {
        "encode": encode_body,
        "send": send_body,
        "release": lambda data: release.decode(data),
        # The data-parallel IPC decodes with msgspec now: its own decoders are timed.
        "work": WorkMessage.decode,
        "result": ReplyMessage.decode,
        "part": part_answer,
        "header": push_header,
    }


def _old_ipc() -> tuple[Callable[[bytes], object], Callable[[bytes], object]]:
    """The data-parallel IPC's hand-written decoders as they were before msgspec took over
    (``unpack``, then each field checked by hand), kept here as the baseline."""
    from encdisagg.server._dp._ipc import MalformedMessage, ReplyMessage, WorkMessage, unpack

    def fields(value: dict[str, Any], what: str, required: set[str], optional: set[str]) -> None:
        keys = set(value)
        if not required <= keys:
            raise MalformedMessage(f"{what} lacks {sorted(required - keys)}")
        if not keys <= required | optional:
            raise MalformedMessage(f"{what} has unknown fields {sorted(keys - required)}")

    def count(value: object, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MalformedMessage(f"{name} must be an integer >= 0")
        return value

    ops = {"encode", "send", "register", "metadata", "release", "health", "stats"}

    def work(data: bytes) -> object:
        value = unpack(data)
        fields(value, "work message", {"id", "op", "args"}, set())
        op = value["op"]
        if not isinstance(op, str) or op not in ops:
            raise MalformedMessage(f"unknown work op {op!r}")
        if not isinstance(value["args"], dict):
            raise MalformedMessage("args must be a map")
        return WorkMessage(count(value["id"], "id"), op, value["args"])

    def result(data: bytes) -> object:
        value = unpack(data)
        if value.get("kind") != "result":
            raise MalformedMessage("unknown reply kind")
        fields(value, "result message", {"kind", "rank", "id"}, {"value", "error"})
        if ("value" in value) == ("error" in value):
            raise MalformedMessage("a result has either a value or an error")
        rank, call = count(value["rank"], "rank"), count(value["id"], "id")
        return ReplyMessage("result", rank, id=call, value=value.get("value"))

    return work, result


def _old_decoders() -> dict[str, Callable[[bytes], object]]:
    from encdisagg.receiver import PartMetadata
    from encdisagg.server import EncodeBody, ReleaseBody, SendBody
    from encdisagg.server._json import decode_body
    from encdisagg.transfer import decode_header

    work, result = _old_ipc()

    return {
        "encode": lambda data: EncodeBody.from_json(decode_body(data)),
        "send": lambda data: SendBody.from_json(decode_body(data)),
        "release": lambda data: ReleaseBody.from_json(decode_body(data)),
        "work": work,
        "result": result,
        "part": lambda data: PartMetadata.from_json(json.loads(data)),
        # msgspec to a private Struct, then the public dataclass built and checked.
        "header": decode_header,
    }


def _bodies() -> dict[str, tuple[str, bytes, list[bytes]]]:
    """name -> (edge, a valid body, broken bodies both sides must refuse)."""
    image = "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 256).decode()
    encode_small = {"req_id": "req-0001#0", "mm_items": ["https://x/a.png"], "part_idx": 0}
    encode_image = {
        "req_id": "req-0001#0",
        "mm_items": [image, {"url": "https://x/b.png"}],
        "modality": "image",
        "num_parts": 2,
        "part_idx": 1,
    }
    send = {
        "req_id": "req-0001#0",
        "session_id": "10.0.0.2:17001",
        "buffer_address": 1 << 40,
        "prefill_host": "10.0.0.2",
        "embedding_port": 6000,
        "part_idx": 0,
        "embedding_size": 81920,
        "embedding_len": 320,
        "embedding_dim": 128,
    }
    part = {
        "req_id": "req-0001#0",
        "part_idx": 0,
        "embedding_size": 320 * 1536 * 2,
        "embedding_len": 320,
        "embedding_dim": 1536,
        "token_counts": [256, 64],
        "grid": [[1, 32, 32], [1, 16, 16]],
    }
    header = {
        "v": 1,
        "req_id": "req-0001#0",
        "num_parts": 1,
        "part_idx": 0,
        "modality": "image",
        "shape": [320, 1536],
        "dtype": "bfloat16",
        "token_counts": [256, 64],
        "grid": [[1, 32, 32], [1, 16, 16]],
    }
    work = {"id": 17, "op": "encode", "args": encode_small}
    result = {"kind": "result", "rank": 1, "id": 17, "value": {**part, "dtype": "float16"}}

    def js(value: object) -> bytes:
        return json.dumps(value).encode()

    def mp(value: object) -> bytes:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
        return packed

    return {
        "/encode (1 URL)": (
            "encode",
            js(encode_small),
            [
                js({**encode_small, "num_parts": True}),
                js({**encode_small, "extra": 1}),
                js({**encode_small, "req_id": "a b"}),
                js({**encode_small, "part_idx": 1}),
                js({**encode_small, "mm_items": []}),
                js({**encode_small, "num_parts": 2**64}),
                b'{"req_id": "\\ud800", "mm_items": ["a"]}',
            ],
        ),
        "/encode (64 KiB image + URL)": (
            "encode",
            js(encode_image),
            [js({**encode_image, "mm_items": [{"url": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}]})],
        ),
        "/send (Mooncake)": (
            "send",
            js(send),
            [js({**send, "embedding_port": 70000}), js({**send, "buffer_address": "1"})],
        ),
        "/release": ("release", js({"req_id": "req-0001#0"}), [js({"req_id": ""}), js([1])]),
        "IPC work message": (
            "work",
            mp(work),
            [mp({**work, "id": True}), mp({**work, "op": "format"}), mp({**work, "x": 1})],
        ),
        "IPC result message": (
            "result",
            mp(result),
            [mp({"kind": "result", "rank": 0, "id": 1}), mp({**result, "rank": "0"})],
        ),
        "/encode answer (receiver)": (
            "part",
            js(part),
            [js({**part, "part_idx": True}), js({**part, "token_counts": [1]})],
        ),
        "push header (wire)": (
            "header",
            mp(header),
            [mp({**header, "v": 2}), mp({**header, "dtype": "x"}), mp({**header, "y": 0})],
        ),
    }


def _check_same_verdicts(
    bodies: dict[str, tuple[str, bytes, list[bytes]]],
    old: dict[str, Callable[[bytes], object]],
    new: dict[str, Callable[[bytes], object]],
) -> None:
    for name, (edge, valid, broken) in bodies.items():
        old[edge](valid)
        new[edge](valid)
        for body in broken:
            for side, decoders in (("old", old), ("msgspec", new)):
                try:
                    decoders[edge](body)
                except Exception:  # refusing is what is checked
                    continue
                raise AssertionError(f"{side} accepted a broken {name} body: {body[:80]!r}")
    duplicate = b'{"req_id": "a", "req_id": "b"}'
    try:
        old["release"](duplicate)
    except Exception:
        pass
    else:  # pragma: no cover - decode_body refuses duplicates
        raise AssertionError("decode_body accepted a duplicate key")
    print("msgspec keeps the last of duplicate JSON keys:", new["release"](duplicate))


def _time_per_call(decode: Callable[[bytes], object], body: bytes, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        decode(body)
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    options: Options = parse_options(__doc__.splitlines()[0], argv)
    rounds = options.repeats or options.pick(7, 3)
    budget_s = options.pick(200, 20) / 1e3
    old, new = _old_decoders(), _msgspec_decoders()
    bodies = _bodies()
    _check_same_verdicts(bodies, old, new)
    rows: list[dict[str, Any]] = []
    for name, (edge, body, _) in bodies.items():
        per_call = _time_per_call(old[edge], body, 50)
        calls = max(20, int(budget_s / max(per_call, 1e-7)))
        old_us: list[float] = []
        new_us: list[float] = []
        for r in range(rounds):
            order = ((old_us, old), (new_us, new)) if r % 2 == 0 else ((new_us, new), (old_us, old))
            for sink, decoders in order:
                sink.append(_time_per_call(decoders[edge], body, calls) * 1e6)
        row = {
            "body": name,
            "edge": edge,
            "bytes": len(body),
            "calls_per_round": calls,
            "old_us": statistics.median(old_us),
            "msgspec_us": statistics.median(new_us),
            "old_us_rounds": old_us,
            "msgspec_us_rounds": new_us,
        }
        row["speedup"] = row["old_us"] / row["msgspec_us"]
        rows.append(row)
        print(
            f"{name:<30} {len(body):>7} B  project {row['old_us']:8.2f} us  "
            f"msgspec {row['msgspec_us']:8.2f} us  {row['speedup']:5.1f}x"
        )
    heads = [
        headline(
            f"decode {row['body']}: project / msgspec",
            row["speedup"],
            "x",
            note=(
                f"{row['old_us']:.2f} us vs {row['msgspec_us']:.2f} us per body of "
                f"{row['bytes']:,} B (median of {rounds} alternating rounds)"
            ),
        )
        for row in rows
    ]
    data = {"rounds": rounds, "msgspec": msgspec.__version__, "rows": rows, "headline": heads}
    write_json(options, "decoders", data)

    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        names = [row["body"] for row in rows]
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [r["old_us"] for r in rows], 0.4, label="project")
        ax.barh([y - 0.2 for y in ys], [r["msgspec_us"] for r in rows], 0.4, label="msgspec")
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("us per decoded body (log)")
        ax.legend(fontsize=7)
        fig.suptitle("Strict decoding: the project's decoders vs msgspec Structs from the bytes")

    write_png(options, "decoders", draw, size=(9, 4.2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
