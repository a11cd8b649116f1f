"""Decoding real files written by `areno.media.samples`."""

from __future__ import annotations

import hashlib

import av
import numpy as np
import pytest
from PIL import Image

from areno.media import (
    MissingFrameRateError,
    decode_audio,
    decode_image,
    decode_video,
    sample_frame_indices,
)
from areno.media import samples as media_samples

# --- images -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["png", "jpg", "webp", "rgba_png", "p_gif", "l_png"])
def test_image_decodes_to_rgb(media_files, name):
    path = getattr(media_files, name)
    data = path.read_bytes()
    got = decode_image(data, str(path))
    assert got.image.mode == "RGB"
    assert got.image.size == (64, 48)
    assert got.content_hash == hashlib.sha256(data).hexdigest()
    assert got.source == str(path)
    assert got.modality == "image"


def test_png_pixels_round_trip(media_files):
    got = decode_image(media_files.png.read_bytes(), "png")
    expected = media_samples.image_array(64, 48, seed=1)
    np.testing.assert_array_equal(np.asarray(got.image), expected)


def test_jpeg_exif_orientation_is_applied(media_files):
    # Orientation 6 = rotate 90° clockwise to display: the stored 64x48 shows as 48x64.
    with Image.open(media_files.jpg_rotated) as raw:
        assert raw.size == (64, 48)
        assert raw.getexif()[0x0112] == 6
    got = decode_image(media_files.jpg_rotated.read_bytes(), "rotated.jpg")
    assert got.image.size == (48, 64)


def test_rgba_is_composited_on_white(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (4, 4), (255, 0, 0, 0)).save(path)
    got = decode_image(path.read_bytes(), "clear.png")
    assert np.asarray(got.image).min() == 255


def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path):
    path = tmp_path / "deep.png"
    Image.fromarray(np.full((4, 4), 32896, np.uint16)).save(path)  # mid-grey in 16 bits
    got = decode_image(path.read_bytes(), "deep.png")
    assert np.asarray(got.image).max() == 128


def test_animated_gif_gives_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    pixel = decode_image(path.read_bytes(), "anim.gif").image.getpixel((0, 0))
    assert pixel[0] > 200 and pixel[2] < 50


# --- audio ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wav", "flac", "ogg", "m4a"])
def test_audio_decodes_to_mono_float32(media_files, name):
    path = getattr(media_files, name)
    got = decode_audio(path.read_bytes(), str(path), sampling_rate=16000)
    assert got.waveform.dtype == np.float32
    assert got.waveform.ndim == 1
    assert got.sampling_rate == 16000
    # AAC adds encoder priming, so m4a comes out a few ms longer than it went in.
    assert got.duration_s == pytest.approx(1.5, abs=0.05)
    assert 0.2 < np.abs(got.waveform).max() < 0.6  # the tone, not silence or clipping


def test_wav_samples_round_trip(media_files):
    got = decode_audio(media_files.wav.read_bytes(), "wav", sampling_rate=16000)
    expected = media_samples.tone(1.5, 16000)[:, 0]
    np.testing.assert_allclose(got.waveform, expected, atol=1e-4)  # 16-bit PCM quantisation


@pytest.mark.parametrize("name", ["mp3_stereo_44k", "wav_stereo_44k"])
def test_resample_44k_stereo_to_16k_mono(media_files, name):
    path = getattr(media_files, name)
    got = decode_audio(path.read_bytes(), str(path), sampling_rate=16000)
    assert got.waveform.dtype == np.float32
    assert got.waveform.shape == (32000,)  # 2 s at exactly 16 kHz
    # The downmix averages the channels: 440 Hz and 880 Hz tones at 0.3 each.
    spectrum = np.abs(np.fft.rfft(got.waveform))
    freqs = np.fft.rfftfreq(got.waveform.size, 1 / 16000)
    peaks = sorted(freqs[np.argsort(spectrum)[-2:]])
    assert peaks == pytest.approx([440.0, 880.0], abs=1.0)


def test_audio_at_target_rate_is_not_resampled(media_files):
    got = decode_audio(media_files.flac.read_bytes(), "flac", sampling_rate=16000)
    assert got.waveform.shape == (24000,)


# --- video ------------------------------------------------------------------------------------


def test_mp4_metadata_and_sampling(media_files):
    data = media_files.mp4.read_bytes()
    got = decode_video(data, "clip.mp4", fps=2.0, max_frames=32)
    assert got.fps == 4.0
    assert got.total_num_frames == 8
    assert got.duration_s == 2.0
    assert got.frame_indices == [0, 2, 4, 6]
    assert got.timestamps_s == [0.0, 0.5, 1.0, 1.5]
    assert got.frames.shape == (4, 48, 64, 3)
    assert got.frames.dtype == np.uint8
    assert got.content_hash == hashlib.sha256(data).hexdigest()
    assert got.audio is None


def test_video_frames_are_the_picked_frames(media_files):
    got = decode_video(media_files.mp4.read_bytes(), "clip.mp4", fps=2.0)
    for frame, index in zip(got.frames, got.frame_indices, strict=True):
        expected = media_samples.image_array(64, 48, seed=0, frame=index).astype(int)
        assert np.abs(frame.astype(int) - expected).mean() < 12  # lossy codec, right frame


def test_video_max_frames_subsamples_uniformly(media_files):
    got = decode_video(media_files.mp4.read_bytes(), "clip.mp4", fps=4.0, max_frames=3)
    assert got.frame_indices == [0, 4, 7]
    assert got.frames.shape[0] == 3


def test_video_fps_never_above_stream_rate(media_files):
    got = decode_video(media_files.mp4.read_bytes(), "clip.mp4", fps=30.0)
    assert got.frame_indices == list(range(8))


def test_mp4_with_audio_track(media_files):
    got = decode_video(
        media_files.mp4_with_audio.read_bytes(), "av.mp4", with_audio=True, audio_sampling_rate=8000
    )
    assert got.frames.shape == (4, 48, 64, 3)
    assert got.audio is not None
    assert got.audio.sampling_rate == 8000
    assert got.audio.waveform.dtype == np.float32
    assert got.audio.duration_s == pytest.approx(2.0, abs=0.1)
    assert got.audio.content_hash == got.content_hash


def test_with_audio_on_silent_video_gives_none(media_files):
    got = decode_video(media_files.mp4.read_bytes(), "clip.mp4", with_audio=True)
    assert got.audio is None


def test_no_frame_rate_sample_really_lacks_it(media_files):
    # The sample file must be what it claims: its stream reports no usable rate.
    with av.open(str(media_files.webm_no_fps)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate is None
        assert stream.guessed_rate == 1000  # Matroska's tick rate, FFmpeg's fallback
    with pytest.raises(MissingFrameRateError, match="remux"):
        decode_video(media_files.webm_no_fps.read_bytes(), "nofps.webm")


@pytest.mark.parametrize(
    ("total", "stream_fps", "target_fps", "max_frames", "expected"),
    [
        (8, 4.0, 2.0, 32, [0, 2, 4, 6]),
        (8, 4.0, 2.0, 2, [0, 6]),
        (1, 30.0, 2.0, 32, [0]),
        (10, 30.0, 2.0, 32, [0]),
        (100, 30.0, 1.0, 32, [0, 30, 60, 90]),
        (5, 2.0, 10.0, 32, [0, 1, 2, 3, 4]),
        (90, 29.97, 2.0, 4, [0, 30, 45, 75]),
    ],
)
def test_sample_frame_indices(total, stream_fps, target_fps, max_frames, expected):
    assert sample_frame_indices(total, stream_fps, target_fps, max_frames) == expected
