"""HTTP signaling for voicertc: the /v1/calls API, the web page, metrics, the CLI and agent embedding."""

from __future__ import annotations
