"""The shared processor path: chat messages (+ tools) + decoded media -> PromptInputs."""

from areno.processing.encode import MediaMismatchError, PromptLimits, encode_prompt
from areno.processing.messages import media_refs, to_template_messages, validate_messages
from areno.processing.processor import Processor, process_messages
from areno.processing.types import MediaSpan, PromptInputs

__all__ = [
    "MediaMismatchError",
    "MediaSpan",
    "Processor",
    "PromptInputs",
    "PromptLimits",
    "encode_prompt",
    "media_refs",
    "process_messages",
    "to_template_messages",
    "validate_messages",
]
