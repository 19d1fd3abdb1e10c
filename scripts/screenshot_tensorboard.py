"""Screenshots of what TensorBoard shows for a real run: the scalars and custom-scalars dashboards.

    python scripts/screenshot_tensorboard.py [--out-dir docs]

Runs examples/lightning_quickstart.py (CPU, seconds), serves its logs with a real
`tensorboard` on 127.0.0.1, and photographs the dashboards with headless Chromium
(Debian: `apt-get install chromium`).  Writes tensorboard_scalars.png and
tensorboard_custom_scalars.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--window-size=1600,1000", "--virtual-time-budget=20000",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_run(port: int, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                if json.loads(r.read()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("tensorboard did not serve the run in time")


def shoot(chromium: str, url: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(ROOT / "docs"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium found: apt-get install chromium")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_quickstart.py"), "--steps", "400", "--root", root],
                       check=True, env=env, capture_output=True, timeout=600)
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", os.path.join(root, "lightning_logs"),
             "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_run(port)
            base = f"http://127.0.0.1:{port}/?darkMode=false"
            shoot(chromium, f"{base}#scalars&tagFilter=phase_time%2F.*%2Fmean", out / "tensorboard_scalars.png")
            shoot(chromium, f"{base}#custom_scalars", out / "tensorboard_custom_scalars.png")
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {out / 'tensorboard_scalars.png'} and {out / 'tensorboard_custom_scalars.png'}")


if __name__ == "__main__":
    main()
