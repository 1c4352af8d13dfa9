"""Recording the cell's own attempts (docs/robot_cell.md section 7): the folder format, the
service's record_dir and POST /v1/outcome on a real server on loopback, a kill and a restart."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from perception.core.recording import (
    ATTEMPTS_FILE,
    OUTCOMES_FILE,
    Recording,
    RecordingError,
    load_attempts,
    load_header,
)
from perception.core.testing import free_port, wait_until_healthy
from tests.perception.conftest import ThreadServer

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BIN = Path(sys.executable).parent


def _grasp(url: str, body: bytes, ctype: str = "image/png") -> httpx.Response:
    return httpx.post(url + "/v1/grasp", content=body, headers={**AUTH, "Content-Type": ctype}, timeout=30)


def _outcome(url: str, payload, headers: dict | None = None) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(url + "/v1/outcome", content=content, timeout=30,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


class _Frame:
    def __init__(self, image):
        self.image = image


def test_a_recording_keeps_one_camera_unique_ids_and_no_torn_line(tmp_path, calib, frame):
    rec = Recording(tmp_path / "r", calib)
    with pytest.raises(RecordingError, match="another process"):
        Recording(tmp_path / "r", calib)  # one writer at a time
    a, b = rec.new_id(), rec.new_id()
    rec.record(a, _Frame(frame), {"grasp": None})
    rec.record_bytes(b, b"\x89PNG-as-sent", "png", {"grasp": {"quality": 0.9}})
    assert rec.record_outcome("000002", {"success": False}) and rec.record_outcome("000002", {"success": True})
    assert not rec.record_outcome("000009", {"success": True})
    rec.close()
    # A kill in the middle of a line: it is cut off on reopening, the next line stands alone.
    with open(tmp_path / "r" / ATTEMPTS_FILE, "a") as fh:
        fh.write('{"id": "000003", "frame": "frames/att')
    (tmp_path / "r" / "frames" / "attempt_000003.png").write_bytes(b"frame written, line torn")
    rec = Recording(tmp_path / "r", calib)
    assert rec.new_id() == 4  # past the frame whose line was torn: its name is never reused
    rec.record_bytes(4, b"x", "jpg", {"grasp": None})
    rec.close()
    attempts = load_attempts(tmp_path / "r")
    assert [a["id"] for a in attempts] == ["000001", "000002", "000004"]
    assert attempts[1]["outcome"] == {"success": True}  # the last report wins
    assert (tmp_path / "r" / attempts[1]["frame"]).read_bytes() == b"\x89PNG-as-sent"
    header = load_header(tmp_path / "r")
    assert header["image_size"] == list(calib.image_size) and len(header["sessions"]) == 2
    # Another camera is refused: fine-tuning needs one camera per recording.
    other = calib.scaled((320, 240))
    with pytest.raises(RecordingError, match="another calibration"):
        Recording(tmp_path / "r", other)


@pytest.fixture()
def recording_server(artifact_dir, tmp_path):
    from perception.robot.service import create_app

    app = create_app(artifact_dir, token=TOKEN, intra_op_num_threads=1, record_dir=tmp_path / "rec",
                     record_max_attempts=6)
    with ThreadServer(app) as srv:
        srv.record_dir = tmp_path / "rec"
        yield srv


def test_the_service_records_what_it_answers_and_takes_outcomes(recording_server, png_bytes, jpeg_bytes):
    url = recording_server.url
    answers = [_grasp(url, png_bytes).json(), _grasp(url, jpeg_bytes, "image/jpeg").json()]
    assert all(a["grasp"] is not None for a in answers)
    ids = [a["attempt_id"] for a in answers]
    assert len(set(ids)) == 2 and all(isinstance(i, str) and i for i in ids)
    # On disk before the answer left: the frame exactly as sent, and the answer.
    recorded = {a["id"]: a for a in load_attempts(recording_server.record_dir)}
    assert (recording_server.record_dir / recorded[ids[0]]["frame"]).read_bytes() == png_bytes
    assert (recording_server.record_dir / recorded[ids[1]]["frame"]).read_bytes() == jpeg_bytes
    assert recorded[ids[0]]["grasp"] == answers[0]["grasp"] and recorded[ids[0]]["outcome"] is None

    assert _outcome(url, {"attempt_id": ids[0], "success": False}).json() == {"recorded": True}
    assert _outcome(url, {"attempt_id": ids[0], "success": True}).status_code == 200  # replaces the first
    assert _outcome(url, {"attempt_id": "nope", "success": True}).status_code == 404
    assert _outcome(url, b"{not json").status_code == 400
    # Nested ~1000 deep in under 4 KB: the parser's recursion limit, answered 400, nothing stored.
    for deep in (b"[" * 1000 + b"]" * 1000, b"[" * 2040 + b"]" * 2040):
        assert _outcome(url, deep).status_code == 400
    for bad in ({"attempt_id": ids[0]}, {"attempt_id": "", "success": True}, {"attempt_id": ids[0], "success": 1},
                [ids[0], True]):
        assert _outcome(url, bad).status_code == 422, bad
    assert _outcome(url, {"attempt_id": ids[0], "success": True, "pad": "x" * 5000}).status_code == 413
    r = httpx.post(url + "/v1/outcome", content=b"{}", headers={"Content-Type": "text/plain", **AUTH})
    assert r.status_code == 415
    assert httpx.post(url + "/v1/outcome", json={"attempt_id": ids[0], "success": True}).status_code == 401
    assert load_attempts(recording_server.record_dir)[0]["outcome"] == {"success": True, "source": "http"}

    # Concurrent reports: every one answered 200 and on disk as a whole line.
    def report(k):
        results.append(_outcome(url, {"attempt_id": ids[k % 2], "success": k % 3 == 0}).status_code)

    results: list[int] = []
    threads = [threading.Thread(target=report, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 24
    lines = (recording_server.record_dir / OUTCOMES_FILE).read_text().splitlines()
    assert len(lines) == 2 + 24 and all(json.loads(line)["attempt_id"] in ids for line in lines)

    # The cap (6 here): the service serves on, stops recording, counts it.
    for _ in range(6):
        last = _grasp(url, png_bytes).json()
    assert last["grasp"] is not None and last["attempt_id"] is None
    assert len(load_attempts(recording_server.record_dir)) == 6
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert "sim2real_recording_refused 2.0" in metrics and "sim2real_recorded_attempts 6.0" in metrics


def test_measured_outcome_fields_are_stored_as_given_and_malformed_ones_store_nothing(recording_server, png_bytes,
                                                                                     tmp_path, calib):
    url = recording_server.url
    attempt = _grasp(url, png_bytes).json()["attempt_id"]
    table_z = calib.table_z
    outcomes = recording_server.record_dir / OUTCOMES_FILE
    # Every field, an integer where a number goes, an unknown key: stored exactly as given.
    given = {"attempt_id": attempt, "success": False, "contact_stop": True, "fingertip_z": table_z + 0.043,
             "jaw_width": 0, "gripper_force_n": 2.9}
    assert _outcome(url, given).json() == {"recorded": True}
    stored = load_attempts(recording_server.record_dir)[0]["outcome"]
    assert stored == {"source": "http", **{k: v for k, v in given.items() if k != "attempt_id"}}
    assert isinstance(stored["jaw_width"], int)
    # A jaw closed on nothing reads a little below 0 (the validation cells send such widths): a reading, kept as given.
    assert _outcome(url, {"attempt_id": attempt, "success": False, "jaw_width": -0.00012}).status_code == 200
    assert load_attempts(recording_server.record_dir)[0]["outcome"]["jaw_width"] == -0.00012
    # null is "not known": kept as null.
    assert _outcome(url, {"attempt_id": attempt, "success": True, "fingertip_z": None}).status_code == 200
    size = outcomes.stat().st_size
    malformed = [
        {"contact_stop": "yes"}, {"contact_stop": 1}, {"fingertip_z": "0.04"}, {"fingertip_z": True},
        {"fingertip_z": table_z - 0.051}, {"fingertip_z": table_z + 1.001}, {"fingertip_z": 10 ** 400},
        {"jaw_width": -0.0051}, {"jaw_width": 0.1001}, {"jaw_width": [0.03]},
    ]
    for fields in malformed:
        r = _outcome(url, {"attempt_id": attempt, "success": True, **fields})
        assert r.status_code == 422 and next(iter(fields)) in r.json()["detail"], (fields, r.text)
    # NaN and Infinity are what Python's json writes for them (not JSON, but json.loads reads them).
    for raw in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"attempt_id": "%s", "success": true, "fingertip_z": %s}' % (attempt.encode(), raw)
        assert _outcome(url, body).status_code == 422, raw
    assert outcomes.stat().st_size == size  # nothing of the malformed ones was stored
    # A later outcome without the fields replaces the earlier one whole (CONTRACT.md section 7).
    assert _outcome(url, {"attempt_id": attempt, "success": True}).status_code == 200
    assert load_attempts(recording_server.record_dir)[0]["outcome"] == {"source": "http", "success": True}


def test_outcomes_without_a_recording_are_refused_before_the_body(live_server, png_bytes):
    # live_server has no record_dir: 409; without the token: 401 before anything is read.
    r = httpx.post(live_server.url + "/v1/outcome", json={"attempt_id": "1", "success": True}, headers=AUTH)
    assert r.status_code == 409 and "record_dir" in r.json()["detail"]
    assert httpx.post(live_server.url + "/v1/outcome", json={"attempt_id": "1", "success": True}).status_code == 401
    ans = _grasp(live_server.url, png_bytes)
    assert ans.status_code == 200 and "attempt_id" not in ans.json()


def test_a_killed_service_restarts_with_every_record_whole_and_new_ids(artifact_dir, png_bytes, tmp_path):
    rec_dir = tmp_path / "rec"

    def serve():
        port = free_port()
        proc = subprocess.Popen([str(BIN / "sim2real-serve"), f"artifact={artifact_dir}", f"port={port}",
                                 f"token={TOKEN}", "threads=1", "log_level=warning", "repeats.memory=0",
                                 f"record_dir={rec_dir}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, proc, timeout=60)
        return proc, url

    proc, url = serve()
    try:
        first = [_grasp(url, png_bytes).json()["attempt_id"] for _ in range(3)]
        assert _outcome(url, {"attempt_id": first[0], "success": False}).status_code == 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    proc, url = serve()
    try:
        second = [_grasp(url, png_bytes).json()["attempt_id"] for _ in range(2)]
        assert _outcome(url, {"attempt_id": first[1], "success": True}).status_code == 200  # an old id still known
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert not set(first) & set(second)
    attempts = load_attempts(rec_dir)
    assert [a["id"] for a in attempts] == first + second
    assert [a["outcome"] and a["outcome"]["success"] for a in attempts[:2]] == [False, True]
    assert all((rec_dir / a["frame"]).read_bytes() == png_bytes for a in attempts)


def test_a_reported_success_is_not_avoided_a_reported_failure_is(calib, frame):
    from perception.core.grasp import Grasp
    from perception.core.repeats import RepeatGuard

    guard = RepeatGuard(calib, {"memory": 8})
    fp = guard.fingerprint(frame)
    ok, bad = Grasp((0.5, 0.05, 0.02), 0.3, 0.05, 0.9), Grasp((0.45, 0.0, 0.02), 1.0, 0.05, 0.8)
    guard.answered(fp, ok, "000001")
    guard.answered(fp, bad, "000002")
    guard.reported("000001", True)
    guard.reported("000002", False)
    assert guard.failed(fp) == [bad]
