"""The engine as a Ray Serve deployment, and the front-end's client of it (`engine.backend = "ray"`).

- `wire`: what crosses between a front-end and a replica (versions, message shapes). No Ray import.
- `client.RemoteEngine`: the `voicertc.engine.protocol.Engine` seam over a deployment handle.
- `deployment`: the replica (today's EngineWorker + backend) and `build_app(config)`.
- `router.SessionAffinityRouter`: all utterances of one call on one replica.

Everything here but `wire` imports Ray: install the `scale` extra. In-process engines never import it.
"""
