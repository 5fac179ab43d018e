"""``nox -s interop_vllm``: real ``encdisagg serve --wire vllm`` encoders, read by vLLM's code.

Writes the PD's model folders (the tiny Qwen2-VL and Qwen3-VL configs with a small tokenizer
and the processors' settings; no weights: vLLM's connector paths never run the model),
computes the local encodes the checks compare against (our own ``Encoder``, bfloat16),
starts one server per connector (``example``: shared storage; ``mooncake``: the push) and
server kind (asyncio, trio, ``--dp 2``, a Qwen3-VL one, and a Mooncake one the matrix kills),
runs ``vllm_consumer.py`` under the vLLM venv's python, and prints the matrix. Exits non-zero
if any row failed. ``--self-check`` starts no server: it runs the consumer harness against
vLLM's own Example producer and a minimal Mooncake producer.

The venv: ``$ENCDISAGG_VLLM_PEER_VENV`` if set, else the default of the build script
``../shared/peer/build_venv_vllm.sh`` (which the nox session runs first).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
from run import PEER, _png, _stop, wait_ready

HERE = Path(__file__).resolve().parent
#: Where build_venv_vllm.sh puts the venv when given no folder.
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "encdisagg-vllm-peer-venv"
DTYPE = "bfloat16"
#: The PD's model folders: name -> our built-in model of the same family and weights.
MODELS = {"qwen2-vl": "tiny", "qwen3-vl": "tiny-qwen3-vl"}
#: Each connector's ``serve`` flags (``{storage}``: the server's own shared folder).
CONNECTOR_FLAGS: dict[str, tuple[str, ...]] = {
    "example": ("--vllm-connector", "example", "--vllm-storage-path", "{storage}"),
    "mooncake": ("--vllm-connector", "mooncake", "--transfer", "mooncake"),
}
#: Server label -> (model, extra ``serve`` flags, connectors it runs for).
SERVERS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "asyncio": ("qwen2-vl", ("--worker-class", "asyncio"), ("example", "mooncake")),
    "trio": ("qwen2-vl", ("--worker-class", "trio"), ("example", "mooncake")),
    "asyncio dp=2": (
        "qwen2-vl",
        ("--worker-class", "asyncio", "--dp", "2"),
        ("example", "mooncake"),
    ),
    "qwen3-vl": ("qwen3-vl", ("--worker-class", "asyncio"), ("example", "mooncake")),
    # Killed by the matrix mid-push: its own process group, so the kill takes all of it.
    "victim": ("qwen2-vl", ("--worker-class", "asyncio"), ("mooncake",)),
}
#: Special tokens of the tiny models' 512-token vocabulary (see encdisagg.models' configs).
SPECIAL_TOKENS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|image_pad|>": 500,
    "<|video_pad|>": 501,
    "<|vision_start|>": 502,
    "<|vision_end|>": 503,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def vllm_python() -> Path:
    venv = Path(os.environ.get("ENCDISAGG_VLLM_PEER_VENV") or DEFAULT_VLLM_VENV)
    python = venv / "bin" / "python"
    if not python.is_file():
        sys.exit(f"no vLLM venv at {venv}: run ../shared/peer/build_venv_vllm.sh first")
    return python


def write_model(name: str, folder: Path) -> None:
    """A PD model folder: the full config of our tiny model, its processors' settings and a
    word-level tokenizer whose special tokens sit at the config's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from encdisagg.models import load_model, tiny_qwen2_vl_config, tiny_qwen3_vl_config

    builtin = MODELS[name]
    load_model(builtin).save_pretrained(folder)
    (folder / "model.safetensors").unlink(missing_ok=True)
    config = tiny_qwen3_vl_config() if name == "qwen3-vl" else tiny_qwen2_vl_config()
    config.architectures = [type(config).__name__.replace("Config", "ForConditionalGeneration")]
    config.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(512) if i not in SPECIAL_TOKENS.values()}
    tokenizer = Tokenizer(models.WordLevel({**vocab, **SPECIAL_TOKENS}, unk_token="w3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = [token for token, id_ in SPECIAL_TOKENS.items() if id_ >= 500]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="w3",
        additional_special_tokens=extra,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def _gif(frames: int) -> str:
    """A small animated GIF data URL (a video item)."""
    from PIL import Image

    images = [Image.new("RGB", (84, 56), (40 * n % 256, 90, 160)) for n in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, "GIF", save_all=True, append_images=images[1:], duration=250)
    return "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()


def write_inputs(folder: Path) -> None:
    """Model folders, media and their local encodes (our own Encoder, one item each)."""
    import torch

    from encdisagg import Encoder, EncoderConfig, EncodeRequest, ZmqDestination
    from encdisagg.transfer import ZmqReceiver

    media = {
        "image0": _png(224, 224, seed=11),
        "image1": _png(224, 168, seed=12),
        "video": _gif(4),
        "bad": "data:image/png;base64,AAAA",
    }
    wanted = {"qwen2-vl": ("image0", "image1", "video"), "qwen3-vl": ("image0",)}

    async def encode(name: str, model: dict[str, Any]) -> dict[str, Any]:
        reference: dict[str, Any] = {}
        config = EncoderConfig(model=MODELS[name], dtype=DTYPE)
        async with Encoder(config) as encoder, ZmqReceiver() as receiver:
            for item in wanted[name]:
                modality = "video" if item == "video" else "image"
                req = f"{name}-{item}"
                result = await encoder.encode(EncodeRequest(req, [media[item]], modality))
                await encoder.send(req, ZmqDestination(receiver.url))
                part = await receiver.receive()
                assert part.tensor is not None
                file = f"{req}.bin"
                (folder / file).write_bytes(
                    part.tensor.contiguous().view(torch.uint8).numpy().tobytes()
                )
                shape = [result.num_tokens, result.hidden_size]
                reference[item] = {"file": file, "dtype": result.dtype, "shape": shape}
                if item == "image0":
                    model["grid_image0"] = list(result.grid[0])
        return reference

    models: dict[str, dict[str, Any]] = {}
    reference = {}
    for name in MODELS:
        models[name] = {"folder": str(folder / name), "dtype": DTYPE}
        write_model(name, folder / name)
        reference[name] = anyio.run(encode, name, models[name])
    inputs = {"models": models, "media": media, "reference": reference}
    (folder / "inputs.json").write_text(json.dumps(inputs))


def start_server(stack: ExitStack, connector: str, label: str, folder: Path) -> dict[str, Any]:
    """Start ``encdisagg serve --wire vllm``; its URL once announced."""
    model, extra, _ = SERVERS[label]
    name = f"{connector}-{label}".replace(" ", "-").replace("=", "")
    storage = folder / "storage" / name
    flags = [flag.format(storage=storage) for flag in CONNECTOR_FLAGS[connector]]
    log = stack.enter_context((folder / f"serve-{name}.log").open("w"))
    command = [sys.executable, "-m", "encdisagg", "serve", "--wire", "vllm", "--port", "0"]
    command += ["--model", MODELS[model], "--dtype", DTYPE, "--log-level", "warning"]
    command += [*flags, *extra]
    if connector == "mooncake":
        command += ["--mooncake-protocol", "tcp"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "MC_FORCE_TCP": "1"},
        start_new_session=label == "victim",
    )
    stack.callback(_stop, process)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("encdisagg serving on "):
            url = line.removeprefix("encdisagg serving on ").strip()
            server = {"label": label, "model": model, "url": url, "pid": process.pid}
            if connector == "example":
                server["storage"] = str(storage)
            return server
    sys.exit(f"serve ({connector}, {label}) exited: see {log.name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep the logs and inputs in this folder")
    parser.add_argument("--self-check", action="store_true", help="no servers; see above")
    parser.add_argument("--connectors", default="example,mooncake", help="comma-separated")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated labels")
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    args = parser.parse_args()
    python = vllm_python()
    with ExitStack() as stack:
        folder = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        servers: dict[str, list[dict[str, Any]]] = {}
        if not args.self_check:
            for connector in args.connectors.split(","):
                for label, (_, _, connectors) in SERVERS.items():
                    if connector in connectors and label in args.servers.split(","):
                        server = start_server(stack, connector, label, folder)
                        servers.setdefault(connector, []).append(server)
        write_inputs(folder)
        for by_label in servers.values():
            for server in by_label:
                wait_ready(server["url"])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_HOST_IP="127.0.0.1", MC_FORCE_TCP="1")
        if (PEER / "shims").is_dir():
            # The venv's CPU workaround for torchvision (see ../shared/peer/README.md).
            env["VLLM_PEER_TV_SHIM"] = str(PEER / "shims")
        command = [str(python), str(HERE / "vllm_consumer.py"), "--inputs", str(folder)]
        command += ["--self-check"] if args.self_check else ["--servers", json.dumps(servers)]
        command += ["--rows", args.rows]
        consumer = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=stack.enter_context((folder / "consumer.log").open("w")),
            text=True,
            env=env,
            timeout=1800,
        )
    rows = [json.loads(line) for line in consumer.stdout.splitlines() if line.startswith("{")]
    print(f"{'row':<24} {'connector':<10} {'server':<13} {'s':>5}  outcome")
    for row in rows:
        print(
            f"{row['row']:<24} {row['connector']:<10} {row['server']:<13} "
            f"{row.get('seconds', ''):>5}  {row['outcome']}: {row['detail']}"
        )
    if not rows:
        print("the vLLM consumer printed no rows; see consumer.log (--keep DIR keeps it)")
    return consumer.returncode or (0 if rows else 1)


if __name__ == "__main__":
    sys.exit(main())
