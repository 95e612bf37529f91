"""Operating the app on a multi-node Ray cluster, on CPU (bench/cluster_operations.py's shorter
settings): a head and five worker nodes started by hand (two `encoder_gpu` nodes, three
`decoder_gpu` nodes, the custom resources the GPU tiers ask for), deployments/configs/
cpu-cluster.yaml's tiers pinned to them, the tiny model. About 2 minutes on 2 cores;
`-m 'not cluster'` leaves it out.

1. A rolling update under load: `serve deploy` of a new `max_batch` (every replica replaced,
   the Router's too) and a second Decoder replica while clients send whole-answer requests and
   1000-token streams: no request fails, every stream ends with its final event and `[DONE]`,
   the old Decoder and Router finish what they hold. With `graceful_shutdown_timeout_s: 0` on the
   Decoder, the streams on the old one end early with the retryable error event (both request
   checks fail: shown once, 33 of 35 answered, the 2 streams interrupted).
2. Node loss under load: the worker node holding an encoder replica killed, then one holding a
   Decoder replica: at least 99% of whole answers are 200 and the rest 503 with Retry-After; a
   stream that was generating on the lost Decoder ends with a retryable error event and
   `[DONE]`; Serve replaces what was lost on another node of its type. Each node is killed
   while its replicas work on requests. Without the app's retry of calls to lost replicas
   (`deployments/placement.py` `call_with_retry`), the whole answers in flight on them are
   refused 503 (both request checks fail: shown once, 80 of 86 whole answers 200, 6 refused).

The cluster is shut down by the module's fixture, whether the tests pass or not."""
import json
import os

import pytest

pytest.importorskip("ray")
from bench import cluster_operations as ops  # noqa: E402
from tests.helpers import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture(scope="module")
def cluster():
    """The head and the five worker nodes (bench/cluster_operations.py's NODES), and the
    port Serve listens on; every process of it ended afterwards (PrivateCluster)."""
    with ops.OpsCluster() as cluster:
        yield cluster, free_port()


def keep(result: dict, folder, name: str) -> dict:
    """The whole result (every request, the replicas' timeline) in a temporary folder for a
    failure's inspection; its figures printed (`pytest -s`)."""
    ops.write_json(result, os.path.join(str(folder), f"{name}.json"))
    print("\n" + ops.brief({name: result["summary"]}))
    return result["summary"]


@pytest.fixture(scope="module")
def update(cluster, tmp_path_factory):
    _, port = cluster
    result = ops.rolling_update(port, ops.SHORT["update"])
    return keep(result, tmp_path_factory.mktemp("cluster-operations"), "rolling_update")


@pytest.fixture(scope="module")
def loss(cluster, tmp_path_factory):
    """On the updated app (one replica of each encoder tier, two Decoders): after the update's
    tests, the app as they left it; alone, deployed so."""
    nodes, port = cluster
    result = ops.node_loss(nodes, port, ops.SHORT["loss"])
    return keep(result, tmp_path_factory.mktemp("cluster-operations"), "node_loss")


def brief(summary: dict, *keys: str) -> str:
    """What a failed assertion shows."""
    return json.dumps({k: summary[k] for k in keys}, indent=1)


def test_a_rolling_update_under_load_fails_no_request(update):
    """Every request sent before, during and after the update is answered 200: none refused,
    none failed, none hung; the update did meet work in flight (whole answers and streams)."""
    requests = update["requests"]
    assert requests["ok"] == requests["total"] > 0, brief(update, "requests", "tiers")
    assert update["in_flight_at_update"]["plain"] > 0 and update["in_flight_at_update"]["stream"] > 0
    assert update["update_s"] is not None, brief(update, "tiers")  # it ended within its wait


def test_replicas_going_away_finish_their_streams(update):
    """Streams generating on the old Decoder when it was told to stop, and requests on the old
    Router when it was, ran to their end: each stream's last events are its final delta and
    `[DONE]` (the Decoder's and the Router's graceful shutdown let them finish)."""
    streams = update["streams_on_the_old_decoder_when_it_stopped"]
    assert streams["total"] > 0, brief(update, "tiers", "requests")  # the check bites
    assert streams["ok"] == streams["total"], brief(update, "requests", "tiers")
    on_router = update["requests_on_the_old_router_when_it_stopped"]
    assert on_router["total"] > 0 and on_router["ok"] == on_router["total"], brief(update, "requests", "tiers")
    assert update["requests"]["by_kind"]["stream"] == {"ok": update["settings"]["stream_clients"]}


def test_the_update_changed_the_app(update):
    """/ready's Decoder reports the new max_batch, the Decoder runs two replicas, and every
    replica (the Router's too: an argument changed) is a new one."""
    assert (update["decoder_max_batch_before"], update["decoder_max_batch_after"]) == (
        ops.serve_config(0)["applications"][0]["args"]["max_batch"], ops.UPDATE_ARGS["max_batch"])
    assert update["replicas_before"] == {"Router": 1, "GlobalEncoder": 1, "LocalEncoder": 1, "Decoder": 1}
    assert update["replicas_after"] == {"Router": 1, "GlobalEncoder": 1, "LocalEncoder": 1, "Decoder": 2}
    assert update["every_replica_replaced"] and update["ready_after"] == "ready"


def test_lost_nodes_lose_at_most_one_request_in_a_hundred(loss):
    """Whole answers: at least 99% are 200, the rest 503 with Retry-After (the JSON envelope);
    nothing else, none hung or lost. Streams: every one ends with `[DONE]`; one that fails was
    generating when a node went, and ends with the retryable error event."""
    requests = loss["requests"]
    assert requests["failed"] == 0, brief(loss, "requests", "losses")
    plain = requests["by_kind"]["plain"]
    assert set(plain) <= {"ok", "refused"}, brief(loss, "requests")
    assert requests["plain_ok_fraction"] >= 0.99, brief(loss, "requests", "losses")
    interrupted = sum(lost["in_flight_at_the_kill"]["interrupted"] for lost in loss["losses"])
    assert interrupted == requests["interrupted"], brief(loss, "requests", "losses")


def test_calls_in_flight_on_a_lost_replica_are_retried(loss):
    """Each node was killed while its replicas worked on requests (Serve's count, asked of
    them), and every whole answer in flight at a kill was answered 200: the Router retried the
    calls the lost replicas dropped, on the other Decoder or on the encoder's replacement."""
    for lost in loss["losses"]:
        assert lost["ongoing_on_the_lost_replicas"] > 0, brief(loss, "losses")  # the check bites
        in_flight = lost["in_flight_at_the_kill"]
        assert in_flight["whole_answers"] > 0, brief(loss, "losses")
        assert in_flight["whole_answers_ok"] == in_flight["whole_answers"], brief(loss, "requests", "losses")


def test_serve_replaces_what_a_lost_node_held(loss):
    """Each kill took a replica of its tier(s) with it; Serve noticed and started a replacement
    on another node of that type; the app is whole and ready afterwards."""
    encoder, decoder = loss["losses"]
    assert encoder["kind"] == "encoder" and set(encoder["lost"]) <= {"GlobalEncoder", "LocalEncoder"}
    assert decoder["kind"] == "decoder" and decoder["lost"] == {"Decoder": 1}
    for lost in (encoder, decoder):
        assert lost["noticed_s"] is not None and lost["replaced_s"] is not None, brief(loss, "losses")
        assert all(kinds == [lost["kind"]] for kinds in lost["replacements_on"].values()), lost
    assert loss["replicas_after"] == loss["replicas_before"], brief(loss, "replicas_before", "replicas_after")
    assert loss["ready_after"] == "ready"
