"""Benchmark of the grasp service: end-to-end ``/v1/grasp`` latency and resident memory.

    .venv/bin/python benchmarks/service.py [--artifact DIR] [--calibration FILE] [--n 200] [--loads] [--write]

Starts ``sim2real-serve`` as a separate process on 127.0.0.1, sends 640x480 PNG and JPEG
frames one at a time over a keep-alive connection, and reports p50 / p99 of the client's
wall-clock latency next to the raw onnxruntime forward pass timed in this process with
the same thread count, plus the per-stage split (decode, preprocess, forward, grasp
decode) and the service's resident memory. Goals: p50 <= 30 ms, RSS <= 300 MB.
Without ``--artifact`` a synthetic policy with a small convolution stack is built.
``--loads`` then times the same PNG frames, one client, under each abusive load beside the
idle latency in the same run (issue 12): 150 idle connections, clients trickling their
headers and bodies, a client sending 8 MB JPEGs of one scan repeated, and a queue held full; a ``503``
(retry) counts into the latency of the frame that got its ``200`` after it.
With an artifact that has int8 graphs (``policies/int8.py``) the service runs them (``precision=auto``
on a CPU); the float graphs are then timed beside them in the same run: the forward passes
interleaved in one loop, and ``/v1/grasp`` on PNG frames from a second service started with
``precision=fp32``, with the p50 ratios.
``--write`` puts the table into docs/benchmarks.md between the service markers, and the
end-to-end latency and memory into ``docs/results.md``, block ``service`` (``benchmarks/results_doc.py``).

``--uploads 10,30,60`` measures memory instead: for each count, a fresh service with its
default limits, then that many clients at once, each sending a frame padded to just under
``max_body_mb`` at full speed; the service's peak resident memory (``VmHWM``) against its
idle memory and the goal (300 MB), and the answers' status codes. The bound it should
keep: idle + (``max_concurrency`` + ``limits.max_queue``) x ``max_body_mb``, each body
held once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import cv2
import httpx
import numpy as np
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

from results_doc import ResultsDocError, write_block  # noqa: E402  (benchmarks/results_doc.py)

from perception.core.artifact import PolicyRunner, cpu_count  # noqa: E402
from perception.core.atomic import atomic_write_text  # noqa: E402
from perception.core.calibration import Calibration, default_calibration_path  # noqa: E402
from perception.core.decode import decode_grasp  # noqa: E402
from perception.core.imageio import decode_image, encode_image  # noqa: E402
from perception.core.repeats import DEFAULT_REPEATS, RepeatGuard  # noqa: E402
from perception.core.rule import CHECK_OPTIONS  # noqa: E402
from perception.core.testing import (  # noqa: E402
    free_port,
    make_test_artifact,
    resident_memory_bytes,
    scan_bomb_jpeg,
    wait_until_healthy,
)

START, END = "<!-- service-benchmark:start -->", "<!-- service-benchmark:end -->"


def camera_like_frame(calib: Calibration, seed: int = 0) -> np.ndarray:
    """A frame that compresses like a camera image: smooth shading, objects, sensor noise."""
    w, h = calib.image_size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.dstack([90 + 40 * xx / w, 95 + 30 * yy / h, 100 + 20 * (xx + yy) / (w + h)])
    for _ in range(6):
        c = (int(rng.integers(150, 490)), int(rng.integers(120, 360)))
        color = [float(v) for v in rng.integers(30, 230, 3)]
        cv2.rectangle(img, c, (c[0] + int(rng.integers(20, 70)), c[1] + int(rng.integers(10, 40))), color, -1)
    img = cv2.GaussianBlur(img, (3, 3), 0) + rng.normal(0, 2.0, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _head(port: int, length: int) -> bytes:
    return (f"POST /v1/grasp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: image/png\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def measure_loads(url: str, port: int, frames: list[bytes], bomb: bytes, n: int) -> dict:
    """p50 / p99 of one client's PNG frames (retrying on 503) under each load, idle first."""

    def idle_connections(stop):
        held = []
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                if len(held) > 150:
                    held.pop(0).close()
            time.sleep(0.005)
        for c in held:
            c.close()

    def hold(stop, payloads: list[bytes], period_s: float):
        """Connections that send ``payloads`` and then nothing, renewed every ``period_s``."""
        while not stop.is_set():
            socks = []
            for data in payloads:
                with contextlib.suppress(OSError):
                    c = socket.create_connection(("127.0.0.1", port), timeout=5)
                    c.sendall(data)
                    socks.append(c)
            stop.wait(period_s)
            for c in socks:
                c.close()

    def slow_clients(stop):  # half trickle their headers, half hold a body after 2 bytes
        head = _head(port, 500_000)
        hold(stop, [head[: 20 + 10 * k] if k % 2 else head + b"\x89P" for k in range(8)], 3.0)

    def scan_bombs(stop):
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    c.post(url + "/v1/grasp", content=bomb, headers={"Content-Type": "image/jpeg"})

    def full_queue(stop):
        hold(stop, [_head(port, len(frames[0])) + frames[0][:1000]] * 12, 2.0)

    loads = {"idle": None, "150 idle connections": idle_connections, "slow clients (trickled headers, held bodies)":
             slow_clients, "scan bombs (8 MB JPEGs of one scan repeated, back to back)": scan_bombs,
             "queue held full (12 bodies that never end)": full_queue}
    out = {}
    for name, fn in loads.items():
        stop = threading.Event()
        worker = threading.Thread(target=fn, args=(stop,), daemon=True) if fn else None
        if worker:
            worker.start()
            time.sleep(1.0)
        times, retries = [], 0
        with httpx.Client(timeout=30) as c:
            for i in range(n):
                t = time.perf_counter()
                while True:
                    try:
                        r = c.post(url + "/v1/grasp", content=frames[i % len(frames)], headers={"Content-Type": "image/png"})
                        if r.status_code == 200:
                            break
                        retries += 1
                    except httpx.HTTPError:
                        retries += 1
                    time.sleep(0.05)
                times.append(time.perf_counter() - t)
        stop.set()
        if worker:
            worker.join(10)
        out[name] = {"p50": 1000 * pct(times, 50), "p99": 1000 * pct(times, 99), "retries": retries, "n": n}
    return out


def run(args: argparse.Namespace) -> dict:
    calib = Calibration.load(args.calibration or default_calibration_path())
    tmp = None
    artifact = args.artifact
    if artifact is None:
        tmp = tempfile.TemporaryDirectory()
        artifact = make_test_artifact(Path(tmp.name) / "artifact", calibration=calib, view_size=(160, 120),
                                      angle_bins=12, conv_channels=16)
    threads = args.threads or cpu_count()
    frames = {"png": [], "jpeg": []}
    for i in range(8):
        rgb = camera_like_frame(calib, seed=i)
        frames["png"].append(encode_image(rgb, "png"))
        frames["jpeg"].append(encode_image(rgb, "jpeg", quality=90))
    stages, precision, checks = _stage_timings(args, artifact, calib, threads, frames)
    try:
        e2e, server_ms, rss_idle, rss, hwm_kb, loads = _serve(args, artifact, calib, threads, frames, "auto",
                                                              ("png", "jpeg"), args.loads)
        e2e_fp32 = (_serve(args, artifact, calib, threads, frames, "fp32", ("png",), False)[0]["png"]
                    if precision == "int8" else None)
    finally:
        if tmp is not None:
            tmp.cleanup()
    meta = json.loads((Path(artifact) / "metadata.json").read_text()) if tmp is None else {"input": {"size": [160, 120]}}
    return {
        "artifact": "synthetic (3 conv layers, 16 channels)" if tmp is not None else str(artifact),
        "input_size": meta["input"]["size"],
        "precision": precision,
        "threads": threads,
        "n": args.n,
        "machine": f"{platform.machine()}, {cpu_count()} CPU cores, {platform.python_version()}",
        "e2e_ms": {f: {"p50": 1000 * pct(v, 50), "p99": 1000 * pct(v, 99)} for f, v in e2e.items()},
        "e2e_fp32_png_ms": None if e2e_fp32 is None else {"p50": 1000 * pct(e2e_fp32, 50), "p99": 1000 * pct(e2e_fp32, 99)},
        "server_ms": {f: {"p50": pct(v, 50), "p99": pct(v, 99)} for f, v in server_ms.items()},
        "stages_ms": {k: {"p50": 1000 * pct(v, 50), "p99": 1000 * pct(v, 99)} for k, v in stages.items()},
        "frame_kb": {f: round(np.mean([len(b) for b in frames[f]]) / 1024, 1) for f in frames},
        "rss_mb": {"idle": rss_idle / 2**20, "after": rss / 2**20, "peak": hwm_kb / 1024},
        "load_avg": os.getloadavg()[0],
        "loads": loads,
        "checks": checks,  # the re-ranking checks timed on
    }


def _stage_timings(args: argparse.Namespace, artifact, calib: Calibration, threads: int,
                   frames: dict) -> tuple[dict[str, list[float]], str, list[str]]:
    """In-process stage timings and the raw forward pass (the service's thread count): the
    stages' seconds, the precision the service runs, and the re-ranking checks timed on."""
    runner = PolicyRunner(artifact, calib, intra_op_num_threads=threads)
    # The float graphs beside the int8 ones the service runs, when the artifact has both.
    fp32 = PolicyRunner(artifact, calib, intra_op_num_threads=threads, precision="fp32") if runner.precision == "int8" else None
    rgb = decode_image(frames["png"][0])
    x = runner.to_input(runner.preprocess(rgb))
    stages: dict[str, list[float]] = {"decode_png": [], "decode_jpeg": [], "preprocess": [], "forward": [],
                                      "grasp_decode": []}
    if runner.meta.geometry is not None:
        stages["geometry"] = []  # the geometry graph and the top-down rebuild of its surface
    # A stuck robot: the same scene answered `memory` times, every answer remembered.
    guard = RepeatGuard(runner.calib, {})
    stages["repeat_guard"], stages["grasp_decode_avoiding"] = [], []
    # The decode's re-ranking checks side by side (where the fingers land, what the jaws meet):
    # the decode with them and without them, whichever the artifact has.
    defaults = OmegaConf.load(ROOT / "conf" / "policy" / "default.yaml").decode
    options = runner.meta.decode_options
    has_surface = runner.view.is_table and (runner.meta.geometry is not None or "surface" in runner.meta.outputs)
    on = {k: runner.meta.decode.get(k, defaults.get(k)) for k in CHECK_OPTIONS}  # absent: the config's defaults
    if has_surface:
        stages["grasp_decode_checks_on"], stages["grasp_decode_checks_off"] = [], []
        checks_on, checks_off = options.replace(**on), options.replace(**dict.fromkeys(CHECK_OPTIONS))
    avoiding = guard.avoidance(options)  # built once, as the service builds its options
    # The stages are timed one by one on the same frame: decode_grasp itself, not PolicyRunner.decide.
    if fp32 is not None:
        stages["forward_fp32"] = []
        if "geometry" in stages:
            stages["geometry_fp32"] = []
    for _ in range(args.warmup):
        runner.forward(x)
        if fp32 is not None:
            fp32.forward(x)
    for i in range(args.n):
        t = time.perf_counter()
        decode_image(frames["png"][i % 8])
        stages["decode_png"].append(time.perf_counter() - t)
        t = time.perf_counter()
        decode_image(frames["jpeg"][i % 8])
        stages["decode_jpeg"].append(time.perf_counter() - t)
        t = time.perf_counter()
        view = runner.preprocess(rgb)
        stages["preprocess"].append(time.perf_counter() - t)
        t = time.perf_counter()
        q, w, h, *surface = runner.forward(runner.to_input(view))
        stages["forward"].append(time.perf_counter() - t)
        if fp32 is not None:
            t = time.perf_counter()
            fp32.forward(fp32.to_input(view))
            stages["forward_fp32"].append(time.perf_counter() - t)
        if "geometry" in stages:
            surface = _time_geometry(runner, fp32, rgb, stages)
        decode = functools.partial(decode_grasp, q[0], w[0, 0], h[0, 0], runner.calib, runner.view)
        t = time.perf_counter()
        dec = decode(options, surface=surface[0][0, 0] if surface else None)
        stages["grasp_decode"].append(time.perf_counter() - t)
        if has_surface:
            for key, opts in (("grasp_decode_checks_on", checks_on), ("grasp_decode_checks_off", checks_off)):
                t = time.perf_counter()
                decode(opts, surface=surface[0][0, 0])
                stages[key].append(time.perf_counter() - t)
        t = time.perf_counter()
        fingerprint = guard.fingerprint(rgb)
        avoid = guard.failed(fingerprint)
        stages["repeat_guard"].append(time.perf_counter() - t)
        t = time.perf_counter()
        dec = decode(avoiding, surface=surface[0][0, 0] if surface else None, avoid=avoid)
        stages["grasp_decode_avoiding"].append(time.perf_counter() - t)
        t = time.perf_counter()
        guard.answered(fingerprint, dec.grasp)
        stages["repeat_guard"][-1] += time.perf_counter() - t
    return stages, runner.precision, [k for k in CHECK_OPTIONS if on[k] is not None]


def _time_geometry(runner: PolicyRunner, fp32: PolicyRunner | None, rgb: np.ndarray, stages: dict) -> list:
    """The geometry graph and its surface's rebuild (and the float graph's, beside it)."""
    t = time.perf_counter()
    surface = [runner.geometry_surface(rgb)[0][None, None]]
    stages["geometry"].append(time.perf_counter() - t)
    if fp32 is not None:
        t = time.perf_counter()
        fp32.geometry_surface(rgb)
        stages["geometry_fp32"].append(time.perf_counter() - t)
    return surface


def _serve(args: argparse.Namespace, artifact, calib: Calibration, threads: int, frames: dict, precision: str,
           fmts: tuple[str, ...], loads: bool) -> tuple:
    """Start ``sim2real-serve`` at ``precision`` and time ``/v1/grasp`` on it (:func:`_time_service`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "perception.robot.service", f"artifact={artifact}",
           f"calibration={args.calibration or default_calibration_path()}", f"port={port}", f"threads={threads}",
           f"precision={precision}", "log_level=warning"]
    with _service(cmd) as proc:
        return _time_service(proc, f"http://127.0.0.1:{port}", port, frames, fmts, args, calib if loads else None)


@contextlib.contextmanager
def _service(cmd: list[str]):
    """``sim2real-serve`` as a child process, stopped with SIGTERM (killed after 30 s) on the way out."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _time_service(proc, url: str, port: int, frames: dict, fmts: tuple[str, ...], args, loads_calib) -> tuple:
    """``/v1/grasp`` one frame at a time on a started service: latencies, memory, loads."""
    e2e: dict[str, list[float]] = {f: [] for f in fmts}
    server_ms: dict[str, list[float]] = {f: [] for f in fmts}
    wait_until_healthy(url, proc, timeout=60)
    rss_idle = resident_memory_bytes(proc.pid)
    with httpx.Client(timeout=30) as c:
        for fmt in fmts:
            ctype = f"image/{fmt}"
            for i in range(args.warmup + args.n):
                t = time.perf_counter()
                r = c.post(url + "/v1/grasp", content=frames[fmt][i % 8], headers={"Content-Type": ctype})
                dt = time.perf_counter() - t
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.text}")
                if i >= args.warmup:
                    e2e[fmt].append(dt)
                    server_ms[fmt].append(r.json()["latency_ms"])
    rss = resident_memory_bytes(proc.pid)
    hwm_kb = status_kb(proc.pid, "VmHWM")
    loads = (measure_loads(url, port, frames["png"], scan_bomb_jpeg(camera_like_frame(loads_calib), max_bytes=8 * 2**20),
                           args.n // 2) if loads_calib is not None else None)
    return e2e, server_ms, rss_idle, rss, hwm_kb, loads


def to_markdown(res: dict) -> str:
    e, s, st = res["e2e_ms"], res["server_ms"], res["stages_ms"]
    lines = [
        START,
        "## Grasp service (`benchmarks/service.py`)",
        "",
        f"Policy: {res['artifact']}, input {res['input_size'][0]}x{res['input_size'][1]}; onnxruntime CPU, "
        f"{res['threads']} intra-op threads; {res['n']} requests per format after warm-up, one client, "
        f"keep-alive; {res['machine']}; load average at the end {res['load_avg']:.2f}.",
        "",
        "| | p50 ms | p99 ms |",
        "|---|---:|---:|",
        f"| `/v1/grasp` end to end, 640x480 PNG ({res['frame_kb']['png']} KB) | {e['png']['p50']:.1f} | {e['png']['p99']:.1f} |",
        f"| `/v1/grasp` end to end, 640x480 JPEG ({res['frame_kb']['jpeg']} KB) | {e['jpeg']['p50']:.1f} | {e['jpeg']['p99']:.1f} |",
        f"| server-side `latency_ms`, PNG | {s['png']['p50']:.1f} | {s['png']['p99']:.1f} |",
        f"| server-side `latency_ms`, JPEG | {s['jpeg']['p50']:.1f} | {s['jpeg']['p99']:.1f} |",
        f"| raw onnxruntime forward pass (same run, {res.get('precision', 'fp32')} graph) | {st['forward']['p50']:.1f} | {st['forward']['p99']:.1f} |",
        f"| stage: decode PNG | {st['decode_png']['p50']:.1f} | {st['decode_png']['p99']:.1f} |",
        f"| stage: decode JPEG | {st['decode_jpeg']['p50']:.1f} | {st['decode_jpeg']['p99']:.1f} |",
        f"| stage: undistort + crop + resize | {st['preprocess']['p50']:.1f} | {st['preprocess']['p99']:.1f} |",
        *([f"| stage: geometry graph + top-down rebuild | {st['geometry']['p50']:.1f} | {st['geometry']['p99']:.1f} |"]
          if "geometry" in st else []),
        *([f"| the float graphs beside them: `/v1/grasp` PNG with `precision=fp32` (p50 ratio int8 / fp32 "
           f"{e['png']['p50'] / res['e2e_fp32_png_ms']['p50']:.2f}) | {res['e2e_fp32_png_ms']['p50']:.1f} | {res['e2e_fp32_png_ms']['p99']:.1f} |",
           f"| the float graphs: forward pass (ratio {st['forward']['p50'] / st['forward_fp32']['p50']:.2f}) "
           f"| {st['forward_fp32']['p50']:.1f} | {st['forward_fp32']['p99']:.1f} |"]
          if res.get("e2e_fp32_png_ms") else []),
        *([f"| the float graphs: geometry graph + rebuild (ratio {st['geometry']['p50'] / st['geometry_fp32']['p50']:.2f}) "
           f"| {st['geometry_fp32']['p50']:.1f} | {st['geometry_fp32']['p99']:.1f} |"] if "geometry_fp32" in st else []),
        f"| stage: grasp decode | {st['grasp_decode']['p50']:.2f} | {st['grasp_decode']['p99']:.2f} |",
        *([f"| stage: grasp decode with the re-ranking checks ({', '.join(f'`{k}`' for k in res['checks'])}) / without them, "
           f"p50 ratio {st['grasp_decode_checks_on']['p50'] / max(st['grasp_decode_checks_off']['p50'], 1e-9):.2f}x "
           f"| {st['grasp_decode_checks_on']['p50']:.2f} / {st['grasp_decode_checks_off']['p50']:.2f} "
           f"| {st['grasp_decode_checks_on']['p99']:.2f} / {st['grasp_decode_checks_off']['p99']:.2f} |"]
          if "grasp_decode_checks_on" in st else []),
        f"| stage: repeat memory (fingerprint, motion check, remember), up to {DEFAULT_REPEATS['memory']} grasps "
        f"| {st['repeat_guard']['p50']:.2f} | {st['repeat_guard']['p99']:.2f} |",
        f"| stage: grasp decode avoiding them (ratio to the plain decode, p50: "
        f"{st['grasp_decode_avoiding']['p50'] / max(st['grasp_decode']['p50'], 1e-9):.1f}x) "
        f"| {st['grasp_decode_avoiding']['p50']:.2f} | {st['grasp_decode_avoiding']['p99']:.2f} |",
        "",
        f"Resident memory of the service: {res['rss_mb']['idle']:.0f} MB idle, {res['rss_mb']['after']:.0f} MB after "
        f"the run, peak {res['rss_mb']['peak']:.0f} MB (goal <= 300 MB). Goal p50 <= 30 ms: "
        f"{'met' if max(e['png']['p50'], e['jpeg']['p50']) <= 30 else 'NOT met'}.",
    ]
    if res.get("loads"):
        idle = res["loads"]["idle"]["p50"]
        lines += ["", f"Under load (`--loads`, the default `limits`; one client's PNG frames, {idle and res['loads']['idle']['n']} "
                  "per load; a 503 is retried after 50 ms and counts into that frame's latency):", "",
                  "| load beside the client | p50 ms | p99 ms | p50 / idle p50 | 503s or dropped connections retried |",
                  "|---|---:|---:|---:|---:|"]
        for name, v in res["loads"].items():
            lines.append(f"| {name} | {v['p50']:.1f} | {v['p99']:.1f} | {v['p50'] / idle:.2f} | {v['retries']} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def results_table(res: dict) -> str:
    """The service's cost as ``docs/results.md`` shows it (block ``service``)."""
    e = res["e2e_ms"]
    return "\n".join([
        f"Policy: {res['artifact']}; {res['machine']}; {res['n']} requests per format, one client.", "",
        "| `POST /v1/grasp`, 640x480 frame | p50 ms | p99 ms |", "|---|---:|---:|",
        f"| PNG | {e['png']['p50']:.1f} | {e['png']['p99']:.1f} |",
        f"| JPEG | {e['jpeg']['p50']:.1f} | {e['jpeg']['p99']:.1f} |", "",
        f"Resident memory: {res['rss_mb']['idle']:.0f} MB idle, peak {res['rss_mb']['peak']:.0f} MB.",
    ])


def write_section(md: str, path: Path) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
        text = text[:a] + md.rstrip("\n") + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + md
    atomic_write_text(path, text)  # as results_doc.write_block: the old page or the new one, whole


def _padded_png(png: bytes, size: int) -> bytes:
    """``png`` grown to ``size`` bytes by a private ancillary chunk before IEND: a valid frame
    at the body limit, which decoders skip, so every admitted upload is decoded and answered."""

    pad = size - len(png) - 12  # a chunk is length, type, data, CRC
    chunk = pad.to_bytes(4, "big") + b"prVt" + bytes(pad)
    chunk += zlib.crc32(chunk[4:]).to_bytes(4, "big")
    return png[:-12] + chunk + png[-12:]


def _upload(port: int, body: bytes, statuses: list) -> None:
    """One client: the whole body at full speed, then the answer's status (None: none came)."""
    head = (f"POST /v1/grasp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: image/png\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(head + body)
            first = sock.recv(64)
        statuses.append(int(first.split(b" ", 2)[1]) if first.startswith(b"HTTP/1.1 ") else None)
    except OSError:
        statuses.append(None)  # refused or reset before an answer


def measure_uploads(args: argparse.Namespace, counts: list[int]) -> list[dict]:
    """Peak memory of a service under ``count`` concurrent near-limit uploads (see the module doc)."""

    calib = Calibration.load(args.calibration or default_calibration_path())
    serve = OmegaConf.load(ROOT / "conf" / "serve.yaml")
    body_bytes = int((serve.max_body_mb - 0.1) * 2**20)
    places = int(serve.max_concurrency) + int(serve.limits.max_queue)
    png = encode_image(camera_like_frame(calib, seed=0), "png")
    body = _padded_png(png, body_bytes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or make_test_artifact(Path(tmp) / "artifact", calibration=calib, view_size=(160, 120),
                                                       angle_bins=12, conv_channels=16)
        for count in counts:
            port = free_port()
            cmd = [sys.executable, "-m", "perception.robot.service", f"artifact={artifact}",
                   f"calibration={args.calibration or default_calibration_path()}", f"port={port}", "log_level=warning"]
            with _service(cmd) as proc:
                url = f"http://127.0.0.1:{port}"
                wait_until_healthy(url, proc, timeout=60)
                with httpx.Client(timeout=30) as c:
                    for _ in range(5):
                        c.post(url + "/v1/grasp", content=png, headers={"Content-Type": "image/png"})
                idle = resident_memory_bytes(proc.pid)
                statuses: list[int | None] = []
                workers = [threading.Thread(target=_upload, args=(port, body, statuses)) for _ in range(count)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join(120)
                peak_kb = status_kb(proc.pid, "VmHWM")
            codes = {str(k): statuses.count(k) for k in sorted(set(statuses), key=str)}
            rows.append({"uploads": count, "body_mib": round(len(body) / 2**20, 2), "idle_mb": round(idle / 2**20, 1),
                         "peak_mb": round(peak_kb / 1024, 1),
                         "bound_mb": round(idle / 2**20 + places * len(body) / 2**20, 1), "statuses": codes})
            print(f"{count} concurrent uploads of {len(body) / 2**20:.1f} MiB: peak {peak_kb / 1024:.0f} MB "
                  f"(idle {idle / 2**20:.0f} MB; idle + {places} places x body = {rows[-1]['bound_mb']:.0f} MB; "
                  f"goal <= 300 MB); answers {codes}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=None, help="policy artifact folder (default: a synthetic one)")
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: the packaged one)")
    ap.add_argument("--n", type=int, default=200, help="timed requests per format")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    ap.add_argument("--loads", action="store_true", help="also time frames under slow-client, idle-connection, "
                    "scan-bomb and full-queue loads")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md and docs/results.md")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--uploads", default=None, metavar="N,N,...",
                    help="measure peak memory under N concurrent near-limit uploads instead (e.g. 10,30,60)")
    args = ap.parse_args()
    if args.uploads:
        rows = measure_uploads(args, [int(n) for n in args.uploads.split(",")])
        print(json.dumps({"uploads": rows}))
        return 0
    res = run(args)
    md = to_markdown(res)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if args.write:
        write_section(md, ROOT / "docs" / "benchmarks.md")
        try:
            write_block("service", results_table(res), "python benchmarks/service.py " + " ".join(sys.argv[1:]))
        except ResultsDocError as exc:
            print(f"service.py: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
