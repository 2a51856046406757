"""A setting pinned for the model step a thread runs (`numerics.resolved` sets each module's pin).

Per thread because steps run on several threads at once (the async loop's model thread beside the host
thread): one process-wide value, saved and restored by blocks that interleave, could outlive them all.
"""

from __future__ import annotations

import threading


class StepPin(threading.local):
    """`.value`: what the step running on this thread pinned; None outside a step (on every thread)."""

    value = None
