"""The console scripts as a user runs them: the contract's command line, refusals at
start, and SIGTERM / SIGINT ending the service and the loop cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from perception.core.imageio import write_image
from perception.core.testing import free_port, make_test_frame, wait_until_healthy

BIN = Path(sys.executable).parent


def _serve(args, **kw):
    return subprocess.Popen([str(BIN / "sim2real-serve"), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_contract_command_line_and_signals(artifact_dir, png_bytes, sig, tmp_path):
    from perception.core.calibration import default_calibration_path

    port = free_port()
    proc = _serve([f"artifact={artifact_dir}", f"calibration={default_calibration_path()}", "host=127.0.0.1",
                   f"port={port}", "token=null"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc)
        r = httpx.post(url + "/v1/grasp", content=png_bytes, headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200 and r.json()["grasp"] is not None
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopped" in out and "Traceback" not in out


def test_serve_refuses_other_image_size(artifact_dir, calib, tmp_path):
    small = tmp_path / "small.json"
    calib.scaled((320, 240)).save(small)
    proc = _serve([f"artifact={artifact_dir}", f"calibration={small}", f"port={free_port()}"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "not starting" in out and "image_size is 320x240" in out and "640x480" in out
    assert "Traceback" not in out


def test_serve_usage_errors(tmp_path):
    proc = _serve(["port=1"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "artifact=DIR is required" in out
    proc = _serve([f"artifact={tmp_path}", "nonsense"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "key=value" in out
    proc = _serve([f"artifact={tmp_path}", f"port={free_port()}"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "metadata.json" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_loop_stops_cleanly_on_signal(artifact_dir, calib, tmp_path, sig):
    cam = tmp_path / "cam"
    for i in range(3):
        write_image(cam / f"f{i}.png", make_test_frame(calib, seed=i))
    out = tmp_path / "att"
    proc = subprocess.Popen(
        [str(BIN / "sim2real-grasp-loop"), f"artifact={artifact_dir}", f"camera=replay:{cam}", "robot=dry",
         f"out_dir={out}", "rate_hz=5", "threads=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "attempts.jsonl").exists() or not (out / "attempts.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        proc.send_signal(sig)
        text, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    assert "loop finished" in text and '"stopped_by": "signal"' in text and "Traceback" not in text
