"""Tiers that scale apart on an autoscaling Ray cluster, on CPU: bench/autoscale_timeline.py's
shorter ramp (image-heavy, then text-heavy) against the tiny model on Ray's fake multi-node
autoscaler, deployed from deployments/configs/cpu-autoscaling.yaml, whose tiers ask for the
same custom resources as gpu-separate.yaml (encoder_gpu / decoder_gpu) from node types that
mirror cluster.yaml's groups. About 3 minutes on 2 cores; `-m 'not cluster'` leaves it out.

With autoscaling off (every tier at a fixed replica count) nothing scales and no node is added:
these tests fail."""
import json

import pytest

pytest.importorskip("ray")
from bench import autoscale_timeline  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

ENCODERS = {"GlobalEncoder", "LocalEncoder"}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    """One run of the shorter ramp; the cluster is shut down inside `run` (its `with` block),
    whether the run succeeds or not. The whole result (timeline, every request) is kept in a
    temporary folder for a failure's inspection."""
    result = autoscale_timeline.run(autoscale_timeline.SHORT)
    folder = tmp_path_factory.mktemp("autoscaling-timeline")
    autoscale_timeline.write_json(result, str(folder / "autoscaling-timeline-cpu.json"))
    return result["summary"]


def brief(summary: dict) -> str:
    """What a failed assertion shows: the events and outcomes, not the node types."""
    return json.dumps({k: summary[k] for k in ("phases", "requests", "scale_events", "node_events",
                                               "minimum", "end")}, indent=1)


def test_every_request_is_answered_or_refused_with_retry_after(summary):
    """200, or 503 / 429 with Retry-After; nothing else, nothing hung or lost; and the peak
    (10 clients against the Router's 8 in flight) did meet refusals, so the check bites."""
    requests = summary["requests"]
    assert summary["every_request_answered"], brief(summary)
    assert set(requests) <= {"total", "ok", "refused"}, brief(summary)
    assert requests.get("refused", 0) > 0, brief(summary)
    for phase in summary["phases"].values():
        assert phase["ok"] > 0, brief(summary)


def test_the_tier_that_is_short_scales_up_first_in_each_phase(summary):
    """Image-heavy: an encoder tier scales up first and the decoder not at all; text-heavy:
    the decoder scales up first and no encoder tier does (a phase's decisions: those taken
    during it that take a tier past the replicas it had as the phase began)."""
    images, text = summary["phases"]["image-heavy"], summary["phases"]["text-heavy"]
    assert images["first_scale_up"] and images["first_scale_up"]["tier"] in ENCODERS, brief(summary)
    assert "Decoder" not in images["tiers_scaled_up"], brief(summary)
    assert text["first_scale_up"] and text["first_scale_up"]["tier"] == "Decoder", brief(summary)
    assert not ENCODERS & set(text["tiers_scaled_up"]), brief(summary)


def test_nodes_of_the_type_the_tier_needs_are_added_then_removed(summary):
    """The autoscaler adds encoder nodes for the encoders and decoder nodes for the decoder,
    each in its phase (that of the scale-up that asked for it), and after the ramp removes them:
    the cluster ends at its minimum."""
    images, text = summary["phases"]["image-heavy"], summary["phases"]["text-heavy"]
    assert images["node_types_added"] == ["encoder"], brief(summary)
    assert text["node_types_added"] == ["decoder"], brief(summary)
    for kind in ("encoder", "decoder"):
        events = [e for e in summary["node_events"] if e["type"] == kind]
        added = [e["t_s"] for e in events if e["event"] == "added"]
        assert added and any(e["event"] == "removed" and e["t_s"] > added[0] for e in events), brief(summary)
    assert summary["back_at_minimum"], brief(summary)
    assert summary["end"]["nodes"] == summary["minimum"]["nodes"], brief(summary)


def synthetic_samples(events: list[tuple], nodes: list[tuple], seconds: int = 100) -> list[dict]:
    """A sample a second from scale events (t, tier, to) and node events (t, type, count)."""
    wanted, count, samples = {"GlobalEncoder": 1, "LocalEncoder": 1, "Decoder": 1}, {"encoder": 1, "decoder": 1}, []
    for t in range(seconds):
        wanted |= {tier: to for at, tier, to in events if at == t}
        count |= {kind: n for at, kind, n in nodes if at == t}
        samples.append({"t_s": float(t), "wanted": dict(wanted), "nodes": {"head": 1, **count}})
    return samples


@pytest.mark.parametrize("regrown, counted", [(2, False), (3, True)])
def test_a_tier_back_at_its_phase_start_count_has_not_scaled_up_in_that_phase(regrown, counted):
    """(No cluster.) The timeline of a run that failed once: the encoders scaled up in the
    image-heavy phase, down early in the text-heavy one and the GlobalEncoder back up to its
    phase-start count (an encoder node re-added for it): that is no text-heavy scale-up of the
    encoders, and the node belongs to the image-heavy phase. Past that count it is one."""
    events = [(5, "GlobalEncoder", 2), (5, "LocalEncoder", 2), (47, "Decoder", 2), (52, "GlobalEncoder", 1),
              (53, "LocalEncoder", 1), (66, "GlobalEncoder", regrown), (76, "GlobalEncoder", 1), (87, "Decoder", 1)]
    nodes = [(8, "encoder", 2), (50, "decoder", 2), (65, "encoder", 1), (67, "encoder", regrown), (80, "encoder", 1),
             (92, "decoder", 1)]
    minimum = {"replicas": {}, "wanted": {"GlobalEncoder": 1, "LocalEncoder": 1, "Decoder": 1},
               "nodes": {"head": 1, "encoder": 1, "decoder": 1}}
    phases = autoscale_timeline.timeline(synthetic_samples(events, nodes), [], autoscale_timeline.SHORT, minimum,
                                         {})["summary"]["phases"]
    text = phases["text-heavy"]
    assert phases["image-heavy"]["tiers_scaled_up"] == ["GlobalEncoder", "LocalEncoder"]
    assert text["first_scale_up"]["tier"] == "Decoder"
    assert ("GlobalEncoder" in text["tiers_scaled_up"]) is counted
    assert ("encoder" in text["node_types_added"]) is counted
