"""``nox -s interop``: real ``encdisagg serve --wire sglang`` servers, driven by SGLang's code.

Starts one server per transfer (``zmq``: SGLang's two ZMQ modes; ``mooncake``) and worker
class (asyncio, trio), computes the local encodes the checks compare against, runs
``sglang_client.py`` under the SGLang 0.5.20 venv's python, and prints the matrix
(mode x worker class x transport). Exits non-zero if any row failed.

The venv: ``$ENCDISAGG_PEER_VENV`` if set, else the default of the build script
``../shared/peer/build_venv020.sh`` (which the nox session runs first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import anyio
import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER = ROOT.parent / "shared" / "peer"
#: Where build_venv020.sh puts the venv when given no folder.
DEFAULT_PEER_VENV = Path.home() / ".cache" / "encdisagg-peer-venv020"
TRANSFERS = ("zmq", "mooncake")
#: The servers of each transfer: a label (a column of the matrix) and its ``serve`` flags.
WORKER_CLASSES: dict[str, tuple[str, ...]] = {
    "asyncio": ("--worker-class", "asyncio"),
    "trio": ("--worker-class", "trio"),
    "asyncio dp=2": ("--worker-class", "asyncio", "--dp", "2"),
}
#: Transport -> (extra ``serve`` flags, the line prefix its URL is announced with). A
#: transport added here gets its URL into the client's ``--servers`` map, for its rows of
#: ``sglang_client.CHECKS``.
TRANSPORTS: dict[str, tuple[tuple[str, ...], str]] = {
    "http": ((), "encdisagg serving on "),
}


def peer_python() -> Path:
    venv = Path(os.environ.get("ENCDISAGG_PEER_VENV") or DEFAULT_PEER_VENV)
    python = venv / "bin" / "python"
    if not python.is_file():
        sys.exit(f"no SGLang 0.5.20 venv at {venv}: run ../shared/peer/build_venv020.sh first")
    return python


def start_server(stack: ExitStack, transfer: str, worker_class: str, logs: Path) -> dict[str, str]:
    """Start ``encdisagg serve --wire sglang``; its URL per transport once it announced them."""
    name = worker_class.replace(" ", "-").replace("=", "")
    log = stack.enter_context((logs / f"serve-{transfer}-{name}.log").open("w"))
    flags = [flag for extra, _ in TRANSPORTS.values() for flag in extra]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "encdisagg",
            "serve",
            "--wire",
            "sglang",
            "--port",
            "0",
            "--transfer",
            transfer,
            *WORKER_CLASSES[worker_class],
            "--log-level",
            "warning",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "MC_FORCE_TCP": "1"},
    )
    stack.callback(_stop, process)
    assert process.stdout is not None
    urls: dict[str, str] = {}
    for line in process.stdout:
        for transport, (_, prefix) in TRANSPORTS.items():
            if line.startswith(prefix):
                urls[transport] = line.removeprefix(prefix).strip()
        if len(urls) == len(TRANSPORTS):
            return urls
    sys.exit(f"serve ({transfer}, {worker_class}) exited: see {log.name}")


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def wait_ready(url: str) -> None:
    with httpx.Client(timeout=5) as client:
        for _ in range(600):
            try:
                if client.get(f"{url}/health/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            anyio.run(anyio.sleep, 0.2)
    sys.exit(f"{url} never became ready")


def write_inputs(folder: Path) -> None:
    """Two images and their local encodes (our own Encoder, our own wire)."""
    from encdisagg import Encoder, EncoderConfig, EncodeRequest, ZmqDestination
    from encdisagg.transfer import ZmqReceiver

    images = [_png(224, 224, seed=11), _png(224, 168, seed=12)]

    async def encode() -> dict[str, object]:
        files, grids, dtype, hidden = [], [], "", 0
        async with Encoder(EncoderConfig()) as encoder, ZmqReceiver() as receiver:
            for index, image in enumerate(images):
                result = await encoder.encode(EncodeRequest(f"reference-{index}", [image]))
                await encoder.send(f"reference-{index}", ZmqDestination(receiver.url))
                part = await receiver.receive()
                assert part.tensor is not None
                name = f"reference-{index}.bin"
                (folder / name).write_bytes(part.tensor.numpy().tobytes())
                files.append(name)
                grids += [list(row) for row in result.grid]
                dtype, hidden = result.dtype, result.hidden_size
        return {
            "images": images,
            "reference_files": files,
            "grids": grids,
            "dtype": dtype,
            "hidden": hidden,
        }

    (folder / "inputs.json").write_text(json.dumps(anyio.run(encode)))


def _png(width: int, height: int, seed: int) -> str:
    """A real PNG data URL with a gradient; seeds give different pixels."""
    import base64
    import io

    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 7 + seed) % 256, (y * 5 + 3 * seed) % 256, (x + y + seed) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# --- gRPC: the SglangEncoder service of ``serve --grpc-port`` ------------------------------

#: SGLang's gRPC receiver imports grpcio and smg-grpc-proto, but its venv is built without
#: its dependencies (``--no-deps``). They go into a folder beside the venv, at the versions of
#: our own ``grpc`` extra, onto the client's path only; the venv stays as built.
GRPC_PACKAGES = ("grpcio", "protobuf", "smg-grpc-proto")
TRANSPORTS["grpc"] = (("--grpc-port", "0"), "encdisagg gRPC serving on ")


def grpc_packages(python: Path) -> str:
    """The folder holding :data:`GRPC_PACKAGES` for the venv of ``python`` (installed with
    its pip on first use, or when our versions changed)."""
    from importlib.metadata import version

    venv = python.parent.parent
    folder = venv.with_name(venv.name + "-grpc")
    pins = "\n".join(f"{name}=={version(name)}" for name in GRPC_PACKAGES)
    stamp = folder / "pins.txt"
    if not stamp.is_file() or stamp.read_text() != pins:
        install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--upgrade"]
        subprocess.run([*install, "--target", str(folder), *pins.split()], check=True)
        stamp.write_text(pins)
    return str(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep the logs and inputs in this folder")
    args = parser.parse_args()
    python = peer_python()
    with ExitStack() as stack:
        folder = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        servers: dict[str, dict[str, dict[str, str]]] = {}
        for transfer in TRANSFERS:
            for worker_class in WORKER_CLASSES:
                urls = start_server(stack, transfer, worker_class, folder)
                servers.setdefault(transfer, {})[worker_class] = urls
        write_inputs(folder)
        for by_class in servers.values():
            for transports in by_class.values():
                wait_ready(transports["http"])
        env = {**os.environ, "MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp"}
        if (PEER / "shims").is_dir():
            env["ENCDISAGG_PEER_SHIMS"] = str(PEER / "shims")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [grpc_packages(python), env.get("PYTHONPATH")])
        )
        client = subprocess.run(
            [
                str(python),
                str(HERE / "sglang_client.py"),
                "--inputs",
                str(folder),
                "--servers",
                json.dumps(servers),
            ],
            stdout=subprocess.PIPE,
            stderr=stack.enter_context((folder / "client.log").open("w")),
            text=True,
            env=env,
            timeout=1200,
        )
    rows = [json.loads(line) for line in client.stdout.splitlines() if line.startswith("{")]
    print(f"{'mode':<18} {'worker class':<14} {'transport':<10} outcome")
    for row in rows:
        print(
            f"{row['mode']:<18} {row['worker_class']:<14} {row['transport']:<10} "
            f"{row['outcome']}: {row['detail']}"
        )
    if not rows:
        print("the SGLang client printed no rows; see client.log")
    return client.returncode or (0 if rows else 1)


if __name__ == "__main__":
    sys.exit(main())
