"""The device paths: KV sections copied into device memory, the device tier, and a prefix
imported into the reference engine layer by layer, on a GPU.

Three measurements, each against a limit measured in the same run on the same device:

- copy: every K and V section of a 64 MiB container (32 layers, 8 KV heads of 128, float16)
  made a device tensor with ``kvsp.tensors.tensor_from_section`` (a pinned staging buffer and a
  non-blocking copy per section), against one copy of the same octets from a tensor already in
  pinned memory (the limit: the DMA alone) and from pageable memory (what a plain ``.to()``
  gets). Target: ours / pinned limit >= 0.7.
- device tier: ``DeviceTier.prepare`` of 64 blocks of 2 MiB (a Llama-3-8B block of 16 tokens),
  against the pinned limit for the same octets.
- import: a prefix of ``--prefix`` tokens on a 12-layer model (hidden 768, 4 KV heads) prefilled
  by engine A and exported as containers; engine B on the device computes the next-token
  logits (1) by recomputing the prefix, (2) from the containers imported at once, (3) from the
  containers arriving layer by layer on another thread while the forward pass runs. The logits of
  (2) and (3) must equal A's own bit for bit; (1) is within the batched-recompute tolerance.
  Target: loaded / recomputed < 1.

    .venv/bin/python bench/bench_device.py [--device cuda] [--prefix 2048] [--repeat 5]

Without CUDA it says so and measures nothing (``--device cpu`` runs the same code on the CPU,
which shows the script works but says nothing about a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")

import torch  # noqa: E402

from kvsp.container import RAW_CODEC, decode, encode  # noqa: E402
from kvsp.tensors import tensor_from_section  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, "float16"
TOKEN_OCTETS = 2 * KV_HEADS * HEAD_DIM * 2  # K and V of one token in one layer, float16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(repeat: int, work, device: torch.device) -> float:
    """The fastest of ``repeat`` runs of ``work``, in seconds, the device drained each time."""
    times = []
    for _ in range(repeat):
        sync(device)
        started = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - started)
    return min(times)


def container_of(tokens: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    section = tokens * KV_HEADS * HEAD_DIM * 2
    sections = [
        (
            torch.randint(0, 256, (section,), dtype=torch.uint8, generator=generator)
            .numpy()
            .tobytes(),
            torch.randint(0, 256, (section,), dtype=torch.uint8, generator=generator)
            .numpy()
            .tobytes(),
        )
        for _ in range(LAYERS)
    ]
    return encode(RAW_CODEC, 0, tokens, sections)


def limits(octets: int, device: torch.device, repeat: int) -> tuple[float, float]:
    """Seconds to copy ``octets`` to the device from pinned and from pageable host memory."""
    pageable = torch.empty(octets, dtype=torch.uint8)
    if device.type != "cuda":  # .to() of a CPU tensor to the CPU copies nothing
        copy_s = best_of(repeat, pageable.clone, device)
        return copy_s, copy_s
    pinned = pageable.pin_memory()
    pinned_s = best_of(repeat, lambda: pinned.to(device, non_blocking=True), device)
    pageable_s = best_of(repeat, lambda: pageable.to(device), device)
    return pinned_s, pageable_s


def line(label: str, seconds: float, octets: int, limit_s: float) -> None:
    rate = octets / seconds / 1e9
    print(
        f"  {label:<44} {seconds * 1000:9.2f} ms {rate:7.2f} GB/s  ratio {limit_s / seconds:5.2f}"
    )


def bench_copy(device: torch.device, repeat: int) -> None:
    tokens = 512  # 64 MiB over 32 layers
    container = decode(container_of(tokens, 1))
    octets = tokens * TOKEN_OCTETS * LAYERS
    pinned_s, pageable_s = limits(octets, device, repeat)

    def ours():
        for layer in range(LAYERS):
            for section in container.layer(layer):
                tensor_from_section(section, DTYPE, KV_HEADS, HEAD_DIM, device)

    print(f"copy: a container of {octets / 2**20:.0f} MiB, {LAYERS} layers, to {device}")
    line("one copy from pinned memory (the limit)", pinned_s, octets, pinned_s)
    line("one copy from pageable memory", pageable_s, octets, pinned_s)
    line("tensor_from_section, every section", best_of(repeat, ours, device), octets, pinned_s)


def bench_device_tier(device: torch.device, repeat: int) -> None:
    from workers.tiers import DeviceTier, Geometry

    block_tokens, blocks = 16, 64
    geometry = Geometry(LAYERS, KV_HEADS, HEAD_DIM, DTYPE, block_tokens)
    containers = [decode(container_of(block_tokens, 100 + i)) for i in range(blocks)]
    octets = blocks * block_tokens * TOKEN_OCTETS * LAYERS
    tier = DeviceTier(octets, device=str(device))
    pinned_s, _ = limits(octets, device, repeat)

    def prepare_all():
        for container in containers:
            tier.prepare(container, geometry)

    print(f"device tier: {blocks} blocks of {octets / blocks / 2**20:.0f} MiB")
    line("one copy from pinned memory (the limit)", pinned_s, octets, pinned_s)
    line("DeviceTier.prepare, every block", best_of(repeat, prepare_all, device), octets, pinned_s)


def bench_import(device: torch.device, prefix_tokens: int, repeat: int) -> None:
    from workers.engines.modeldir import create_reference_model
    from workers.engines.reference import ReferenceEngine

    block_tokens = 16
    with tempfile.TemporaryDirectory() as directory:
        model_dir = create_reference_model(
            Path(directory) / "model",
            seed=3,
            layers=12,
            hidden_size=768,
            heads=12,
            kv_heads=4,
            max_positions=prefix_tokens + 64,
        )
        engine_a = ReferenceEngine(model_dir, block_tokens=block_tokens, device=device)
        engine_b = ReferenceEngine(model_dir, block_tokens=block_tokens, device=device)
        generator = torch.Generator().manual_seed(5)
        prompt = torch.randint(3, 320, (prefix_tokens + 8,), generator=generator).tolist()
        blocks = prefix_tokens // block_tokens
        prefix, tail = prompt[: blocks * block_tokens], prompt[blocks * block_tokens :]
        cached = engine_a.prefill(prefix)
        octets = [
            bytes(bytearray().join(e.parts)) for e in engine_a.export_blocks(cached, 0, blocks)
        ]
        expected = engine_a.extend(cached, tail)
        decoded = [decode(data) for data in octets]

        def recompute():
            return engine_b.extend(engine_b.prefill(prefix), tail)

        def at_once():
            return engine_b.extend(engine_b.import_blocks(octets, tokens=prefix), tail)

        def layer_by_layer():
            layerwise = engine_b.begin_import(blocks, tokens=prefix, timeout=120)

            def produce():
                for layer in range(engine_b.layers):
                    for block, container in enumerate(decoded):
                        layerwise.add_layer(block, layer, *container.layer(layer))

            producer = threading.Thread(target=produce, daemon=True)
            producer.start()
            logits = engine_b.extend(layerwise.sequence, tail)
            producer.join()
            return logits

        results = {}
        timings = {}
        for name, work in (
            ("recomputed", recompute),
            ("imported at once", at_once),
            ("imported layer by layer", layer_by_layer),
        ):
            times = []
            for _ in range(repeat):
                sync(device)
                started = time.perf_counter()
                results[name] = work()
                sync(device)
                times.append(time.perf_counter() - started)
            timings[name] = statistics.median(times)
        recomputed_s = timings["recomputed"]
        print(
            f"import: {blocks} blocks of {block_tokens} tokens "
            f"({sum(map(len, octets)) / 2**20:.1f} MiB), 12 layers, on {device}"
        )
        for name, seconds in timings.items():
            print(
                f"  {name:<44} {seconds * 1000:9.2f} ms  / recomputed {seconds / recomputed_s:5.2f}"
            )
        for name in ("imported at once", "imported layer by layer"):
            print(f"  {name} equals A's own logits: {torch.equal(results[name], expected)}")
        gap = (results["recomputed"] - expected).abs().max().item()
        same = int(results["recomputed"].argmax()) == int(expected.argmax())
        print(f"  recomputed vs A: max |diff| {gap:.2e}, same greedy token: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (--device cpu runs the same code on the CPU)")
        return
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    bench_copy(device, args.repeat)
    bench_device_tier(device, args.repeat)
    bench_import(device, args.prefix, max(1, args.repeat // 2))


if __name__ == "__main__":
    main()
