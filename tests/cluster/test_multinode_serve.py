"""Serving across nodes: the MediaDecoder and the Generator deployments, placed by their
`deployment_resources` on two different nodes of a real Ray cluster, answer an image request
from the official `openai` client over loopback HTTP; a missing file is a 400 that names the
decoder's node, and the server keeps serving.

Both simulated nodes share this machine's filesystem, so the file the test writes is readable
from either; which node read it is what Ray's own actor table and the error message tell.
"""

from __future__ import annotations

import openai
import pytest
from PIL import Image
from ray import serve
from ray.util import state

from areno.engine.config import EngineConfig
from areno.serve.app import APP_NAME, build_app
from areno.serve.config import ServeConfig
from tests.cluster.multinode import free_port, loopback_cluster

MODEL = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def cluster():
    # The head hosts the Generator; the "media" node the MediaDecoder. Processor and Ingress
    # carry no custom resources and go wherever CPUs are left.
    with loopback_cluster({"generation": 1, "media": 1}, dashboard=True) as made:
        yield made


@pytest.fixture(scope="module")
def client(cluster, tiny_path):
    port = free_port()
    config = ServeConfig(
        model_path=str(tiny_path("qwen3_5")),
        served_model_name=MODEL,
        port=port,
        engine=EngineConfig(max_running_prompts=2, max_context_len=512, num_cpus_per_rank=0.5),
        deployment_resources={"decoder": {"media": 1}, "generator": {"generation": 1}},
    )
    # NOTE: one HTTP proxy, on the head: the simulated nodes share this machine's ports, so a
    # proxy per node (Serve's EveryNode) would bind the same port twice.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
    finally:
        serve.shutdown()


def replica_nodes(cluster, deployment: str) -> set[str]:
    """The Ray node ids of `deployment`'s live replicas, from Ray's actor table."""
    actors = state.list_actors(
        address=cluster.dashboard,
        filters=[
            ("class_name", "=", f"ServeReplica:{APP_NAME}:{deployment}"),
            ("state", "=", "ALIVE"),
        ],
    )
    return {actor.node_id for actor in actors}


def ask_about(client, url: str):
    return client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What color is this?"},
                ],
            }
        ],
        max_tokens=4,
        temperature=0,
    )


def test_decoder_and_generator_run_on_the_nodes_they_ask_for(cluster, client):
    nodes = cluster.node_ids
    assert nodes["media"] != nodes["generation"]
    assert replica_nodes(cluster, "MediaDecoderServer") == {nodes["media"]}
    assert replica_nodes(cluster, "GeneratorServer") == {nodes["generation"]}


def test_image_request_is_decoded_on_one_node_and_generated_on_another(client, tmp_path):
    path = tmp_path / "red.png"
    Image.new("RGB", (64, 48), (220, 30, 30)).save(path)
    response = ask_about(client, str(path))
    assert response.model == MODEL
    assert response.choices[0].finish_reason in {"stop", "length"}
    assert response.usage.completion_tokens >= 1
    assert response.usage.prompt_tokens_details.image_tokens > 0


def test_missing_file_is_a_400_naming_the_decoder_node(cluster, client, tmp_path):
    missing = str(tmp_path / "not-on-the-media-node.png")
    with pytest.raises(openai.BadRequestError) as info:
        ask_about(client, missing)
    message = info.value.message
    assert missing in message
    assert f"Ray node {cluster.node_ids['media']}" in message
    assert cluster.node_ids["generation"] not in message
    # the server keeps serving
    path = tmp_path / "blue.png"
    Image.new("RGB", (32, 32), (30, 30, 220)).save(path)
    assert ask_about(client, str(path)).usage.prompt_tokens_details.image_tokens > 0
