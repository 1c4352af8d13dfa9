"""The grasp service over a real socket: contract answers, fuzzing, concurrency."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math

import cv2
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perception.core.calibration import Calibration, default_calibration_path, project_points
from perception.core.imageio import encode_image
from perception.core.testing import make_test_frame

AUTH = {"Authorization": "Bearer s3cret"}
pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")


def post(url, body, ctype="image/png", headers=AUTH, **kw):
    h = dict(headers or {})
    if ctype is not None:
        h["Content-Type"] = ctype
    return httpx.post(url + "/v1/grasp", content=body, headers=h, timeout=60, **kw)


def check_answer(ans: dict, calib: Calibration) -> None:
    assert set(ans) >= {"grasp", "pixel", "latency_ms", "reason"}
    assert ans["latency_ms"] >= 0
    if ans["grasp"] is None:
        assert ans["pixel"] is None and ans["reason"]
        return
    g = ans["grasp"]
    x, y, z = g["position"]
    assert calib.in_workspace(x, y)
    assert -math.pi / 2 < g["yaw"] <= math.pi / 2
    assert 0 <= g["width"] <= 0.08 and 0 <= g["quality"] <= 1
    np.testing.assert_allclose(ans["pixel"], project_points(np.array([g["position"]]), calib)[0], atol=1e-6)


def test_healthz_and_grasp(live_server, png_bytes, jpeg_bytes, calib):
    r = httpx.get(live_server.url + "/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    for body, ctype in ((png_bytes, "image/png"), (jpeg_bytes, "image/jpeg")):
        r = post(live_server.url, body, ctype)
        assert r.status_code == 200, r.text
        ans = r.json()
        check_answer(ans, calib)
        assert ans["grasp"] is not None and ans["reason"] is None
        assert ans["grasp"]["position"][0] == pytest.approx(0.5, abs=0.01)


def test_debug_image(live_server, png_bytes):
    r = post(live_server.url, png_bytes, params={"debug": 1})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    img = cv2.imdecode(np.frombuffer(r.content, np.uint8), cv2.IMREAD_COLOR)
    assert img.shape == (480, 640, 3)
    assert json.loads(r.headers["x-grasp-result"])["grasp"] is not None


def test_openapi_and_metrics(live_server, png_bytes):
    spec = httpx.get(live_server.url + "/openapi.json").json()
    body = spec["paths"]["/v1/grasp"]["post"]["requestBody"]["content"]
    assert set(body) == {"image/png", "image/jpeg"}
    post(live_server.url, png_bytes)
    post(live_server.url, b"junk")
    assert httpx.get(live_server.url + "/metrics").status_code == 401  # the token guards it too
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live_server.url + "/metrics", headers=AUTH).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    grasp_answers = {dict(k[1])["status"]: v for k, v in samples.items()
                     if k[0] == "sim2real_http_requests_total" and dict(k[1])["path"] == "/v1/grasp"}
    assert grasp_answers["200"] >= 1 and grasp_answers["400"] >= 1
    # Every answer was timed: the histogram's +Inf bucket counts them all.
    assert samples[("sim2real_http_request_duration_seconds_bucket", (("le", "+Inf"), ("path", "/v1/grasp")))] \
        == sum(grasp_answers.values())
    assert samples[("process_resident_memory_bytes", ())] > 10e6


def _png(arr):
    return cv2.imencode(".png", arr)[1].tobytes()


def bad_requests(png_bytes, jpeg_bytes):
    """(name, body, content type, headers, expected statuses)."""
    gray = cv2.cvtColor(cv2.imdecode(np.frombuffer(png_bytes, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2GRAY)
    rng = np.random.default_rng(0)
    small = make_test_frame(Calibration.load(default_calibration_path()).scaled((320, 240)))
    yield "random bytes", rng.bytes(5000), "image/png", AUTH, {400}
    yield "truncated png", png_bytes[: len(png_bytes) // 3], "image/png", AUTH, {400}
    yield "png header only", png_bytes[:40], "image/png", AUTH, {400}
    yield "truncated jpeg", jpeg_bytes[: len(jpeg_bytes) // 2], "image/jpeg", AUTH, {400}
    yield "jpeg header only", jpeg_bytes[:30], "image/jpeg", AUTH, {400}
    yield "empty body", b"", "image/png", AUTH, {400}
    yield "15 MB body", b"\x89PNG" + bytes(15 * 1024 * 1024), "image/png", AUTH, {413}
    yield "text/plain", png_bytes, "text/plain", AUTH, {415}
    yield "json", b'{"a": 1}', "application/json", AUTH, {415}
    yield "multipart", png_bytes, "multipart/form-data; boundary=x", AUTH, {415}
    yield "no content type", png_bytes, None, AUTH, {415}
    yield "wrong size", encode_image(small, "png"), "image/png", AUTH, {400}
    yield "grayscale png", _png(gray), "image/png", AUTH, {200, 400}
    yield "16-bit png", _png(gray.astype(np.uint16) * 257), "image/png", AUTH, {200, 400}
    yield "16-bit rgb png", _png(np.dstack([gray] * 3).astype(np.uint16) * 257), "image/png", AUTH, {200, 400}
    yield "rgba png", _png(np.dstack([gray] * 4)), "image/png", AUTH, {200, 400}
    yield "gif as png", b"GIF89a" + bytes(100), "image/png", AUTH, {400}
    yield "missing token", png_bytes, "image/png", {}, {401}
    yield "wrong token", png_bytes, "image/png", {"Authorization": "Bearer nope"}, {401}
    yield "wrong scheme", png_bytes, "image/png", {"Authorization": "Basic s3cret"}, {401}
    yield "jpeg labelled png", jpeg_bytes, "image/png", AUTH, {200, 400}


def test_fuzz_never_5xx(live_server, png_bytes, jpeg_bytes, calib):
    for name, body, ctype, headers, expected in bad_requests(png_bytes, jpeg_bytes):
        r = post(live_server.url, body, ctype, headers)
        assert r.status_code in expected, f"{name}: {r.status_code} {r.text[:200]}"
        if r.status_code == 200:
            check_answer(r.json(), calib)
        else:
            assert r.json()["detail"], name
        assert httpx.get(live_server.url + "/healthz").status_code == 200, name
    r = httpx.get(live_server.url + "/v1/grasp")
    assert r.status_code == 405
    r = httpx.post(live_server.url + "/v1/grasp?debug=banana", content=png_bytes,
                   headers={**AUTH, "Content-Type": "image/png"})
    assert r.status_code == 200


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_frames(live_server, png_bytes, jpeg_bytes, data):
    body = data.draw(st.sampled_from([png_bytes, jpeg_bytes]))
    ctype = "image/png" if body is png_bytes else "image/jpeg"
    arr = bytearray(body)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(arr) - 1))
        arr[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(arr)))
    r = post(live_server.url, bytes(arr[:cut]) if data.draw(st.booleans()) else bytes(arr), ctype)
    assert r.status_code in (200, 400), r.text[:200]


def _frames(calib, n):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x, y = rng.uniform(0.37, 0.63), rng.uniform(-0.13, 0.13)
        out.append(encode_image(make_test_frame(calib, spot_xy=(x, y), seed=i), "png"))
    return out


def _strip(ans):
    return {k: ans[k] for k in ("grasp", "pixel", "reason")}


def test_concurrent_clients_match_sequential(live_server, calib):
    frames = _frames(calib, 16)
    sequential = [_strip(post(live_server.url, f).json()) for f in frames]

    def client(k):
        out = []
        with httpx.Client(timeout=60) as c:
            for j in range(10):
                i = (k + j) % len(frames)
                r = c.post(live_server.url + "/v1/grasp", content=frames[i], headers={**AUTH, "Content-Type": "image/png"})
                out.append((i, r.status_code, r.json()))
        return out

    with cf.ThreadPoolExecutor(8) as ex:
        results = [x for res in ex.map(client, range(8)) for x in res]
    assert len(results) == 80
    for i, status, ans in results:
        assert status == 200
        assert _strip(ans) == sequential[i]
    # The bright spots move the grasp: answers differ between frames.
    assert len({json.dumps(s["grasp"]) for s in sequential}) > 1


def test_background_load_reports_503_then_ok(artifact_dir, png_bytes):
    from fastapi.testclient import TestClient

    from perception.robot.service import create_app

    app = create_app(artifact_dir, background_load=True)
    c = TestClient(app)  # no lifespan: the model never loads
    r = c.get("/healthz")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    assert c.post("/v1/grasp", content=png_bytes, headers={"Content-Type": "image/png"}).status_code == 503
    with TestClient(app) as c2:  # lifespan starts the loader
        import time

        for _ in range(200):
            if c2.get("/healthz").status_code == 200:
                break
            time.sleep(0.05)
        assert c2.get("/healthz").json() == {"status": "ok"}


def test_no_token_means_open(artifact_dir, png_bytes):
    from fastapi.testclient import TestClient

    from perception.robot.service import create_app

    c = TestClient(create_app(artifact_dir, token=None))
    assert c.post("/v1/grasp", content=png_bytes, headers={"Content-Type": "image/png"}).status_code == 200


def test_threshold_one_gives_null_grasp(artifact_dir, png_bytes):
    from fastapi.testclient import TestClient

    from perception.robot.service import create_app

    c = TestClient(create_app(artifact_dir, quality_threshold=1.0))
    ans = c.post("/v1/grasp", content=png_bytes, headers={"Content-Type": "image/jpeg"}).json()
    assert ans["grasp"] is None and ans["pixel"] is None and "threshold" in ans["reason"]


def test_refuses_to_start_on_other_image_size(artifact_dir, calib, tmp_path):
    from perception.core.artifact import ArtifactError
    from perception.robot.service import create_app

    path = tmp_path / "small.json"
    calib.scaled((320, 240)).save(path)
    with pytest.raises(ArtifactError, match="image_size is 320x240"):
        create_app(artifact_dir, calibration=path)


def test_drift_is_reported(artifact_dir, calib, tmp_path, caplog):
    from fastapi.testclient import TestClient

    from perception.robot.service import create_app

    T = calib.T_base_camera.copy()
    T[2, 3] += 0.02
    path = tmp_path / "moved.json"
    calib.replace(T_base_camera=T).save(path)
    with caplog.at_level("WARNING"):
        app = create_app(artifact_dir, calibration=path)
    assert "moved 20.0 mm" in caplog.text
    info = TestClient(app).get("/v1/info").json()
    assert any("moved" in w for w in info["calibration_warnings"])

