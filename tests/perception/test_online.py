"""The online residual (online=true): bounded, saved and reloaded, and only re-ranking what
the network proposes."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perception.core.decode import DecodeOptions, decode_grasp
from perception.core.geometry import make_view
from perception.robot.online import OnlineResidual
from tests.perception.conftest import ThreadServer

AUTH = {"Authorization": "Bearer s3cret"}


def test_outcomes_move_the_shift_within_its_bound_and_it_survives_a_restart(tmp_path):
    res = OnlineResidual(tmp_path, angle_bins=4, options={"lr": 0.5, "bound": 0.2})
    for _ in range(10):
        res.update(2, 0.85, False)  # band 4 of bin 2 keeps failing
    assert res.shift[2, 4] == -0.2 and np.count_nonzero(res.shift) == 1
    res.update(1, 0.3, True)
    assert 0 < res.shift[1, 1] <= 0.2
    again = OnlineResidual(tmp_path, angle_bins=4, options={"lr": 0.5, "bound": 0.2})
    assert np.array_equal(again.shift, res.shift) and again.updates == 11
    q = np.full((4, 3, 3), 0.85)
    assert np.allclose(again.rerank(q)[2], -0.2) and np.allclose(again.rerank(q)[0], 0.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), threshold=st.floats(0.2, 0.8), bound=st.floats(0.0, 0.5))
def test_a_rerank_never_admits_a_grasp_the_network_put_below_its_threshold(calib, seed, threshold, bound):
    rng = np.random.default_rng(seed)
    view = make_view(calib, (32, 32), "table")
    A = 4
    q = rng.uniform(0, 1, (A, 32, 32)).astype(np.float32)
    w, h = np.full((32, 32), 0.05, np.float32), np.full((32, 32), 0.02, np.float32)
    shift = rng.uniform(-bound, bound, q.shape).astype(np.float32)
    plain = decode_grasp(q, w, h, calib, view, DecodeOptions(threshold))
    ranked = decode_grasp(q, w, h, calib, view, DecodeOptions(threshold), rerank=shift)
    assert (plain.grasp is None) == (ranked.grasp is None)  # the same candidates, another order
    if ranked.grasp is not None:
        u, v = (int(c) for c in ranked.view_pixel)
        assert q[ranked.angle_bin, v, u] >= threshold and ranked.grasp.quality == q[ranked.angle_bin, v, u]


def test_the_service_learns_online_from_reported_failures(artifact_dir, png_bytes, tmp_path):
    from perception.robot.service import create_app

    app = create_app(artifact_dir, token="s3cret", intra_op_num_threads=1, record_dir=tmp_path / "rec",
                     online=True, online_options={"lr": 0.5, "bound": 0.3})
    with ThreadServer(app) as srv:
        first = httpx.post(srv.url + "/v1/grasp", content=png_bytes, headers={**AUTH, "Content-Type": "image/png"}).json()
        for _ in range(3):
            r = httpx.post(srv.url + "/v1/outcome", json={"attempt_id": first["attempt_id"], "success": False},
                           headers=AUTH)
            assert r.status_code == 200
        metrics = httpx.get(srv.url + "/metrics", headers=AUTH).text
    assert "sim2real_online_updates 3.0" in metrics
    res = OnlineResidual(tmp_path / "rec", angle_bins=app.state.service.meta.angle_bins)
    assert res.updates == 3 and res.shift.min() < 0  # saved beside the recording
    with pytest.raises(ValueError, match="needs record_dir"):
        create_app(artifact_dir, online=True)
