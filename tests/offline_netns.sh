#!/bin/sh
# Run a command with no network at all: a fresh network namespace (unshare -n, needs root) holding only
# loopback and a veth pair whose two ends both stay inside it. Chromium gathers no ICE candidates
# without a non-loopback interface, so the veth pair is there to make it start ICE; nothing can leave.
# Usage: tests/offline_netns.sh .venv/bin/python -m pytest tests/test_browser.py
set -e
if [ "$VOICERTC_IN_NETNS" != 1 ]; then
    exec unshare -n env VOICERTC_IN_NETNS=1 "$0" "$@"
fi
ip link set lo up
ip link add vrtc0 type veth peer name vrtc1
ip addr add 10.254.0.1/24 dev vrtc0
ip link set vrtc0 up
ip link set vrtc1 up
exec "$@"
