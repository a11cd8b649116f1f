"""The event classes of the AVE-style dataset: a name, a visual and a sound signature, synonyms.

Names follow the AVE benchmark (Tian et al., 2018). Each class is drawn as a shape of its own
color and heard as a sound of its own kind and pitch, so the label is recoverable from either
track, and the segment from both.
"""

from __future__ import annotations

from dataclasses import dataclass

from areno.rewards import SynonymTable


@dataclass(frozen=True)
class Event:
    name: str
    color: tuple[int, int, int]
    shape: str  # circle | square | triangle | cross | stripes | ring
    sound: str  # tone | chirp | pulses | noise
    freq: (
        float  # Hz: the tone's pitch, the chirp's start, the pulse pitch or the noise band's centre
    )


EVENTS: tuple[Event, ...] = (
    Event("church bell", (230, 200, 40), "circle", "tone", 880.0),
    Event("dog barking", (150, 90, 40), "square", "pulses", 400.0),
    Event("helicopter", (60, 160, 60), "cross", "pulses", 120.0),
    Event("violin", (180, 40, 40), "triangle", "tone", 660.0),
    Event("flute", (200, 200, 220), "stripes", "tone", 1320.0),
    Event("frying food", (240, 140, 30), "ring", "noise", 3000.0),
    Event("baby crying", (240, 150, 190), "circle", "chirp", 500.0),
    Event("motorcycle", (40, 40, 40), "square", "noise", 250.0),
    Event("train horn", (40, 80, 200), "stripes", "tone", 300.0),
    Event("clock ticking", (120, 120, 200), "ring", "pulses", 2000.0),
    Event("goat bleating", (230, 230, 230), "triangle", "chirp", 900.0),
    Event("chainsaw", (200, 60, 200), "cross", "noise", 1200.0),
)
EVENT_BY_NAME = {event.name: event for event in EVENTS}

# What a model may reasonably answer instead of the canonical name.
SYNONYMS = SynonymTable(
    {
        "church bell": ["bell", "bells", "bell ringing", "church bells ringing", "chime"],
        "dog barking": ["dog", "bark", "barking", "barking dog", "dog bark"],
        "helicopter": ["chopper", "helicopter rotor", "helicopter flying"],
        "violin": ["fiddle", "violin playing"],
        "flute": ["flute playing", "fife"],
        "frying food": ["frying", "sizzling", "food sizzling", "cooking"],
        "baby crying": ["baby cry", "crying baby", "infant crying", "baby"],
        "motorcycle": ["motorbike", "motor bike", "motorcycle engine"],
        "train horn": ["train whistle", "train", "horn"],
        "clock ticking": ["clock", "ticking", "tick tock"],
        "goat bleating": ["goat", "bleating", "bleat"],
        "chainsaw": ["chain saw", "saw"],
    }
)
