"""8 concurrent clients sending hundreds of frames to the real service process: no errors,
answers identical to sequential ones, and resident memory that does not grow (slow tier)."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from perception.core.imageio import encode_image
from perception.core.testing import free_port, make_test_frame, resident_memory_bytes, wait_until_healthy

BIN = Path(sys.executable).parent
CLIENTS, PER_CLIENT = 8, 50


@pytest.mark.slow
def test_soak_concurrent_clients(artifact_dir, calib):
    rng = np.random.default_rng(5)
    frames = []
    for i in range(24):
        spot = (rng.uniform(0.37, 0.63), rng.uniform(-0.13, 0.13))
        fmt = "png" if i % 2 else "jpeg"
        frames.append((encode_image(make_test_frame(calib, spot_xy=spot, seed=i), fmt), f"image/{fmt}"))
    port = free_port()
    # repeats.memory=0: 8 clients share the service, so every frame must be answered on its own.
    proc = subprocess.Popen([str(BIN / "sim2real-serve"), f"artifact={artifact_dir}", f"port={port}", "token=tok",
                             "threads=1", "max_concurrency=2", "log_level=warning", "repeats.memory=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": "Bearer tok"}
    try:
        wait_until_healthy(url, proc, timeout=60)
        with httpx.Client(timeout=60) as c:
            def ask(i):
                body, ctype = frames[i]
                r = c.post(url + "/v1/grasp", content=body, headers={**headers, "Content-Type": ctype})
                assert r.status_code == 200, r.text
                a = r.json()
                return {k: a[k] for k in ("grasp", "pixel", "reason")}

            sequential = [ask(i) for i in range(len(frames))]
            for i in range(3 * len(frames)):  # warm-up: allocator pools, thread pools
                ask(i % len(frames))
        rss_before = resident_memory_bytes(proc.pid)

        def client(k):
            out = []
            with httpx.Client(timeout=60) as c:
                for j in range(PER_CLIENT):
                    i = (7 * k + j) % len(frames)
                    body, ctype = frames[i]
                    r = c.post(url + "/v1/grasp", content=body, headers={**headers, "Content-Type": ctype})
                    out.append((i, r.status_code, r.json()))
            return out

        rss_samples = []
        for _round in range(2):
            with cf.ThreadPoolExecutor(CLIENTS) as ex:
                results = [x for res in ex.map(client, range(CLIENTS)) for x in res]
            assert len(results) == CLIENTS * PER_CLIENT
            for i, status, ans in results:
                assert status == 200
                assert {k: ans[k] for k in ("grasp", "pixel", "reason")} == sequential[i]
            rss_samples.append(resident_memory_bytes(proc.pid))
        growth_mb = (rss_samples[-1] - rss_before) / 2**20
        assert growth_mb < 25, f"RSS grew {growth_mb:.1f} MB over {2 * CLIENTS * PER_CLIENT} requests"
        assert httpx.get(url + "/healthz").status_code == 200
        metrics = httpx.get(url + "/metrics", headers=headers).text
        assert 'status="500"' not in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0
