"""A missing local media file names the node that looked for it, on a real two-node Ray cluster.

Both simulated nodes share this machine's filesystem, so "absent on that node" is a path that
exists nowhere; what the test proves is that the error comes from, and names, the node where the
MediaDecoder actor ran (its Ray node id), not the driver's or the head's.
"""

from __future__ import annotations

import socket

import pytest
import ray

from areno.media import MediaDecoder, MediaNotFoundError, MediaPolicy
from areno.media.samples import write_image
from areno.media.types import DecodedImage, MediaRef
from tests.cluster.multinode import loopback_cluster


@pytest.fixture(scope="module")
def cluster():
    """Ray node id by name: the head and one more node ("decoder"), on loopback only."""
    with loopback_cluster({"head": 1, "decoder": 1}) as made:
        yield made.node_ids


def decoder_on(node: str):
    """A MediaDecoder actor pinned to `node` ("head" / "decoder") by its custom resource."""
    actor_cls = ray.remote(MediaDecoder).options(num_cpus=0, resources={node: 1})
    return actor_cls.remote(MediaPolicy.for_training())


@pytest.mark.parametrize(("node", "other"), [("decoder", "head"), ("head", "decoder")])
def test_missing_file_names_the_decoding_node(cluster, tmp_path, node, other):
    assert cluster[node] != cluster[other]
    decoder = decoder_on(node)
    missing = str(tmp_path / "only-on-another-node.png")
    with pytest.raises(MediaNotFoundError) as info:
        ray.get(decoder.decode.remote(MediaRef("image", missing)))
    message = str(info.value)
    assert missing in message
    assert f"Ray node {cluster[node]}" in message
    assert cluster[other] not in message
    assert repr(socket.gethostname()) in message
    assert "ip 127.0.0.1" in message
    ray.kill(decoder)


def test_present_file_decodes_on_the_pinned_node(cluster, tmp_path):
    path = write_image(tmp_path / "here.png", 40, 30)
    decoder = decoder_on("decoder")
    decoded = ray.get(decoder.decode.remote(MediaRef("image", str(path))))
    local = MediaDecoder(MediaPolicy.for_training()).decode(MediaRef("image", str(path)))
    assert isinstance(decoded, DecodedImage)
    assert decoded.image.size == (40, 30)
    assert decoded.content_hash == local.content_hash
    ray.kill(decoder)
