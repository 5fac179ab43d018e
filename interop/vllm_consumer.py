"""vLLM's own consumer code against real ``encdisagg serve --wire vllm`` encoders.

Runs under the vLLM venv's python (``vllm_run.py`` starts it and explains the inputs). Each
row sends a chat request through the proxy's steps (``vllm_proxy.py``) to an encoder, then
the rewritten request through vLLM's PD path (``vllm_pd.py``: its renderer, scheduler, EC
connector and the model runner's EC hook), and compares each assembled encoder-cache tensor
with the local encode byte for byte. ``--self-check`` runs the harness against producers
that are not the encoder (``vllm_producers.py``), to show it works on its own.

Output: one JSON object per row on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm_pd import ConsumerPD, ConsumerSettings, Outcome
from vllm_proxy import Proxy

#: Bound on one PD request reaching the scheduler's running queue.
PD_DEADLINE_S = 60.0
#: The small push bound of the row that kills an encoder mid-push.
KILL_PUSH_WAIT_S = 3.0


@dataclass
class Inputs:
    """What ``vllm_run.py`` hands over (``inputs.json`` and the reference files)."""

    folder: Path
    models: dict[str, dict[str, str]]
    media: dict[str, str]
    #: model -> media name -> (dtype, shape, bytes) of the local encode.
    reference: dict[str, dict[str, tuple[str, list[int], bytes]]]

    @classmethod
    def load(cls, folder: Path) -> Inputs:
        meta = json.loads((folder / "inputs.json").read_text())
        reference = {
            model: {
                name: (entry["dtype"], entry["shape"], (folder / entry["file"]).read_bytes())
                for name, entry in by_name.items()
            }
            for model, by_name in meta["reference"].items()
        }
        return cls(folder, meta["models"], meta["media"], reference)


def _free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it (the TP shards')."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


@dataclass
class Target:
    """One encoder server under one connector, and the PDs its rows open (one per setting;
    each server gets its own, so no row reads what a row of another server delivered)."""

    connector: str
    server: dict[str, Any]
    inputs: Inputs
    pds: dict[tuple[Any, ...], ConsumerPD] = field(default_factory=dict)

    def pd(self, shards: int = 1, push_wait_s: float = 30.0) -> ConsumerPD:
        model = self.server["model"]
        key = (model, self.connector, self.server["label"], shards, push_wait_s)
        if key not in self.pds:
            storage = self.server.get("storage")
            self.pds[key] = ConsumerPD(
                ConsumerSettings(
                    model=Path(self.inputs.models[model]["folder"]),
                    connector=self.connector,
                    dtype=self.inputs.models[model]["dtype"],
                    storage_path=Path(storage) if storage else None,
                    ec_port=_free_ports(shards) if self.connector == "mooncake" else 0,
                    shards=shards,
                    push_wait_timeout_s=push_wait_s,
                )
            )
        return self.pds[key]

    def proxy(self, pd: ConsumerPD, encoders: int = 1) -> Proxy:
        zmq = pd.consumer_zmq if self.connector == "mooncake" else None
        return Proxy([self.server["url"]] * encoders, zmq, self.server["model"])


def _part(kind: str, url: str, unique: bool) -> dict[str, Any]:
    part: dict[str, Any] = {"type": kind, kind: {"url": url}}
    if unique:
        # A client-given uuid, passed on by the proxy: fresh identifiers per row, so no
        # row is served from a file or resident tensor an earlier row left behind.
        part["uuid"] = uuid.uuid4().hex
    return part


def _body(parts: list[dict[str, Any]]) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "describe"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def _settle(pd: ConsumerPD) -> tuple[int, int]:
    """Step until the consumer holds no reservation (bounded); (reservations, arena bytes)."""
    for _ in range(200):
        if pd.reservations() == 0:
            break
        pd.step()
        time.sleep(0.01)
    return pd.reservations(), pd.arena_in_use()


def roundtrip(
    target: Target, names: list[str], *, encoders: int = 1, shards: int = 1, unique: bool = True
) -> str:
    """Proxy, PD, compare: the common row. ``names`` are media of ``inputs.media``."""
    pd = target.pd(shards)
    kinds = {"video": "video_url"}
    parts = [_part(kinds.get(n, "image_url"), target.inputs.media[n], unique) for n in names]
    started = time.monotonic()
    proxied = target.proxy(pd, encoders).handle(_body(parts))
    encode_s = time.monotonic() - started
    assert proxied.error is None, f"encoder answered {proxied.error}"
    assert proxied.pd_body is not None
    # The proxy batches the images bound for one encoder; the rest go one per request.
    expected_calls = encoders if names != ["video"] else 1
    assert proxied.encoder_requests == min(expected_calls, len(names)), proxied.encoder_requests
    request = pd.submit(proxied.pd_body)
    identifiers = [feature.identifier for feature in request.mm_features]
    assert identifiers == proxied.keys, f"identifiers {identifiers} != {proxied.keys}"
    outcome = pd.run(request, PD_DEADLINE_S)
    assert outcome.scheduled, f"PD request not scheduled: {outcome.finish_reason}"
    assert not outcome.local_encodes, f"PD would encode {outcome.local_encodes} itself"
    reference = target.inputs.reference[target.server["model"]]
    shapes = []
    for identifier, name in zip(identifiers, names, strict=True):
        dtype, shape, expected = reference[name]
        tensors = outcome.caches[identifier]
        assert len(tensors) == shards, f"{len(tensors)} of {shards} shards hold {name}"
        for tensor in tensors:
            assert str(tensor.dtype) == f"torch.{dtype}", f"{name}: dtype {tensor.dtype}"
            assert list(tensor.shape) == shape, f"{name}: shape {list(tensor.shape)} != {shape}"
            got = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            assert got == expected, f"{name}: bytes differ from the local encode"
        shapes.append("x".join(map(str, shape)))
    pd.finish(request)
    detail = (
        f"{len(names)} item(s) [{', '.join(shapes)} {dtype}] byte-equal on {shards} shard(s), "
        f"{proxied.encoder_requests} encoder request(s); encode {encode_s * 1000:.0f} ms, "
        f"PD {outcome.waited_s * 1000:.0f} ms"
    )
    if target.connector == "mooncake":
        reservations, arena = _settle(pd)
        assert reservations == 0, f"{reservations} reservation(s) left on the consumer"
        detail += f"; reservations left 0 (arena {arena} B kept resident by vLLM)"
    return detail


def one_image(target: Target) -> str:
    return roundtrip(target, ["image0"], unique=False)


def images_one_request(target: Target) -> str:
    return roundtrip(target, ["image0", "image1"])


def request_per_image(target: Target) -> str:
    return roundtrip(target, ["image0", "image1"], encoders=2)


def video(target: Target) -> str:
    return roundtrip(target, ["video"])


def tp2(target: Target) -> str:
    return roundtrip(target, ["image0"], shards=2)


def bad_image(target: Target, beside_good: bool) -> str:
    """An undecodable image fails the request with the encoder's error; with Mooncake, no
    reservation stays on the consumer (also none of a good item encoded beside it)."""
    pd = target.pd()
    parts = [_part("image_url", target.inputs.media["image0"], True)] if beside_good else []
    parts.append(_part("image_url", target.inputs.media["bad"], True))
    proxied = target.proxy(pd).handle(_body(parts))
    assert proxied.error is not None, "an undecodable image was answered 200"
    status, text = proxied.error
    assert 400 <= status < 500, f"encoder answered {status}"
    detail = f"encoder answered {status} ({text[:100]!r}); the PD never got the request"
    if target.connector == "mooncake":
        reservations, _ = _settle(pd)
        states = pd.reservation_states()
        assert reservations == 0, f"reservation(s) left on the consumer: {states}"
        detail += "; reservations left 0"
    return detail


def killed_mid_push(target: Target) -> str:
    """The encoder is killed after the consumer reserved and before it answers: the PD,
    holding the request already (as it would behind an encoder that answers before its
    push lands), fails it within ``push_wait_timeout_s``."""
    pd = target.pd(push_wait_s=KILL_PUSH_WAIT_S)
    reserved, killed = threading.Event(), threading.Event()
    manager = pd.workers[0]._worker._reservations  # type: ignore[attr-defined]
    original = manager.reserve

    def reserve(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        reserved.set()
        killed.wait(30)  # the encoder dies before this reservation is answered
        return result

    manager.reserve = reserve
    part = _part("image_url", target.inputs.media["image0"], True)
    proxy = target.proxy(pd)
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(proxy.handle(_body([part]))))
    thread.start()
    try:
        assert reserved.wait(60), "the encoder never reserved"
        os.killpg(target.server["pid"], signal.SIGKILL)
    finally:
        killed.set()
        manager.reserve = original
    thread.join(60)
    (proxied,) = answer
    assert proxied.error is not None, "the proxy got an answer from a killed encoder"
    assert proxied.error[0] == 502, proxied.error
    # The PD request as the proxy would have rewritten it, from the local encode's grid.
    key = part["uuid"]
    grid = target.inputs.models[target.server["model"]]["grid_image0"]
    entry = {"modality": "image", "item_indices": [0], "metadata": {"image_grid_thw": grid}}
    rewritten = {"type": "image_embeds", "image_embeds": entry["metadata"], "uuid": key}
    body = _body([rewritten])
    (tid,) = proxied.transfer_ids
    body["ec_transfer_params"] = {"ec_items": [{"mm_hash": key, "transfer_id": tid}], key: entry}
    request = pd.submit(body)
    outcome: Outcome = pd.run(request, KILL_PUSH_WAIT_S * 10)
    assert not outcome.scheduled, "the PD ran the request without its embedding"
    assert outcome.finish_reason is not None, "the PD request never finished"
    assert "error" in outcome.finish_reason.lower(), outcome.finish_reason
    left, _ = _settle(pd)
    states = pd.reservation_states()
    return (
        f"proxy saw 502; PD failed the request ({outcome.finish_reason}) after "
        f"{outcome.waited_s:.2f} s (push_wait_timeout_s {KILL_PUSH_WAIT_S}); "
        f"reservations left on the consumer: {left} {states} (vLLM frees a reservation "
        "being written only when its writer completes or abandons it)"
    )


#: (row, connectors, server labels it runs against, check).
ROWS: list[tuple[str, tuple[str, ...], tuple[str, ...], Callable[[Target], str]]] = [
    ("one image", ("example", "mooncake"), ("asyncio", "trio", "asyncio dp=2"), one_image),
    (
        "images, one request",
        ("example", "mooncake"),
        ("asyncio", "trio", "asyncio dp=2"),
        images_one_request,
    ),
    (
        "one request per image",
        ("example", "mooncake"),
        ("asyncio", "trio", "asyncio dp=2"),
        request_per_image,
    ),
    ("video", ("example", "mooncake"), ("asyncio", "trio"), video),
    ("qwen3-vl deepstack", ("example", "mooncake"), ("qwen3-vl",), one_image),
    ("TP=2 consumer", ("mooncake",), ("asyncio", "trio", "asyncio dp=2"), tp2),
    (
        "undecodable image",
        ("example", "mooncake"),
        ("asyncio", "trio"),
        lambda target: bad_image(target, beside_good=False),
    ),
    (
        "undecodable + good image",
        ("example", "mooncake"),
        ("asyncio", "trio"),
        lambda target: bad_image(target, beside_good=True),
    ),
    ("encoder killed mid-push", ("mooncake",), ("victim",), killed_mid_push),
]


# --- the harness on its own: producers that are not the encoder ---------------------------


def self_check(inputs: Inputs) -> list[dict[str, str]]:
    """The PD path against vLLM's own Example producer and a minimal Mooncake producer."""
    from vllm_producers import example_save, mooncake_push

    model = inputs.models["qwen2-vl"]
    folder, grid = Path(model["folder"]), model["grid_image0"]
    rows = []

    def body(key: str, tid: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"modality": "image", "item_indices": [0]}
        entry["metadata"] = {"image_grid_thw": grid}
        item = {"mm_hash": key, **({"transfer_id": tid} if tid else {})}
        parts = [{"type": "image_embeds", "image_embeds": entry["metadata"], "uuid": key}]
        return {**_body(parts), "ec_transfer_params": {"ec_items": [item], key: entry}}

    def check(name: str, run: Callable[[], str]) -> None:
        try:
            rows.append({"row": name, "outcome": "pass", "detail": run()})
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            rows.append({"row": name, "outcome": "FAIL", "detail": f"{type(exc).__name__}: {exc}"})

    rows_count = grid[0] * grid[1] * grid[2] // 4
    tensor = torch.randn(rows_count, 64).to(getattr(torch, model["dtype"]))

    def example() -> str:
        storage = inputs.folder / "self-check-store"
        pd = ConsumerPD(ConsumerSettings(folder, "example", model["dtype"], storage))
        try:
            key = uuid.uuid4().hex
            example_save(folder, storage, key, tensor)
            request = pd.submit(body(key, None))
            outcome = pd.run(request, PD_DEADLINE_S)
            assert outcome.scheduled, outcome
            assert not outcome.local_encodes, outcome
            assert torch.equal(outcome.caches[key][0], tensor)
            took = outcome.waited_s * 1000
            return f"vLLM's ECExampleConnector producer -> consumer byte-equal, PD {took:.0f} ms"
        finally:
            pd.close()

    def mooncake(shards: int) -> str:
        settings = ConsumerSettings(folder, "mooncake", model["dtype"], None, _free_ports(shards))
        settings.shards, settings.push_wait_timeout_s = shards, KILL_PUSH_WAIT_S
        pd = ConsumerPD(settings)
        try:
            key, tid = uuid.uuid4().hex, uuid.uuid4().hex
            mooncake_push(pd.consumer_zmq, [(tid, key, tensor)])
            request = pd.submit(body(key, tid))
            outcome = pd.run(request, PD_DEADLINE_S)
            assert outcome.scheduled, outcome
            assert not outcome.local_encodes, outcome
            assert len(outcome.caches[key]) == shards
            assert all(torch.equal(t, tensor) for t in outcome.caches[key])
            pd.finish(request)
            left, _ = _settle(pd)
            assert left == 0, f"{left} reservations left"
            silent = pd.submit(body(uuid.uuid4().hex, uuid.uuid4().hex))
            failed = pd.run(silent, KILL_PUSH_WAIT_S * 10)
            assert not failed.scheduled
            assert failed.finish_reason is not None
            return (
                f"minimal producer -> {shards} shard(s) byte-equal, reservations left 0; "
                f"no push: failed ({failed.finish_reason}) after {failed.waited_s:.2f} s"
            )
        finally:
            pd.close()

    check("example", example)
    check("mooncake", lambda: mooncake(1))
    check("mooncake TP=2", lambda: mooncake(2))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, required=True, help="folder written by vllm_run.py")
    parser.add_argument("--servers", default="{}", help='JSON: {"<connector>": [server, ...]}')
    parser.add_argument("--self-check", action="store_true", help="no encoders: see above")
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    args = parser.parse_args()
    inputs = Inputs.load(args.inputs)
    if args.self_check:
        rows = self_check(inputs)
        for row in rows:
            print(json.dumps({"connector": "-", "server": "self-check", **row}), flush=True)
        return 0 if all(row["outcome"] == "pass" for row in rows) else 1
    servers: dict[str, list[dict[str, Any]]] = json.loads(args.servers)
    failed = 0
    for connector, by_server in servers.items():
        for server in by_server:
            target = Target(connector, server, inputs)
            for name, connectors, labels, check in ROWS:
                if connector not in connectors or server["label"] not in labels:
                    continue
                if args.rows not in name:
                    continue
                result = {"row": name, "connector": connector, "server": server["label"]}
                started = time.monotonic()
                try:
                    result.update(outcome="pass", detail=check(target))
                except Exception as exc:
                    failed += 1
                    result.update(outcome="FAIL", detail=f"{type(exc).__name__}: {exc}")
                    traceback.print_exc(file=sys.stderr)
                result["seconds"] = f"{time.monotonic() - started:.1f}"
                print(json.dumps(result), flush=True)
            for pd in target.pds.values():
                pd.close()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Mooncake's and vLLM's background threads are not all daemons; leave without them.
    os._exit(code)
