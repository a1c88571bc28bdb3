"""One small-batch inference client for benchmarks/inference.py: a model with random weights,
timed request by request, one JSON line on stdout at the end.

    python benchmarks/inference_client.py --model resnet18|encoder --batch B --device cuda|cpu
        [--size full|tiny] [--start-at EPOCH] [--duration S] [--warmup N]

Models are built from torch.nn layers (no torchvision, no downloads): a ResNet-18 shape
(224x224 input, BasicBlocks 64-128-256-512, 1000 classes) and a transformer-encoder shape
(BERT-base-like: 6 layers, d_model 768, 12 heads, 128 tokens). ``--size tiny`` shrinks both
for a CPU dry-run. Without PyTorch on --device cpu, a NumPy stand-in of the same call pattern
runs instead and the result says ``"engine": "numpy"``.

With --serve the client builds its model once, then reads one JSON command a line on stdin,
``{"batch": B, "start_at": EPOCH, "duration": S}``, and answers each with one JSON line: the
benchmark reuses warm clients across windows instead of paying start-up (import, CUDA context,
first kernels) every time. Every window sleeps until its start_at (wall clock), so concurrent
clients are timed over the same window; a request is one forward pass of one batch,
synchronised before its time is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Callable


def resnet18(torch: Any, width: int, classes: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    layers: list[Any] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def encoder(torch: Any, d_model: int, heads: int, layers: int) -> Any:
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


SHAPES = {  # model -> size -> (builder args, input shape without batch)
    "resnet18": {"full": ((64, 1000), (3, 224, 224)), "tiny": ((8, 10), (3, 32, 32))},
    "encoder": {"full": ((768, 12, 6), (128, 768)), "tiny": ((32, 4, 1), (16, 32))},
}


Step = Callable[[int], Callable[[], None]]  # batch -> one request


def torch_step(model: str, size: str, device: str) -> tuple[Step, Callable[[], int]]:
    import torch

    args, shape = SHAPES[model][size]
    torch.manual_seed(0)
    net = (resnet18 if model == "resnet18" else encoder)(torch, *args).to(device).eval()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def make(batch: int) -> Callable[[], None]:
        x = torch.randn(batch, *shape, device=device)

        def step() -> None:
            with torch.inference_mode():
                net(x)
            sync()

        return step

    def memory() -> int:
        if device.startswith("cuda"):
            return int(torch.cuda.max_memory_reserved())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    return make, memory


def numpy_step(model: str) -> tuple[Step, Callable[[], int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    dim = 256 if model == "resnet18" else 128
    weights = [rng.standard_normal((dim, dim), dtype=np.float32) for _ in range(4)]

    def make(batch: int) -> Callable[[], None]:
        x = rng.standard_normal((batch * 8, dim), dtype=np.float32)

        def step() -> None:
            y = x
            for w in weights:
                y = np.maximum(y @ w, 0)

        return step

    return make, lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def run(step: Callable[[], None], start_at: float, duration: float, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        step()
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    latencies = []
    t0 = time.perf_counter()
    end = t0 + duration
    now = t0
    while now < end:
        step()
        after = time.perf_counter()
        latencies.append(after - now)
        now = after
    elapsed = now - t0
    latencies.sort()
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "late_start_s": max(0.0, -delay) if start_at else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
    }


def window(
    make: Step,
    memory: Callable[[], int],
    engine: str,
    args: argparse.Namespace,
    batch: int,
    start_at: float,
    duration: float,
) -> dict[str, Any]:
    result = run(make(batch), start_at, duration, args.warmup)
    result.update(
        pid=os.getpid(),
        engine=engine,
        model=args.model,
        batch=batch,
        device=args.device,
        items_per_s=result["requests"] * batch / result["seconds"],
        peak_memory=memory(),
        mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        active_thread_percentage=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=("full", "tiny"), default="full")
    ap.add_argument("--start-at", type=float, default=0.0, help="wall-clock time (time.time()) to start timing")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--serve", action="store_true", help="read JSON commands on stdin, one window each")
    args = ap.parse_args(argv)
    try:
        make, memory = torch_step(args.model, args.size, args.device)
        engine = "torch"
    except ImportError:
        if args.device != "cpu":
            raise
        make, memory = numpy_step(args.model)
        engine = "numpy"
    if not args.serve:
        print(json.dumps(window(make, memory, engine, args, args.batch, args.start_at, args.duration)), flush=True)
        return 0
    print(json.dumps({"ready": True, "pid": os.getpid(), "engine": engine}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out = window(make, memory, engine, args, int(cmd["batch"]), float(cmd["start_at"]), float(cmd["duration"]))
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
