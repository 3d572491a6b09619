"""Where a static pass's time goes on a GPU: the CUDA kernels of one bucket's pass (eager,
as the graph captures them), by total time. `python -m tools.gpu_profile [OUT]`"""

import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tools.gpu_check import model
from specdec.runtime.engine import Engine


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(model(dtype), 1 << 28, cuda_graphs=True, prefix_caching=False)
        try:
            static = engine.runner.static
            for t in (1, 8):
                for _ in range(3):
                    static._forward(t, 128, ())
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    static._forward(t, 128, ())
                    torch.cuda.synchronize()
                events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
                total = sum(e.self_device_time_total for e in events)
                count = sum(e.count for e in events)
                lines.append(f"\n{dtype} bucket {t}x128: {count} kernels, {total / 1000:.3f} ms on the device")
                for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
                    lines.append(f"  {e.self_device_time_total / 1000:8.3f} ms {e.count:5d}x  {e.key[:110]}")
        finally:
            engine.stop()
    text = "\n".join(lines)
    print(text)
    (out / "gpu_profile.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
