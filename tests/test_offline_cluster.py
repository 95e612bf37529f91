"""Offline OCR (deployments/offline.py) on a two-node Ray cluster (`ray.cluster_utils.Cluster`,
through bench/autoscale_timeline.py's `PrivateCluster`): the encoder stages ask for the custom
resource encoder nodes declare and the decoder stage for the decoder nodes' (gpu-separate.yaml's
`encoder_gpu` / `decoder_gpu`), so each lands on its own node; every page comes back once."""
import io
import threading

import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
from bench.autoscale_timeline import PrivateCluster  # noqa: E402
from deployments.offline import Stages, ocr_dataset  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


class EncoderHead(PrivateCluster):
    """The head is the encoder node (it declares `encoder_gpu`); decoder nodes are added."""

    def _setup(self, gcs_address: str) -> tuple[dict, dict]:
        return {"resources": {"encoder_gpu": 2}}, {}


def stage_nodes() -> dict[str, set]:
    """The nodes the live actors of each stage run on (Ray Data's map workers, told apart by the
    name their process takes)."""
    from ray._private import state
    nodes = {}
    for actor in state.actors().values():
        if actor["State"] != "ALIVE" or not actor.get("Pid"):
            continue
        try:
            with open(f"/proc/{actor['Pid']}/cmdline") as f:
                name = f.read()
        except OSError:
            continue
        for stage in ("PathStage", "Decode"):
            if name.startswith(f"ray::MapWorker(MapBatches({stage}))"):
                nodes.setdefault(stage, set()).add(actor["Address"]["NodeID"])
    return nodes


def png(size: tuple[int, int], seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_encoder_and_decoder_stages_run_on_the_nodes_their_resources_name():
    with EncoderHead(head_cpus=2) as cluster:
        decoder_node = cluster.add_node({"decoder_gpu": 1}, num_cpus=1)
        encoder_node = ray.get_runtime_context().get_node_id()  # the driver's: the head
        rows = [{"path": f"p{i}.png", "bytes": png((640, 480), i)} for i in range(4)]
        ds = ocr_dataset(ray.data.from_items(rows), max_tokens=4, mode="tiny", stages=Stages(
            encoder_resources={"encoder_gpu": 1}, decoder_resources={"decoder_gpu": 1}))
        placed, done = {}, threading.Event()

        def watch():  # every actor of each pool, seen while it is up (a pool ends with its stage)
            while not done.is_set():
                for stage, nodes in stage_nodes().items():
                    placed.setdefault(stage, set()).update(nodes)
                done.wait(0.05)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            got = list(ds.iter_rows())
        finally:
            done.set()
            watcher.join()
        assert placed == {"PathStage": {encoder_node}, "Decode": {decoder_node.node_id}}
        assert sorted(row["source"] for row in got) == [row["path"] for row in rows]
        assert all(row["error"] is None and row["completion_tokens"] == 4 for row in got)
