"""MediaDecoder: dispatch by modality, decode-once cache, per-call option overrides."""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest

from areno.errors import ConfigError
from areno.media import (
    DecodedAudio,
    DecodedImage,
    DecodedVideo,
    DecodeOptions,
    MediaDecoder,
    MediaPolicy,
    MediaRef,
)
from areno.media import decoder as decoder_module


@pytest.fixture
def decoder() -> MediaDecoder:
    return MediaDecoder(MediaPolicy.for_training(), DecodeOptions())


@pytest.fixture
def count_decodes(monkeypatch) -> dict[str, int]:
    """Counts calls into the real decode functions, per modality."""
    counts = {"image": 0, "audio": 0, "video": 0}
    for modality in counts:
        name = f"decode_{modality}"
        real = getattr(decoder_module, name)

        def counting(*args, _real=real, _modality=modality, **kwargs):
            counts[_modality] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(decoder_module, name, counting)
    return counts


def test_dispatch_by_modality(decoder, media_files):
    image = decoder.decode(MediaRef("image", str(media_files.png)))
    audio = decoder.decode(MediaRef("audio", str(media_files.wav)))
    video = decoder.decode(MediaRef("video", str(media_files.mp4)))
    assert isinstance(image, DecodedImage)
    assert isinstance(audio, DecodedAudio)
    assert isinstance(video, DecodedVideo)
    assert audio.sampling_rate == 16000
    assert video.frames.shape[0] == 4  # 2 s at the default 2 fps


def test_cache_hit_returns_same_object(decoder, media_files, count_decodes):
    ref = MediaRef("image", str(media_files.png))
    first = decoder.decode(ref)
    assert decoder.decode(ref) is first
    assert count_decodes["image"] == 1
    info = decoder.cache_info()
    assert (info["num_hits"], info["num_misses"], info["num_entries"]) == (1, 1, 1)


def test_same_content_from_another_url_is_decoded_once(decoder, media_files, count_decodes):
    data_url = "data:image/png;base64," + base64.b64encode(media_files.png.read_bytes()).decode()
    refs = [MediaRef("image", str(media_files.png)), MediaRef("image", data_url)]
    first, second = decoder.decode_many(refs)
    assert second is first
    assert count_decodes["image"] == 1


def test_decode_many_keeps_order_and_dedupes(decoder, media_files, count_decodes):
    refs = [
        MediaRef("video", str(media_files.mp4)),
        MediaRef("audio", str(media_files.wav)),
        MediaRef("video", str(media_files.mp4)),
    ]
    out = decoder.decode_many(refs)
    assert [m.modality for m in out] == ["video", "audio", "video"]
    assert out[0] is out[2]
    assert count_decodes == {"image": 0, "audio": 1, "video": 1}


def test_per_call_override(decoder, media_files, count_decodes):
    ref = MediaRef("video", str(media_files.mp4))
    default = decoder.decode(ref)
    fast = decoder.decode(ref, video_fps=4.0)
    assert default.frame_indices == [0, 2, 4, 6]
    assert fast.frame_indices == list(range(8))
    assert decoder.decode(ref, video_fps=4.0) is fast
    assert count_decodes["video"] == 2
    assert decoder.options.video_fps == 2.0  # the override did not stick


def test_override_of_another_modality_keeps_the_cache_entry(decoder, media_files, count_decodes):
    ref = MediaRef("image", str(media_files.png))
    first = decoder.decode(ref)
    assert decoder.decode(ref, video_fps=1.0, audio_sampling_rate=8000) is first
    assert count_decodes["image"] == 1


def test_video_with_audio_option(decoder, media_files):
    got = decoder.decode(MediaRef("video", str(media_files.mp4_with_audio)), video_with_audio=True)
    assert got.audio is not None and got.audio.sampling_rate == 16000


@pytest.mark.parametrize(
    "override",
    [{"video_fps": 0}, {"video_fps": float("nan")}, {"max_video_frames": 0}, {"no_such": 1}],
)
def test_bad_override_is_config_error(decoder, media_files, override):
    with pytest.raises(ConfigError):
        decoder.decode(MediaRef("video", str(media_files.mp4)), **override)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"audio_sampling_rate": 0},
        {"audio_sampling_rate": 16000.0},
        {"max_image_pixels": True},
        {"max_audio_seconds": -1},
        {"video_with_audio": "yes"},
    ],
)
def test_options_validation(kwargs):
    with pytest.raises(ConfigError):
        DecodeOptions(**kwargs)


def test_cache_is_bounded(media_files, count_decodes):
    decoder = MediaDecoder(MediaPolicy.for_training(), max_cache_entries=1)
    png, jpg = MediaRef("image", str(media_files.png)), MediaRef("image", str(media_files.jpg))
    decoder.decode(png)
    decoder.decode(jpg)  # evicts png
    decoder.decode(png)
    assert count_decodes["image"] == 3
    assert decoder.cache_info()["num_entries"] == 1


def test_cache_byte_budget(media_files):
    decoder = MediaDecoder(MediaPolicy.for_training(), max_cache_bytes=64 * 48 * 3)
    decoder.decode(MediaRef("image", str(media_files.png)))
    decoder.decode(MediaRef("audio", str(media_files.wav)))  # 96 kB of float32: not kept
    assert decoder.cache_info()["num_bytes"] <= 64 * 48 * 3


def test_decoder_pickles_without_its_cache(decoder, media_files):
    decoder.decode(MediaRef("image", str(media_files.png)))
    clone = pickle.loads(pickle.dumps(decoder))
    assert clone.cache_info()["num_entries"] == 0
    assert clone.policy == decoder.policy and clone.options == decoder.options
    got = clone.decode(MediaRef("image", str(media_files.png)))
    assert np.asarray(got.image).shape == (48, 64, 3)


def test_video_part_options_lower_the_frame_cap_but_never_raise_it(tmp_path):
    from areno.media import DecodeOptions, MediaDecoder, MediaPolicy
    from areno.media.samples import write_video
    from areno.media.types import MediaRef

    path = write_video(tmp_path / "v.mp4", seconds=4.0, fps=8.0)
    decoder = MediaDecoder(
        MediaPolicy.for_training(), DecodeOptions(video_fps=2.0, max_video_frames=6)
    )
    assert len(decoder.decode(MediaRef("video", str(path))).frame_indices) == 6
    fewer = decoder.decode(MediaRef("video", str(path), options={"fps": 1.0, "max_frames": 3}))
    assert len(fewer.frame_indices) == 3
    more = decoder.decode(MediaRef("video", str(path), options={"fps": 8.0, "max_frames": 1000}))
    assert len(more.frame_indices) == 6
