"""CosyVoice3 (Fun-CosyVoice3-0.5B) backend: what differs from CosyVoice2 lives here, the rest is imported."""
