"""Message content parts and chat messages, as Chat Completions clients send them.

Parts are discriminated by `type`, messages by `role`. Media parts (every part except `text`)
expose `modality`, `media_url` and `media_options`, so later layers never look at the wire shape.

Unknown-field policy: a content part (and the objects nested in it) forbids unknown fields, since a
misspelt key there silently drops media; a message ignores them, since clients echo back assistant
messages with fields such as `refusal` or `annotations`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

Modality = Literal["image", "audio", "video"]

# NOTE: read at validation time, so a deployment (or a test) may lower it by assignment.
MAX_PARTS_PER_MESSAGE = 512

INPUT_AUDIO_MIME_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "ogg": "audio/ogg",
    "opus": "audio/opus",
    "m4a": "audio/mp4",
    "aac": "audio/aac",
    "webm": "audio/webm",
}
InputAudioFormat = Literal["wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm"]

_URL = Annotated[str, Field(min_length=1)]


class _WireObject(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Part(_WireObject):
    # Sent by the official client for prompt caching; accepted so the client works, then unused.
    prompt_cache_breakpoint: dict[str, Any] | None = Field(default=None, exclude=True)


class TextPart(_Part):
    """`{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str


class MediaPart(_Part):
    """Base of every part that references one image, audio clip or video."""

    MODALITY: ClassVar[Modality]

    @property
    def modality(self) -> Modality:
        """One of "image", "audio", "video"."""
        return self.MODALITY

    @property
    def media_url(self) -> str:
        """A local path, `file://`, `data:` or `http(s)://` URL; resolved by the media layer.

        Every concrete part class overrides this; the base is never instantiated (the
        discriminated union only holds the concrete classes).
        """
        raise NotImplementedError(f"{type(self).__name__} must define media_url")

    @property
    def media_options(self) -> dict[str, Any]:
        """Per-item decoding options (e.g. `fps`, `max_frames`); empty when none were given."""
        return {}


class ImageURL(_WireObject):
    """The `image_url` object of an `image_url` part."""

    url: _URL
    detail: Literal["auto", "low", "high", "original"] | None = None


class AudioURL(_WireObject):
    """The `audio_url` object of an `audio_url` part."""

    url: _URL


class _VideoSampling(_WireObject):
    fps: float | None = Field(default=None, gt=0)
    max_frames: int | None = Field(default=None, gt=0)

    @property
    def media_options(self) -> dict[str, Any]:
        """The frame sampling options that were given."""
        return {
            k: v for k, v in (("fps", self.fps), ("max_frames", self.max_frames)) if v is not None
        }


class VideoURL(_VideoSampling):
    """The `video_url` object of a `video_url` part, with optional frame sampling options."""

    url: _URL


class InputAudio(_WireObject):
    """OpenAI's inline audio: bare base64 `data` plus its container `format`."""

    data: str = Field(min_length=1)
    format: InputAudioFormat

    @field_validator("data")
    @classmethod
    def _bare_base64(cls, data: str) -> str:
        if data.startswith("data:"):
            raise ValueError(
                "must be bare base64, not a data: URL; "
                "send a data: URL as an audio_url part instead"
            )
        return data


class ImageURLPart(MediaPart):
    """`{"type": "image_url", "image_url": {"url": ..., "detail"?: ...}}`."""

    MODALITY: ClassVar[Modality] = "image"
    type: Literal["image_url"]
    image_url: ImageURL

    @property
    def media_url(self) -> str:
        return self.image_url.url


class AudioURLPart(MediaPart):
    """`{"type": "audio_url", "audio_url": {"url": ...}}`."""

    MODALITY: ClassVar[Modality] = "audio"
    type: Literal["audio_url"]
    audio_url: AudioURL

    @property
    def media_url(self) -> str:
        return self.audio_url.url


class VideoURLPart(MediaPart):
    """`{"type": "video_url", "video_url": {"url": ..., "fps"?: ..., "max_frames"?: ...}}`."""

    MODALITY: ClassVar[Modality] = "video"
    type: Literal["video_url"]
    video_url: VideoURL

    @property
    def media_url(self) -> str:
        return self.video_url.url

    @property
    def media_options(self) -> dict[str, Any]:
        return self.video_url.media_options


class InputAudioPart(MediaPart):
    """`{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}`."""

    MODALITY: ClassVar[Modality] = "audio"
    type: Literal["input_audio"]
    input_audio: InputAudio

    @property
    def media_url(self) -> str:
        """A `data:audio/<subtype>;base64,...` URL; the base64 is not decoded here."""
        mime = INPUT_AUDIO_MIME_TYPES[self.input_audio.format]
        return f"data:{mime};base64,{self.input_audio.data}"


class _DirectPart(MediaPart):
    """The Hugging Face processor form: the reference in `url`, `path` or the modality key."""

    url: _URL

    @model_validator(mode="before")
    @classmethod
    def _normalise_reference(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        modality = cls.MODALITY
        keys = [key for key in ("url", "path", modality) if key in data]
        if len(keys) != 1:
            found = f" (got {', '.join(map(repr, keys))})" if keys else ""
            raise ValueError(
                f"give exactly one of 'url', 'path' or '{modality}': the {modality}'s path or URL"
                + found
            )
        key = keys[0]
        if not isinstance(data[key], str):
            raise ValueError(f"'{key}' must be a string (a path or URL)")
        if key != "url":
            data = {k: v for k, v in data.items() if k != key} | {"url": data[key]}
        return data

    @property
    def media_url(self) -> str:
        return self.url


class ImagePart(_DirectPart):
    """`{"type": "image", "url" | "path" | "image": ...}`."""

    MODALITY: ClassVar[Modality] = "image"
    type: Literal["image"]


class AudioPart(_DirectPart):
    """`{"type": "audio", "url" | "path" | "audio": ...}`."""

    MODALITY: ClassVar[Modality] = "audio"
    type: Literal["audio"]


class VideoPart(_VideoSampling, _DirectPart):
    """`{"type": "video", "url" | "path" | "video": ..., "fps"?: ..., "max_frames"?: ...}`."""

    MODALITY: ClassVar[Modality] = "video"
    type: Literal["video"]


_PART_CLASSES = (
    TextPart,
    ImageURLPart,
    AudioURLPart,
    VideoURLPart,
    InputAudioPart,
    ImagePart,
    AudioPart,
    VideoPart,
)
# NOTE: `Union[tuple]` builds the runtime union pydantic needs for a discriminated union.
ContentPart = Annotated[Union[_PART_CLASSES], Field(discriminator="type")]  # noqa: UP007


def _tags(classes: tuple[type[BaseModel], ...], field: str) -> tuple[str, ...]:
    return tuple(get_args(cls.model_fields[field].annotation)[0] for cls in classes)


CONTENT_PART_TYPES = _tags(_PART_CLASSES, "type")


def _check_num_parts(parts: Any) -> Any:
    if isinstance(parts, list) and len(parts) > MAX_PARTS_PER_MESSAGE:
        raise ValueError(
            f"{len(parts)} content parts exceed the limit of {MAX_PARTS_PER_MESSAGE} per message"
        )
    return parts


def _text_only(part: Any) -> Any:
    if isinstance(part, MediaPart):
        raise ValueError(
            f"only text parts are allowed in this message; put the {part.type} part in a user "
            "or tool message"
        )
    return part


def _content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "list"
    return None


def _content(item: Any) -> Any:
    """`str | list[item]`, tagged by Python type so errors carry no union noise."""
    parts = Annotated[list[item], BeforeValidator(_check_num_parts)]
    return Annotated[
        Union[Annotated[str, Tag("str")], Annotated[parts, Tag("list")]],  # noqa: UP007
        Discriminator(
            _content_kind,
            custom_error_type="content_type",
            custom_error_message="Input should be a string or an array of content parts",
        ),
    ]


TextContent = _content(Annotated[ContentPart, AfterValidator(_text_only)])
MediaContent = _content(ContentPart)


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    name: str | None = None


class SystemMessage(_Message):
    """A system prompt: a string or text parts."""

    role: Literal["system"]
    content: TextContent


class DeveloperMessage(_Message):
    """OpenAI's newer name for a system prompt; chat templates treat it as one."""

    role: Literal["developer"]
    content: TextContent


class UserMessage(_Message):
    """A user turn: a string, or typed parts mixing text and media."""

    role: Literal["user"]
    content: MediaContent


_Arguments = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[dict[str, Any], Tag("dict")]],  # noqa: UP007
    Discriminator(
        lambda v: "str" if isinstance(v, str) else "dict" if isinstance(v, dict) else None,
        custom_error_type="tool_arguments_type",
        custom_error_message="Input should be a JSON string or an object",
    ),
]


class AssistantFunctionCall(BaseModel):
    """The function a past assistant turn called.

    `arguments` is kept as given: a JSON string (OpenAI) or an object (Hugging Face templates).
    """

    name: str
    arguments: _Arguments


class AssistantToolCall(BaseModel):
    """One tool call of a past assistant turn."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: AssistantFunctionCall


class AssistantMessage(_Message):
    """A past assistant turn: text (or none), tool calls, and optional reasoning."""

    role: Literal["assistant"]
    content: TextContent | None = None
    tool_calls: list[AssistantToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value


class ToolMessage(_Message):
    """A tool result; it may carry media, e.g. a screenshot returned in an agentic rollout."""

    role: Literal["tool"]
    tool_call_id: str
    content: MediaContent


_MESSAGE_CLASSES = (SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage)
ChatMessage = Annotated[Union[_MESSAGE_CLASSES], Field(discriminator="role")]  # noqa: UP007
MESSAGE_ROLES = _tags(_MESSAGE_CLASSES, "role")


def iter_media_parts(messages: Iterable[Any]) -> Iterator[tuple[int, MediaPart]]:
    """Yield `(message_index, part)` for every media part, in message then part order."""
    for index, message in enumerate(messages):
        content = getattr(message, "content", None)
        if isinstance(content, list):
            for part in content:
                if isinstance(part, MediaPart):
                    yield index, part
